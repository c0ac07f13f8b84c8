"""Chapter 07b, precision and recomputation: the tables and figures it shows from its runs.

`notebooks/07b_precision_and_recomputation.ipynb` imports it by its short name:

    from gpucourse.chapters import ch07b
    ch07b.recipe_bytes()                 # bytes per parameter of each recipe

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import math
import statistics

import pandas as pd
from matplotlib import ticker
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..models import costs
from ..viz.tables import as_table


STATE_PARTS = ("parameters", "gradients", "master weights", "optimizer states")


@as_table
def recipe_bytes(optimizer: str = "adamw") -> pd.DataFrame:
    """Bytes per parameter of each model state under each precision recipe (costs.recipe_bytes_per_param); the
    recipes a CPU run cannot hold (fp8) marked modelled."""
    rows = [{"recipe": r, **{f"{k} (bytes/param)": v for k, v in costs.recipe_bytes_per_param(r, optimizer).items()},
             "source": "measured below" if r in costs.MEASURED_RECIPES else "MODELLED"} for r in costs.RECIPES]
    return pd.DataFrame(rows).set_index("recipe")


@as_table
def recipe_states(recipes: dict, optimizer: str = "adamw") -> pd.DataFrame:
    """Each recipe's model states counted after a real step, per parameter, beside the formula. recipes:
    {name: the run's record: "num_params", "num_tensors", "dtype", "state_dtype", "parameters", "gradients",
    "master_weights", "optimizer_states", "step_counters", "weight_copies", "cuda_peak", "cuda_held"}.
    "= formula": every part equal to costs.recipe_bytes_per_param; step counters (4 bytes per tensor) apart."""
    rows = []
    for name, rec in recipes.items():
        numel, formula = rec["num_params"], costs.recipe_bytes_per_param(name, optimizer)
        measured = {part: rec[part.replace(" ", "_")] / numel for part in STATE_PARTS}
        row = {"recipe": name, "dtype": rec["dtype"], "states dtype": rec["state_dtype"],
               **{f"{part} (bytes/param)": v for part, v in measured.items()},
               "= formula": all(measured[p] == formula[p] for p in STATE_PARTS),
               "step counters (bytes)": rec["step_counters"],
               "= 4 B per tensor": rec["step_counters"] == 4 * rec["num_tensors"],
               "16-bit weight copies kept (bytes/param)": round(rec.get("weight_copies", 0) / numel, 2)}
        if rec.get("cuda_peak") is not None:
            row |= {"CUDA peak (bytes/param)": round(rec["cuda_peak"] / numel, 2),
                    "CUDA held after the step (bytes/param)": round(rec["cuda_held"] / numel, 2)}
        rows.append(row)
    return pd.DataFrame(rows).set_index("recipe")


@as_table
def loss_scale_steps(steps: list[dict]) -> pd.DataFrame:
    """GradScaler step by step: the scale used, whether a gradient overflowed, whether the step changed the
    parameters, the scale after update(), the loss. steps: the run's records {"scaler_step", "scale", "overflow",
    "params_changed", "new_scale", "loss"} (not "step": that key drives the launcher's progress bar)."""
    rows = [{"step": r["scaler_step"], "scale": f"2^{math.log2(r['scale']):g}", "overflow": r["overflow"],
             "step taken": r["params_changed"], "new scale": f"2^{math.log2(r['new_scale']):g}",
             "loss": round(r["loss"], 4)} for r in steps]
    return pd.DataFrame(rows).set_index("step")


def loss_scale_faults(steps: list[dict]) -> list[str]:
    """What GradScaler got wrong in these steps, as sentences (empty: it skipped exactly the overflowing steps,
    halving the scale each time, and kept or doubled it otherwise)."""
    faults = []
    for r in steps:
        if r["params_changed"] == r["overflow"]:
            faults.append(f"step {r['scaler_step']}: overflow {r['overflow']} but parameters changed "
                          f"{r['params_changed']}")
        ok = (r["new_scale"] == r["scale"] / 2 if r["overflow"] else r["new_scale"] in (r["scale"], 2 * r["scale"]))
        if not ok:
            faults.append(f"step {r['scaler_step']}: scale {r['scale']} -> {r['new_scale']} after overflow "
                          f"{r['overflow']}")
    return faults


@as_table
def underflow(records: list[dict]) -> pd.DataFrame:
    """Gradient elements non-zero in fp32 that fp16 autocast made zero, per residual, without and with a
    GradScaler. records: {"residual", "median_abs_grad", "nonzero_fp32", "zero_fp16", "zero_fp16_scaler"}."""
    rows = [{"residual": f"{r['residual']:.0e}", "median |grad| in fp32": f"{r['median_abs_grad']:.1e}",
             "lost in fp16, no scaler": r["zero_fp16"],
             "lost, no scaler (%)": round(100 * r["zero_fp16"] / r["nonzero_fp32"], 1),
             "lost in fp16 + GradScaler": r["zero_fp16_scaler"],
             "lost, GradScaler (%)": round(100 * r["zero_fp16_scaler"] / r["nonzero_fp32"], 1)} for r in records]
    return pd.DataFrame(rows).set_index("residual")


@as_table
def float_formats(dtypes) -> pd.DataFrame:
    """Range and precision of floating-point dtypes (torch.finfo): largest value, smallest normal, relative step."""
    import torch

    rows = [{"dtype": str(dt).replace("torch.", ""), "max": torch.finfo(dt).max,
             "smallest normal": torch.finfo(dt).smallest_normal, "relative step (eps)": torch.finfo(dt).eps}
            for dt in dtypes]
    return pd.DataFrame(rows).set_index("dtype")


@as_table
def cast_errors(reference, casts: dict, *, skip_first: bool = False) -> pd.DataFrame:
    """What casting lost, per cast: elements that became zero and the relative error (L2) against `reference`.
    casts: {name: the values after the cast (same shape)}; skip_first: leave element 0 out (an outlier placed
    there on purpose), counting the others only."""
    start = 1 if skip_first else 0
    ref = reference.flatten()[start:]
    rows = []
    for name, approx in casts.items():
        got = approx.flatten()[start:]
        rows.append({"cast": name, "became zero": int((got == 0).sum()), "of": ref.numel(),
                     "relative error": round(((got - ref).norm() / ref.norm()).item(), 3)})
    return pd.DataFrame(rows).set_index("cast")


@as_table
def activations_kept(kept: dict, fused: dict, expected: dict, modes=("none", "selective", "full")) -> pd.DataFrame:
    """Bytes one layer keeps for backward, per sequence length and recomputation mode, counted; "= formula" says
    whether every mode's count equals `expected` ({(seq, mode): bytes}). kept: {(seq, mode): bytes};
    fused: {seq: bytes with a fused attention kernel}."""
    seqs = sorted({s for s, _ in kept})
    rows = [{"s": s, **{f"{m} (bytes)": kept[s, m] for m in modes}, "fused attention (bytes)": fused.get(s),
             "= formula": all(kept[s, m] == expected[s, m] for m in modes)} for s in seqs]
    return pd.DataFrame(rows).set_index("s")


@as_table
def recomputation(kept: dict, flops: dict, expected_flops: dict, times: dict,
                  modes=("none", "selective", "full")) -> pd.DataFrame:
    """Each mode's trade at each sequence length, relative to no recomputation (modes[0]): bytes kept, FLOPs run
    (and whether they equal `expected_flops`), step time (the median of `times`, with their min and max). A mode in
    `times` but not in `kept` (a control) gets its time only. All dicts keyed (seq, mode); times in seconds."""
    base = modes[0]
    rows = []
    order = list(dict.fromkeys([*modes, *(m for _, m in times)]))  # the modes, then the controls
    for (s, m), t in sorted(times.items(), key=lambda item: (item[0][0], order.index(item[0][1]))):
        measured = (s, m) in kept
        median = statistics.median(t)
        rows.append({"s": s, "mode": m,
                     "kept (× none)": round(kept[s, m] / kept[s, base], 3) if measured else None,
                     "FLOPs run (× none)": round(flops[s, m] / flops[s, base], 2) if measured else None,
                     "FLOPs = formula": flops[s, m] == expected_flops[s, m] if measured else None,
                     "median step (ms)": round(1e3 * median, 1), "min (ms)": round(1e3 * min(t), 1),
                     "max (ms)": round(1e3 * max(t), 1),
                     "time (× none)": round(median / statistics.median(times[s, base]), 2)})
    return pd.DataFrame(rows).set_index(["s", "mode"])


@as_table
def low_precision_speedup(device: str, shares, fast: str = "fp8", base: str = "bf16") -> pd.DataFrame:
    """MODELLED: the most a step can gain when its matrix products run at `fast`'s datasheet peak instead of
    `base`'s (costs.low_precision_speedup, Amdahl: everything else unchanged), for each share of the step's time
    that the matrix products take."""
    rows = [{"matrix products (% of a step)": round(100 * f), f"at most × faster in {fast}":
             round(costs.low_precision_speedup(f, device, dtype=fast, baseline=base), 2)} for f in shares]
    return pd.DataFrame(rows).set_index("matrix products (% of a step)")


def loss_scale_plot(steps: list[dict], label: str = ""):
    """GradScaler's scale per step (log2), the overflowing steps (skipped, scale halved) marked.
    steps: [{"scaler_step", "scale", "overflow"}] as the run logged them."""
    fig = Figure(figsize=(8, 3), layout="constrained")
    ax = fig.subplots()
    log2 = [math.log2(r["scale"]) for r in steps]
    ax.step([r["scaler_step"] for r in steps], log2, where="post", label="log2(scale) used")
    ax.plot([r["scaler_step"] for r in steps if r["overflow"]], [v for r, v in zip(steps, log2) if r["overflow"]],
            "rx", ms=9, mew=2, label="overflow: step skipped, scale halved")
    ax.set(xlabel="step", ylabel="log2(loss scale)", title=f"GradScaler finding its scale: fp16 autocast ({label})")
    ax.set_yticks(range(math.floor(min(log2)), math.ceil(max(log2)) + 1))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # steps are whole: no 2.5
    ax.legend(fontsize=8)
    return fig


def recomputation_plot(seqs, modes, kept: dict, times: dict, flops: dict, *, fused: dict | None = None,
                       title: str = ""):
    """Activation recomputation's trade. Left: bytes kept per layer for backward against the sequence length, one
    line per mode (log-log); fused: the same without recomputation, with a fused attention kernel. Right, at the
    longest sequence: each mode's memory kept against its step time (median, min-max) and its FLOPs, all relative
    to modes[0] (no recomputation). kept, flops: {(seq, mode): number}; times: {(seq, mode): [seconds]}."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    for i, mode in enumerate(modes):
        left.plot(seqs, [kept[s, mode] / 2**20 for s in seqs], "o-", color=f"C{i}", label=mode)
    if fused:
        left.plot(seqs, [fused[s] / 2**20 for s in seqs], "s:", color=f"C{len(modes)}",
                  label=f"{modes[0]}, fused attention kernel")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(seqs, [str(s) for s in seqs], minor=False)  # a tick at each length run, no 2^k labels
    left.set_xticks([], minor=True)
    left.set(xlabel="sequence length s", ylabel="MiB kept per layer for backward",
             title="activations per layer, counted")
    left.legend(fontsize=8)
    seq, base = seqs[-1], modes[0]
    median = statistics.median(times[seq, base])
    for i, mode in enumerate(modes):
        t = [x / median for x in times[seq, mode]]
        mem, mid = kept[seq, mode] / kept[seq, base], statistics.median(t)
        right.errorbar(mem, mid, yerr=[[mid - min(t)], [max(t) - mid]], fmt="o", color=f"C{i}", capsize=3)
        right.plot(mem, flops[seq, mode] / flops[seq, base], "x", color=f"C{i}", ms=10, mew=2)
        right.annotate(mode, (mem, mid), textcoords="offset points", xytext=(8, 4), color=f"C{i}", fontsize=9)
    right.legend(handles=[Line2D([], [], ls="", marker="o", color="k", label="step time, measured (median, min-max)"),
                          Line2D([], [], ls="", marker="x", color="k", mew=2, label="FLOPs run, counted")], fontsize=8)
    right.set(xlabel="activation memory kept, relative to no recomputation", ylabel="relative to no recomputation",
              title=f"the trade at s = {seq}")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
