"""Chapter 02, data parallelism: the tables and figures it shows from its runs.

`notebooks/02_data_parallel.ipynb` imports it by its short name:

    from gpucourse.chapters import ch02
    ch02.equivalence(diffs)              # DDP against one process, step by step

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import pandas as pd
from matplotlib import ticker
from matplotlib.figure import Figure

from ..viz.tables import as_table


def _kib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 1024, 1)


@as_table
def equivalence(diffs: dict[str, list[float]]) -> pd.DataFrame:
    """One row per variant (mean, sum, batchnorm, ...), one column per step: the largest |parameter difference|
    between DDP and one process after that step. diffs: {variant: [after step 1, after step 2, ...]}."""
    if not diffs:
        raise ValueError("equivalence needs {variant: [max difference after each step]}")
    steps = max(len(v) for v in diffs.values())
    df = pd.DataFrame.from_dict({v: list(d) + [None] * (steps - len(d)) for v, d in diffs.items()}, orient="index",
                                columns=[f"step {s + 1}" for s in range(steps)])
    df.columns.name = "max |Δθ| after"
    return df.rename_axis("variant")


@as_table
def sampler_shards(shards: dict, items: int) -> pd.DataFrame:
    """One row per (mode, epoch) of the sampler demo: the indices each rank read, the indices read twice (the
    padding) and those no rank read (drop_last). shards: {(mode, epoch): {rank: [indices]}}; items: dataset size."""
    rows = []
    for (mode, epoch), by_rank in shards.items():
        every = [i for idx in by_rank.values() for i in idx]
        rows.append({"mode": mode, "epoch": epoch, **{f"rank {r}": idx for r, idx in by_rank.items()},
                     "read twice": sorted({i for i in every if every.count(i) > 1}),
                     "read by none": sorted(set(range(items)) - set(every))})
    return pd.DataFrame(rows).set_index(["mode", "epoch"])


@as_table
def accumulation(records: list[dict], comm: dict[str, list[tuple]]) -> pd.DataFrame:
    """One row per accumulation mode (big, every, no_sync): all-reduce calls and KiB of the last profiled step,
    the largest parameter difference from one big batch over the run, and every profiled step's (calls, bytes).
    records: rank 0's records ({"mode", "max_diff"}); comm: {mode: traces.all_reduces_per_step(...)}."""
    worst: dict[str, float] = {}
    for rec in records:
        if "mode" in rec:
            worst[rec["mode"]] = max(worst.get(rec["mode"], 0.0), rec["max_diff"])
    rows = [{"mode": mode, "all_reduces / step": steps[-1][0], "KiB / step": _kib(steps[-1][1]),
             "max |Δθ| vs big": worst[mode], "profiled steps (calls, bytes)": steps} for mode, steps in comm.items()]
    return pd.DataFrame(rows).set_index("mode")


@as_table
def precision(records: list[dict], comm: dict[str, tuple]) -> pd.DataFrame:
    """One row per precision mode (fp32, autocast, fp16_hook, ...): dtypes of the output, parameters and
    gradients, whether a GradScaler ran, all-reduce calls and KiB of the last profiled step, and the largest
    parameter difference from fp32 over the run; a mode that could not run here has only its "not run" reason.
    records: rank 0's records; comm: {mode: (calls, bytes)} of the last profiled step, for the modes that ran."""
    merged: dict[str, dict] = {}
    for rec in records:
        if "mode" in rec:
            seen = merged.get(rec["mode"], {})
            merged[rec["mode"]] = {**seen, **rec, "worst": max(seen.get("worst", 0.0), rec.get("max_diff", 0.0))}
    rows = []
    for mode, rec in merged.items():
        if "error" in rec:
            rows.append({"mode": mode, "not run": rec["error"]})
            continue
        calls, nbytes = comm[mode]
        rows.append({"mode": mode, "output": rec["output_dtype"], "params": rec["param_dtype"],
                     "grads": rec["grad_dtype"], "GradScaler": bool(rec["scaler"]), "all_reduces / step": calls,
                     "KiB / step": _kib(nbytes), "max |Δθ| vs fp32": rec["worst"], "not run": ""})
    df = pd.DataFrame(rows).set_index("mode")
    if "all_reduces / step" in df:  # whole numbers, blank where a mode did not run
        df["all_reduces / step"] = df["all_reduces / step"].astype("Int64")
    return df


@as_table
def ddp_compare(rows: list[dict]) -> pd.DataFrame:
    """One row per implementation (torch DDP, your DDP, your BucketedDDP): the last step's loss, the median step
    time over every step but the first (ms), the largest |parameter difference| from torch's DDP over the run
    (loss to 4 decimals, ms to 2).
    rows: rank 0's records of 02_ddp_compare.py ({"loss", "seconds", "max_diff"}: dicts by implementation)."""
    if len(rows) < 2:
        raise ValueError("ddp_compare needs the records of at least two steps (the first is not timed)")
    timed = rows[1:]
    out = [{"implementation": name, "final loss": rows[-1]["loss"][name],
            "median step (ms)": sorted(r["seconds"][name] for r in timed)[len(timed) // 2] * 1e3,
            "max |Δθ| vs torch DDP": max(r["max_diff"].get(name, 0.0) for r in rows)} for name in rows[0]["loss"]]
    return pd.DataFrame(out).set_index("implementation").round({"final loss": 4, "median step (ms)": 2})


FLOAT32_ROUNDING = 1e-5  # parameter differences below this are float32 rounding, not a different computation


def equivalence_plot(diffs: dict, *, label: str = ""):
    """The largest |parameter difference| between DDP and one process after each step, one line per variant.

    diffs: {variant: [difference after step 1, after step 2, ...]}, as 02_equivalence.py logs them. Log y
    axis; zeros are drawn at 1e-10 (a log axis has no 0); a dashed line marks float32 rounding.
    """
    if not diffs or not any(diffs.values()):
        raise ValueError("equivalence_plot needs {variant: [max difference after each step]}")
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.subplots()
    for variant, values in diffs.items():
        ax.semilogy(range(1, len(values) + 1), [max(v, 1e-10) for v in values], marker="o", label=variant)
    ax.axhline(FLOAT32_ROUNDING, color="0.5", ls="--", lw=0.8)
    ax.text(1, 1.5 * FLOAT32_ROUNDING, "float32 rounding", fontsize=8, color="0.4")
    ax.set(xlabel="step", ylabel="max |θ_DDP − θ_single|",
           title="DDP vs one process on the global batch" + (f" ({label})" if label else ""))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # steps are whole numbers
    ax.legend(fontsize=8)
    return fig
