"""Chapter 03's DDP runs read back: the step times its script logged per mode, throughput, DDP's buckets, each
bucket's all-reduce timed alone, the overlap-cost benchmark, and a run's step modelled from its own measured parts.

    from gpucourse.models import ddpsteps
    ddpsteps.step_ms(main, "no-ddp")              # median step of a mode, mean over ranks (ms)
    ddpsteps.predict(main, overlap=True, overlap_cost=0.3)   # costs.DDPStep from the run's own measurements

A run is a RunResult (or anything with `.metrics` {rank: records} and `.world_size`). Records of
scripts/03_ddp_train.py: one with "params" (the run's facts), then per timed step {"mode", "step_ms",
"forward_ms", "backward_ms"}, and with --compare {"mode": "comm", "bucket_ms": [...]} per step.
"""
from __future__ import annotations

import statistics

from . import costs


def step_times(res, mode: str = "ddp", rank: int = 0, key: str = "step_ms") -> list[float]:
    """The timed steps of one mode on one rank (ms); key="forward_ms" or "backward_ms" for those passes alone."""
    return [rec[key] for rec in res.metrics[rank] if rec.get("mode") == mode]


def step_ms(res, mode: str = "ddp", key: str = "step_ms") -> float:
    """Median step time (or forward_ms, backward_ms) of a mode, averaged over ranks (ms)."""
    medians = []
    for r in range(res.world_size):
        times = step_times(res, mode, r, key)
        if not times:
            raise ValueError(f"rank {r} logged no {key} for mode {mode!r}: was it run (--compare for the modes)?")
        medians.append(statistics.median(times))
    return statistics.mean(medians)


def spread(res, mode: str) -> tuple[float, float]:
    """10th and 90th percentile of a mode's step times over every rank's steps (ms)."""
    values = sorted(v for r in range(res.world_size) for v in step_times(res, mode, r))
    return values[len(values) // 10], values[(9 * len(values)) // 10]


def throughput(res, batch: int, mode: str = "ddp") -> float:
    """Samples per second of the whole job: each rank's batch / its median step time, summed."""
    return sum(batch / (statistics.median(step_times(res, mode, r)) / 1e3) for r in range(res.world_size))


def info(res) -> dict:
    """The record the script logs once: modes, parameters, gradient bytes, DDP's buckets."""
    return next(rec for rec in res.metrics[0] if "params" in rec)


def comm_steps(res) -> list[list[list[float]]]:
    """Per rank, each comm step's bucket times (ms): every bucket's all-reduce timed alone, step by step."""
    return [[rec["bucket_ms"] for rec in res.metrics[r] if rec.get("mode") == "comm"] for r in range(res.world_size)]


def bucket_ms(res) -> list[float]:
    """Each bucket's all-reduce timed alone in the launch's comm steps: mean over steps, mean over ranks (ms).
    Means, not medians: the model adds the buckets up, and the sum of per-bucket means is the mean per-step
    total, while the sum of per-bucket medians is not the median total (see `median_sum_vs_total`)."""
    per_rank = comm_steps(res)
    if not per_rank[0]:
        raise ValueError("no comm steps in this run: launch the script with --compare")
    return [statistics.mean(statistics.mean(step[b] for step in steps) for steps in per_rank)
            for b in range(len(per_rank[0][0]))]


def median_sum_vs_total(res) -> tuple[float, float]:
    """(sum over buckets of each bucket's median time, median over steps of the per-step total), ms, mean over
    ranks: the two differ where one bucket is sometimes fast and sometimes slow."""
    per_rank = comm_steps(res)
    median_sum = statistics.mean(sum(statistics.median(s[b] for s in steps) for b in range(len(steps[0])))
                                 for steps in per_rank)
    median_total = statistics.mean(statistics.median(sum(s) for s in steps) for steps in per_rank)
    return median_sum, median_total


def predict(res, *, overlap: bool, overlap_cost: float = 0.0, comm: str = "alone", fit=None) -> costs.DDPStep:
    """Modelled step of a run: the compute and backward share of its own no-ddp steps, its communication
    (comm="alone": each bucket's all-reduce timed alone in the same launch; "line": the α–β `fit` at its logged
    buckets) and the overlap cost (0: free overlap)."""
    if comm not in ("alone", "line"):
        raise ValueError(f"comm={comm!r}: 'alone' (buckets timed alone) or 'line' (the α–β fit)")
    if comm == "line" and fit is None:
        raise ValueError("comm='line' needs fit=costs.fit_alpha_beta(...)")
    r, alone_ms = info(res), step_ms(res, "no-ddp")
    share = step_ms(res, "no-ddp", "backward_ms") / alone_ms
    if comm == "line":
        return costs.ddp_step_time(alone_ms / 1e3, r["grad_bytes"], res.world_size, fit.alpha, fit.beta,
                                   bucket_bytes=max(r["buckets"]), overlap=overlap, backward_fraction=share,
                                   overlap_cost=overlap_cost)
    return costs.ddp_step_from_bucket_times(alone_ms / 1e3, [t / 1e3 for t in bucket_ms(res)], overlap=overlap,
                                            backward_fraction=share, overlap_cost=overlap_cost)


def trial_ms(res, trials=("compute", "comm", "both")) -> dict[str, float]:
    """The overlap-cost benchmark (scripts/03_overlap_cost.py): each trial's median seconds, mean over ranks, ms."""
    out = {}
    for trial in trials:
        medians = [statistics.median(r["seconds"] for r in res.metrics[rank] if r.get("trial") == trial)
                   for rank in range(res.world_size)]
        out[trial] = statistics.mean(medians) * 1e3
    return out


def overlap_cost(trials: dict[str, float]) -> tuple[float, float]:
    """(measured, clipped) overlap cost = (both − max(compute, comm)) / min(compute, comm): 0 when side by side
    costs no more than the longer one, 1 when it costs both one after the other. Clipped to 0 … 1, the model's
    range (a value outside it is timing noise)."""
    shorter, longer = sorted([trials["compute"], trials["comm"]])
    if shorter <= 0:
        raise ValueError(f"compute and comm must both take time: {trials}")
    measured = (trials["both"] - longer) / shorter
    return measured, min(max(measured, 0.0), 1.0)


def why_missed(error: float, *, load: float, cores: int, noise: float, goal: float) -> str:
    """What a run measured that explains a prediction's miss (|error| > goal), or "" when it met the goal."""
    if abs(error) <= goal:
        return ""
    why = []
    if load > cores:
        why.append(f"loaded machine (load {load:.1f} on {cores} cores): the ranks waited for a core, in the "
                   "all-reduces too")
    if noise > goal:
        why.append(f"compute alone varied by {noise:.0%} (p10–p90) within its launch: more than the goal")
    return "; ".join(why) or "neither load nor compute noise: compare the model's terms with the traces"
