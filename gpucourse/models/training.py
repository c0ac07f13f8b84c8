"""What a training run's records say, and the two assumptions behind the linear scaling rule, measured
(chapter 04: large batches); the arithmetic of a run's data and time: what DistributedSampler gives each rank
(chapters 02, 04) and what uneven shards cost (chapter 08b), steps against examples around the critical batch
(McCandlish et al. 2018), how often to checkpoint a job that fails (chapter 08), what a hang idles (chapter 08b), a
job's goodput with a blocking or an asynchronous save (chapter 08c), the slow rank: the pace of a synchronous step,
and the rank that sets it named from its waits (chapter 08c), and the samples a job that trains through failures
loses (chapter 08d).

    from gpucourse.models import training
    runs = training.curves(result.metrics[0])          # {rule: {"header": {...}, "points": [records]}}
    training.at_epoch(runs["warmup"]["points"], 1.0)   # the evaluation nearest epoch 1
    training.sgd_assumptions(make_model, states, (X, Y), [32, 64], lr=0.0125)   # noise ∝ 1/B, k steps ≈ one
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: chapters' tables read records only
    import torch
    from torch import nn


# --- a run's records ---------------------------------------------------------------------------------
def curves(records: list[dict]) -> dict[str, dict]:
    """{rule: {"header": its header record, "points": its evaluation records in order}} from one rank's records
    (04_large_batch.py logs a header per rule, then records with "test_acc")."""
    out: dict[str, dict] = {}
    for rec in records:
        if rec.get("header"):
            out[rec["rule"]] = {"header": rec, "points": []}
        elif "test_acc" in rec:
            if rec["rule"] not in out:
                raise ValueError(f"a record of rule {rec['rule']!r} comes before its header record")
            out[rec["rule"]]["points"].append(rec)
    return out


def at_epoch(points: list[dict], epoch: float) -> dict:
    """The evaluation record nearest `epoch`."""
    return min(points, key=lambda p: abs(p["epoch"] - epoch))


def early_max_loss(points: list[dict]) -> float:
    """The largest loss of a single step in the first epoch (each averaged over the global batch)."""
    return max(loss for p in points if p["epoch"] <= 1 for loss in p["step_losses"])


def first_loss(points: list[dict]) -> float:
    """The loss of the very first step: the initial weights' loss on that batch."""
    return next(p["step_losses"][0] for p in points if p["step_losses"])


# --- the linear scaling rule's assumptions, measured -----------------------------------------------------
def gradient(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The cross-entropy gradient of all of net's parameters on (x, y), flattened into one vector."""
    import torch
    from torch import nn
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def gradient_noise(net, data, batch: int, draws: int = 32, generator=None) -> tuple[float, float]:
    """(mean of ‖g_B − G‖² over `draws` random batches of `batch` samples, ‖G‖²): G is the full-data gradient.
    data: (inputs, labels); batches are drawn with replacement."""
    import torch
    x, y = data
    full = gradient(net, x, y)
    diffs = []
    for _ in range(draws):
        idx = torch.randint(0, len(x), (batch,), generator=generator)
        diffs.append((gradient(net, x[idx], y[idx]) - full).pow(2).sum().item())
    return sum(diffs) / draws, full.pow(2).sum().item()


def k_steps_vs_one(net, data, k: int, lr: float, batch: int, draws: int = 8, generator=None) -> float:
    """‖k plain SGD steps of lr on k batches − one step of k·lr on their union‖ / ‖that one step‖, averaged over
    `draws` draws, each from net's current weights (restored afterwards)."""
    import torch
    x, y = data
    start = [p.detach().clone() for p in net.parameters()]
    w0 = torch.cat([s.flatten() for s in start])
    ratios = []
    for _ in range(draws):
        batches = [torch.randint(0, len(x), (batch,), generator=generator) for _ in range(k)]
        for idx in batches:  # k small steps
            gradient(net, x[idx], y[idx])
            with torch.no_grad():
                for p in net.parameters():
                    p -= lr * p.grad
        small = torch.cat([p.detach().flatten() for p in net.parameters()])
        with torch.no_grad():
            for p, s in zip(net.parameters(), start):
                p.copy_(s)
        union = torch.cat(batches)
        big_step = -k * lr * gradient(net, x[union], y[union])  # one big step, from the same start
        ratios.append(((small - (w0 + big_step)).norm() / big_step.norm()).item())
    return sum(ratios) / len(ratios)


def sgd_assumptions(make_model, states: dict, data, batches: list[int], *, lr: float, ks=(2, 4),
                    generator=None) -> dict[str, dict]:
    """Both assumptions at each state of the weights. states: {where: state_dict}, loaded into make_model().

    Returns {where: {"g2": ‖G‖², "b_noise": {B: B × mean ‖g_B − G‖²}, "trace": tr(Σ) estimated as the mean of
    b_noise, "noise_scale": tr(Σ)/‖G‖² (samples), "ks": {k: k_steps_vs_one at the smallest batch}}}."""
    if not batches:
        raise ValueError("sgd_assumptions needs at least one batch size")
    measured = {}
    for where, state in states.items():
        net = make_model()
        net.load_state_dict(state)
        noise = {b: gradient_noise(net, data, b, generator=generator) for b in batches}
        b_noise = {b: b * noise[b][0] for b in batches}
        trace, g2 = sum(b_noise.values()) / len(batches), noise[batches[0]][1]
        measured[where] = {"g2": g2, "b_noise": b_noise, "trace": trace, "noise_scale": trace / g2,
                           "ks": {k: k_steps_vs_one(net, data, k, lr, batches[0], generator=generator) for k in ks}}
    return measured


# --- the data each rank reads: DistributedSampler's arithmetic (chapters 02 and 04) ---------------------
def _whole(value, name, low=1):
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")


def sampler_shard(items: int, world_size: int, *, drop_last: bool = False) -> dict:
    """What torch's DistributedSampler gives each of `world_size` ranks in one epoch of `items` samples:
    {"per_rank": samples each rank reads, "padded": indices read twice (repeated from the start of the
    permutation so that every rank reads as many), "dropped": samples no rank reads (drop_last=True)}.
    Without drop_last, per_rank = ceil(items / N); with it, floor(items / N) (torch's ceil((items - N) / N))."""
    _whole(items, "items")
    _whole(world_size, "world_size")
    per_rank = items // world_size if drop_last else math.ceil(items / world_size)
    total = per_rank * world_size
    return {"per_rank": per_rank, "padded": max(total - items, 0), "dropped": max(items - total, 0)}


def steps_per_epoch(items: int, batch_per_rank: int, world_size: int, *, drop_last: bool = False) -> int:
    """Optimizer steps in one epoch of DDP: each rank's DataLoader (batch_size = batch_per_rank, its last
    batch kept) over that rank's DistributedSampler shard (sampler_shard). The global batch is
    batch_per_rank x world_size: N ranks take N times fewer steps an epoch than one."""
    _whole(batch_per_rank, "batch_per_rank")
    return math.ceil(sampler_shard(items, world_size, drop_last=drop_last)["per_rank"] / batch_per_rank)


def uneven_shards(batches: list[int] | tuple[int, ...]) -> dict:
    """What uneven shards (rank r holds batches[r] batches: a data set that does not split evenly, ranks that filter
    their data differently) cost under the two fixes of chapter 08b, where every rank must run the same collectives:
    {"common_steps": min(batches), the steps every rank can run (the exercise's all-reduce with MIN, or
    DistributedSampler(drop_last=True)); "dropped": the batches that fix never trains on, sum - N * min;
    "join_steps": max(batches), the steps under torch's Join, which trains every batch; "shadowed": the steps ranks
    spend under Join with no batch left, joining the others' all-reduces with zeros, N * max - sum; "idle_share":
    shadowed / (N * max), the share of the ranks' steps under Join that train nothing; "dropped_share": dropped / sum,
    the share of the data the common step count leaves out}."""
    if not batches:
        raise ValueError("uneven_shards needs each rank's batch count")
    for b in batches:
        _whole(b, "each rank's batches", low=0)
    n, total, low, high = len(batches), sum(batches), min(batches), max(batches)
    dropped, shadowed = total - n * low, n * high - total
    return {"common_steps": low, "dropped": dropped, "join_steps": high, "shadowed": shadowed,
            "idle_share": shadowed / (n * high) if high else 0.0, "dropped_share": dropped / total if total else 0.0}


# --- steps against examples: the critical batch (McCandlish et al. 2018, arXiv 1812.06162) ----------------
def batch_tradeoff(batch: float, critical_batch: float) -> dict:
    """Steps and examples a run at a fixed `batch` needs to reach a given loss, over their minimums:
    {"steps": S / S_min = 1 + B_crit / B, "examples": E / E_min = 1 + B / B_crit}, the two sides of
    McCandlish et al.'s (S/S_min - 1)(E/E_min - 1) = 1 (their eq. 2.11), with B_crit = E_min / S_min about the
    gradient noise scale (B_noise = tr(Sigma) / |G|^2, what chapter 04 measures). Far below B_crit a k times
    larger batch takes about k times fewer steps (the linear scaling rule's regime); far above, hardly fewer."""
    for value, name in ((batch, "batch"), (critical_batch, "critical_batch")):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 (samples), got {value!r}")
    return {"steps": 1 + critical_batch / batch, "examples": 1 + batch / critical_batch}


# --- failures and checkpoints (chapter 08) ---------------------------------------------------------------
def mean_time_between_failures(seconds: float, failures: int) -> float:
    """The mean time between failures of a job (seconds) from a record: `failures` interruptions in `seconds`
    of running (Llama 3 405B: 419 unexpected interruptions in a 54-day snapshot on 16,384 GPUs)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    _whole(failures, "failures")
    return seconds / failures


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds of work between checkpoints) that loses the least time, to first order:
    sqrt(2 C M) for a checkpoint that takes C seconds and failures M seconds apart on average (Young, CACM 1974;
    Daly, FGCS 2006, gives higher-order terms). It minimises checkpoint_overhead's first two terms,
    C / tau + tau / (2 M): checkpointing more often pays C more often, less often loses more work per failure."""
    if not checkpoint_s >= 0 or not mtbf_s > 0:
        raise ValueError(f"checkpoint_s must be >= 0 and mtbf_s > 0, got {checkpoint_s!r}, {mtbf_s!r}")
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def checkpoint_overhead(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> dict:
    """The share of a job's time lost to checkpoints and failures, first order (failures rare against the
    interval): {"saving": C / tau (the job stops to save every tau seconds of work), "rework": (tau / 2) / M
    (a failure loses half an interval of work on average), "restart": R / M, "total": their sum}. A checkpoint
    saved asynchronously (dcp.async_save) costs less than C: pass what the training loop waits."""
    if not interval_s > 0 or not mtbf_s > 0 or not checkpoint_s >= 0 or not restart_s >= 0:
        raise ValueError("interval_s and mtbf_s must be > 0, checkpoint_s and restart_s >= 0, got "
                         f"{interval_s!r}, {mtbf_s!r}, {checkpoint_s!r}, {restart_s!r}")
    parts = {"saving": checkpoint_s / interval_s, "rework": interval_s / 2 / mtbf_s, "restart": restart_s / mtbf_s}
    return {**parts, "total": sum(parts.values())}


# --- hangs (chapter 08b) ------------------------------------------------------------------------------------
# What init_process_group waits in a stuck collective when given no timeout (torch.distributed.constants:
# default_pg_timeout, default_pg_nccl_timeout; torch's documentation of init_process_group), in seconds. Chapter 08
# reads them from torch; tests/unit/models/test_training.py holds these to the installed torch's.
DEFAULT_TIMEOUTS_S = {"gloo": 30 * 60, "nccl": 10 * 60}


def hang_gpu_hours(gpus: int, wait_s: float) -> float:
    """GPU-hours a hang idles: every GPU of the job waits `wait_s` seconds (in the stuck collective until the hang is
    detected, on NCCL the watchdog's timeout, DEFAULT_TIMEOUTS_S, then whatever comes before work resumes: a
    restart), gpus * wait_s / 3600."""
    _whole(gpus, "gpus")
    if not wait_s >= 0:
        raise ValueError(f"wait_s must be >= 0, got {wait_s!r}")
    return gpus * wait_s / 3600


# --- checkpoints that do not stop training, and slow ranks (chapter 08c) -----------------------------------
LLAMA3_FAILURES = {"days": 54, "unexpected": 419, "gpus": 16_384}  # Grattafiori et al. 2024, section 3.3.4


def scaled_mtbf(mtbf_s: float, gpus: int, to_gpus: int) -> float:
    """The MTBF of a job on `to_gpus` GPUs from one measured on `gpus`, each GPU failing independently at the same
    rate (failures per second add up over the GPUs): mtbf_s * gpus / to_gpus. Llama 3's 3.1 h on 16,384 GPUs is
    about 5.8 years per GPU, so 5.8 years / 1,024 = 50 h on 1,024 GPUs."""
    _whole(gpus, "gpus")
    _whole(to_gpus, "to_gpus")
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s must be > 0, got {mtbf_s!r}")
    return mtbf_s * gpus / to_gpus


def goodput(interval_s: float, lost_s: float, mtbf_s: float, restart_s: float = 0.0, lag_s: float = 0.0) -> float:
    """The share of a job's wall time spent on work it keeps, to first order in 1 / MTBF, checkpointing every
    `interval_s` seconds of work. Each period is interval_s of work plus `lost_s`, what the training loop loses to
    one save (a blocking save's whole time; an asynchronous one's staging, and the steps its writer slowed). A
    failure, every `mtbf_s` seconds of wall time on average, costs `restart_s` plus the time since the last
    COMPLETE checkpoint: half a period on average, plus `lag_s` when a checkpoint is complete only lag_s seconds
    after the loop moved on (an asynchronous save's write; a failure in that window falls back to the one before):
        goodput = interval / (interval + lost) * (1 - (restart + (interval + lost) / 2 + lag) / mtbf)
    Its maximum over the interval is, to first order, Young's sqrt(2 * lost * mtbf) (young_daly_interval)."""
    if not interval_s > 0 or not mtbf_s > 0 or min(lost_s, restart_s, lag_s) < 0:
        raise ValueError("interval_s and mtbf_s must be > 0, lost_s, restart_s and lag_s >= 0, got "
                         f"{interval_s!r}, {mtbf_s!r}, {lost_s!r}, {restart_s!r}, {lag_s!r}")
    period = interval_s + lost_s
    return interval_s / period * max(0.0, 1 - (restart_s + period / 2 + lag_s) / mtbf_s)


def synchronous_step_time(busy_s: list[float] | tuple[float, ...], sync_s: float = 0.0) -> float:
    """A synchronous data-parallel step: every rank waits in the gradient all-reduce for the last one to arrive,
    so the slowest rank sets the pace: max(busy) + sync, busy_s holding each rank's own work (its compute, and
    whatever slows it), sync_s the all-reduce once all have arrived. One rank slowed by d makes every rank's step
    longer by d (less the others' slack)."""
    if not busy_s or min(busy_s) < 0 or sync_s < 0:
        raise ValueError(f"busy_s must be non-empty and >= 0, sync_s >= 0, got {busy_s!r}, {sync_s!r}")
    return max(busy_s) + sync_s


def expected_step_with_stragglers(step_s: float, delay_s: float, p: float, ranks: int) -> float:
    """The mean synchronous step when each of `ranks` ranks is, independently, slowed by `delay_s` in a step with
    probability `p` (a hiccup: a page fault, a noisy neighbour, a GPU throttling): the step is slowed whenever any
    rank is, step_s + delay_s * (1 - (1 - p) ** ranks). One rank in a thousand hiccuping, on a thousand ranks, slows
    most steps."""
    _whole(ranks, "ranks")
    if not 0 <= p <= 1 or step_s < 0 or delay_s < 0:
        raise ValueError(f"p must be in [0, 1], step_s and delay_s >= 0, got {p!r}, {step_s!r}, {delay_s!r}")
    return step_s + delay_s * (1 - (1 - p) ** ranks)


def waits(arrivals: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """{sequence id: {rank: seconds it waited for the last rank to call that collective}} from when each rank called
    it (forensics.arrivals): the last to arrive waits 0. Only collectives every rank called are kept."""
    ranks = set().union(*arrivals.values()) if arrivals else set()
    return {seq: {r: max(at.values()) - t for r, t in at.items()} for seq, at in arrivals.items()
            if set(at) == ranks}


def rank_steps(steps: dict[int, list[dict]], arrivals: dict[int, dict[int, float]]) -> list[dict]:
    """One row per (rank, step record): its wall time `step_s`, the seconds it waited in collectives (`wait_s`: how
    long, between the record's `start` and `end`, it had called a collective the last rank had not: a union, since
    DDP starts a bucket's all-reduce before the previous one is done) and `busy_s`, the rest (its own work).
    steps: {rank: its step records, each with step, step_s, start, end (time.time())}; their other keys are kept."""
    from .traces import total, union

    waited = waits(arrivals)
    rows = []
    for rank, records in sorted(steps.items()):
        for rec in records:
            w = total(union([(arrivals[seq][rank], arrivals[seq][rank] + at[rank]) for seq, at in waited.items()
                             if rec["start"] <= arrivals[seq][rank] <= rec["end"]]))
            rows.append({**{k: v for k, v in rec.items() if k not in ("start", "end")}, "rank": rank,
                         "wait_s": w, "busy_s": rec["step_s"] - w})
    return rows


def straggler(rows: list[dict]) -> dict:
    """The slow rank of a synchronous run, from rank_steps' rows (one phase): each rank's median own work (busy_s)
    and wait; the rank whose work is longest, and its `slowdown` (its median busy time over the median of the
    others' busy times) and `extra_s` (the difference: what it adds to every step). Every rank's step time is the
    same in a synchronous job: only how long each waits tells the slow one apart."""
    from statistics import median

    ranks = sorted({r["rank"] for r in rows})
    if len(ranks) < 2:
        raise ValueError("a straggler needs at least two ranks' rows")
    busy = {k: median(r["busy_s"] for r in rows if r["rank"] == k) for k in ranks}
    wait = {k: median(r["wait_s"] for r in rows if r["rank"] == k) for k in ranks}
    slow = max(ranks, key=busy.get)
    others = median(busy[k] for k in ranks if k != slow)
    return {"rank": slow, "busy_s": busy, "wait_s": wait, "extra_s": busy[slow] - others,
            "slowdown": busy[slow] / others if others > 0 else math.inf}


# --- training through failures: replica groups (chapter 08d) -----------------------------------------------------
def replica_loss(replicas: int, down: float, span: float, *, failures: int = 1, missing: int = 1) -> dict:
    """What failures cost a job of `replicas` replica groups that trains through them (torchft): while `missing`
    groups are out (dead, restarting, healing), the others keep committing steps, each with fewer batches; the
    missing groups' batches of those steps are never trained on. `down` is how long each failure keeps them out and
    `span` the whole run, in one unit (steps, or seconds). {"samples": the share of an uninterrupted run's samples
    lost, failures * down / span * missing / replicas; "full_restart": the share of the run's time a job that stops
    every group for each failure (a classic torchrun restart, down long) loses, failures * down / span}. The few
    seconds the survivors spend forming a quorum without the dead group, and the step they drop, are left out."""
    _whole(replicas, "replicas")
    _whole(failures, "failures", low=0)
    _whole(missing, "missing")
    if missing > replicas or not down >= 0 or not span > 0:
        raise ValueError(f"missing must be <= replicas, down >= 0 and span > 0, got {missing!r}, {replicas!r}, "
                         f"{down!r}, {span!r}")
    idle = failures * down / span
    return {"samples": idle * missing / replicas, "full_restart": idle}
