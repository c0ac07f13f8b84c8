"""Chapter 03, profiling and scaling: the tables it shows from its runs.

`notebooks/03_profiling_and_scaling.ipynb` imports it by its short name:

    from gpucourse.chapters import ch03
    ch03.ddp_modes(res)                  # what communication adds to compute alone

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
"""
from __future__ import annotations

import pandas as pd

from ..models.units import human_bytes
from ..viz.tables import as_table


@as_table
def ddp_modes(res) -> pd.DataFrame:
    """Chapter 03's main run, one row per mode: its median step (ms, mean over ranks), the 10th and 90th
    percentile of all ranks' steps, and what communication adds to compute alone (ms and %)."""
    from ..models import ddpsteps

    alone = ddpsteps.step_ms(res, "no-ddp")
    rows = []
    for title, mode in (("compute alone (no-ddp)", "no-ddp"), ("DDP (overlap)", "ddp"),
                        ("DDP without overlap", "no-overlap")):
        ms, (lo, hi) = ddpsteps.step_ms(res, mode), ddpsteps.spread(res, mode)
        rows.append({"mode": title, "median step (ms)": ms, "p10 (ms)": lo, "p90 (ms)": hi,
                     "comm adds (ms)": ms - alone if mode != "no-ddp" else None,
                     "comm adds (%)": 100 * (ms - alone) / alone if mode != "no-ddp" else None})
    return pd.DataFrame(rows).set_index("mode").round(1)


@as_table
def bucket_runs(variants: dict, analyses: dict) -> pd.DataFrame:
    """One row per bucket variant: DDP's buckets, the median step of its mode and the same launch's compute
    alone (no-ddp steps), then the trace's means per step, averaged over ranks: compute, all-reduce, exposed
    all-reduce (ms) and the share hidden (%). variants: {title: (run, trace name, mode)}; analyses: {title:
    traces.analyze_run(...)}."""
    from ..models import ddpsteps

    rows = []
    for title, (res, _, mode) in variants.items():
        trace = analyses[title].table()
        mean = {k: sum(r[k] for r in trace) / len(trace) for k in ("compute_ms", "comm_ms", "exposed_comm_ms")}
        rows.append({"run": title, "buckets": len(ddpsteps.info(res)["buckets"]),
                     "median step (ms)": ddpsteps.step_ms(res, mode),
                     "compute alone (ms)": ddpsteps.step_ms(res, "no-ddp"),
                     "traced compute (ms)": mean["compute_ms"], "all-reduce (ms)": mean["comm_ms"],
                     "exposed (ms)": mean["exposed_comm_ms"],
                     "hidden (%)": 100 * (1 - mean["exposed_comm_ms"] / mean["comm_ms"]) if mean["comm_ms"] else None})
    return pd.DataFrame(rows).set_index("run").round(1)


@as_table
def scaling_runs(throughputs: dict[int, list[float]], efficiency: dict[int, float]) -> pd.DataFrame:
    """One row per world size: the samples/s of each launch, their mean, and the scaling efficiency (%).
    throughputs: {N: [samples/s per launch]}; efficiency: timeline.efficiencies(throughputs)."""
    rows = [{"ranks": n, "samples/s (each launch)": [round(v) for v in values],
             "mean (samples/s)": round(sum(values) / len(values)), "efficiency (%)": round(100 * efficiency[n])}
            for n, values in throughputs.items()]
    return pd.DataFrame(rows).set_index("ranks")


@as_table
def allreduce_fit(measured: list[tuple[int, float]], fit) -> pd.DataFrame:
    """One row per all-reduce size: the measured time and the α–β fit's (ms). measured: [(bytes, seconds)]."""
    rows = [{"size": human_bytes(size), "measured (ms)": round(seconds * 1e3, 3),
             "α–β fit (ms)": round(fit.predict(size) * 1e3, 3)} for size, seconds in measured]
    return pd.DataFrame(rows).set_index("size")


@as_table
def overlap_trials(trials: dict[str, float]) -> pd.DataFrame:
    """The overlap-cost benchmark: each trial's time (ms), and what side by side would take for free (the longer
    of compute and comm) and one after the other (their sum). trials: ddpsteps.trial_ms(...)."""
    shorter, longer = sorted([trials["compute"], trials["comm"]])
    rows = [*({"trial": t, "time (ms)": ms} for t, ms in trials.items()),
            {"trial": "free overlap would take", "time (ms)": longer},
            {"trial": "one after the other would take", "time (ms)": longer + shorter}]
    return pd.DataFrame(rows).set_index("trial").round(1)


@as_table
def step_predictions(variants: dict, *, overlap_cost: float, fit, load: dict) -> pd.DataFrame:
    """One row per configuration: the modelled step from the run's own parts (ddpsteps.predict: buckets timed
    alone; with the α–β line; with free overlap) against the measured step, in ms, and each prediction's error
    (%, (predicted − measured) / measured), with the load average around the launch. Unrounded errors (fractions)
    in `.attrs["errors"]`: {"alone" | "line" | "free": {title: error}}. variants: {title: (run, trace name,
    mode)}; load: {run name: (before, after)}."""
    from ..models import ddpsteps

    rows, errors = [], {"alone": {}, "line": {}, "free": {}}
    for title, (res, _, mode) in variants.items():
        overlap = mode == "ddp"
        model = ddpsteps.predict(res, overlap=overlap, overlap_cost=overlap_cost)
        line = ddpsteps.predict(res, overlap=overlap, overlap_cost=overlap_cost, comm="line", fit=fit)
        free = ddpsteps.predict(res, overlap=overlap)
        measured = ddpsteps.step_ms(res, mode)
        for kind, m in (("alone", model), ("line", line), ("free", free)):
            errors[kind][title] = (m.step * 1e3 - measured) / measured
        before, after = load[res.name]
        rows.append({"run": title, "buckets": model.num_buckets, "compute (ms)": model.compute * 1e3,
                     "comm alone (ms)": model.comm * 1e3, "comm, line (ms)": line.comm * 1e3,
                     "hidden (ms)": model.hidden * 1e3, "predicted (ms)": model.step * 1e3,
                     "predicted, line (ms)": line.step * 1e3, "predicted, free overlap (ms)": free.step * 1e3,
                     "measured (ms)": measured, "error (%)": 100 * errors["alone"][title],
                     "error, line (%)": 100 * errors["line"][title], "error, free (%)": 100 * errors["free"][title],
                     "load before → after": f"{before:.1f} → {after:.1f}"})
    df = pd.DataFrame(rows).set_index("run").round(1)
    df.attrs["errors"] = errors
    return df


@as_table
def prediction_misses(variants: dict, errors: dict[str, float], *, load: dict, cores: int, goal: float) -> pd.DataFrame:
    """One row per configuration: the highest load average around its launch, how much its compute alone varied
    (p10–p90 width over the median, %), the prediction's error (%), and what the run measured that explains a
    miss beyond `goal` (ddpsteps.why_missed; blank where it met the goal). errors: {title: fraction}."""
    from ..models import ddpsteps

    rows = []
    for title, (res, _, _) in variants.items():
        lo, hi = ddpsteps.spread(res, "no-ddp")
        noise, busy = (hi - lo) / ddpsteps.step_ms(res, "no-ddp"), max(load[res.name])
        rows.append({"run": title, "load (max)": round(busy, 1), "compute noise (%)": round(100 * noise),
                     "error (%)": round(100 * errors[title]),
                     "why it missed": ddpsteps.why_missed(errors[title], load=busy, cores=cores, noise=noise,
                                                          goal=goal)})
    return pd.DataFrame(rows).set_index("run")


@as_table
def modelled_scaling(curves: dict[str, list[dict]], at=(8, 256, 4096)) -> pd.DataFrame:
    """One row per modelled curve (models.scaling.simulate rows): its efficiency at the world sizes `at` (%) and the
    world size from which it is communication-bound (models.scaling.turning_point; "—" if not within the curve)."""
    from ..models.scaling import turning_point

    rows = []
    for title, points in curves.items():
        by_n = {p["world_size"]: p for p in points}
        missing = [n for n in at if n not in by_n]
        if missing:
            raise ValueError(f"{title}: no modelled point at N = {missing}")
        rows.append({"modelled": title, **{f"efficiency, N={n} (%)": round(100 * by_n[n]["efficiency"]) for n in at},
                     "comm-bound from N": turning_point(points) or f"— (not up to {max(by_n)})"})
    return pd.DataFrame(rows).set_index("modelled")


@as_table
def compiled_ddp(cmp: dict, models=("eager", "compiled", "one-graph")) -> pd.DataFrame:
    """Chapter 03's compiled DDP, one row per model: graphs compiled (blank for eager), the first step (s,
    compilation included), the median step afterwards (ms) and the final loss. cmp: the script's "compare"
    record ({"graphs", "compile_s", "step_ms", "loss"}: dicts by model)."""
    rows = [{"model": m, "graphs": cmp["graphs"].get(m), "first step (s)": round(cmp["compile_s"][m], 1),
             "median step (ms)": round(cmp["step_ms"][m], 1), "loss": round(cmp["loss"][m], 6)} for m in models]
    df = pd.DataFrame(rows).set_index("model")
    df["graphs"] = df["graphs"].astype("Int64")
    return df
