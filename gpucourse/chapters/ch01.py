"""Chapter 01, collectives: the tables and figures it shows from its runs.

`notebooks/01_collectives.ipynb` imports it by its short name:

    from gpucourse.chapters import ch01
    ch01.bandwidth(rows)                 # time and busbw per op and size

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import colors, patches, ticker, transforms

from ..models import costs
from ..models.units import human_bytes, human_seconds
from ..viz.plots import GB, finished
from ..viz.tables import as_table


@as_table
def backend_support(metrics: dict, ops: list[str]) -> pd.DataFrame:
    """Which operation ran on which backend (chapter 01). metrics: {rank: records}; the records with "op" say
    ok/error per (backend, op), and one record's "available" says which backends this PyTorch was built with.
    A cell: "yes (ran)", "NO: <error>", "not tried" (built in, but needs a GPU per rank here), or "—"."""
    available = next(rec["available"] for recs in metrics.values() for rec in recs if "available" in rec)
    tried: dict[tuple[str, str], tuple[bool, str]] = {}
    for recs in metrics.values():
        for rec in recs:
            if "op" in rec:
                ok, err = tried.get((rec["backend"], rec["op"]), (True, ""))
                tried[rec["backend"], rec["op"]] = (ok and rec["ok"], err or (rec.get("error") or ""))

    def cell(backend, op):
        if (backend, op) in tried:
            ok, err = tried[backend, op]
            return "yes (ran)" if ok else f"NO: {err[:60]}"
        return "not tried" if available[backend] else "—"

    rows = {"built in": {b: "yes" if a else "no (this PyTorch)" for b, a in available.items()}}
    rows |= {op: {b: cell(b, op) for b in available} for op in ops}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("operation")


@as_table
def bytes_per_rank(ops: list[str], size: int, world_sizes: list[int]) -> pd.DataFrame:
    """MiB each rank sends for one collective of `size` bytes, by world size (costs.bytes_moved_per_rank)."""
    return pd.DataFrame({f"{op} (MiB)": [costs.bytes_moved_per_rank(op, size, n) / 2**20 for n in world_sizes]
                         for op in ops}, index=pd.Index(world_sizes, name="ranks")).round(1)


@as_table
def bandwidth(rows: list[dict]) -> pd.DataFrame:
    """One row per message size, per op its time (µs) and busbw (GB/s per rank). rows: the benchmark's records
    {"op", "bytes", "time_s", "busbw"}."""
    df = pd.DataFrame(rows)
    table = df.pivot_table(index="bytes", columns="op", values=["time_s", "busbw"], sort=False)
    out = pd.concat({"time (µs)": table["time_s"] * 1e6, "busbw (GB/s)": table["busbw"] / 1e9}, axis=1)
    out = out.swaplevel(axis=1)[list(dict.fromkeys(df["op"]))]  # grouped by op, in the order run
    out.index = pd.Index([human_bytes(b) for b in out.index], name="message")
    return out.round({c: (1 if c[1].startswith("time") else 4) for c in out.columns})


@as_table
def link_times(op: str, sizes: list[int], n: int, measured: dict, fit: costs.AlphaBeta) -> pd.DataFrame:
    """Modelled time of `op` on n ranks over each nominal interconnect (costs.INTERCONNECTS, ring model), and
    this machine's measured time beside them (measured: {size: seconds}; fit: its α–β fit)."""
    rows = [{"link": ic.name, "α (µs)": ic.alpha * 1e6, "GB/s": ic.bandwidth_bytes_per_s / 1e9,
             **{f"{human_bytes(s)} (µs)": costs.collective_time(op, s, n, ic.alpha, ic.beta) * 1e6 for s in sizes}}
            for ic in costs.INTERCONNECTS.values()]
    rows.append({"link": "this machine (measured)", "α (µs)": fit.alpha * 1e6, "GB/s": fit.bandwidth / 1e9,
                 **{f"{human_bytes(s)} (µs)": measured[s] * 1e6 for s in sizes}})
    return pd.DataFrame(rows).set_index("link").round(1)


OP_COLOURS = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green",
              "broadcast": "tab:red", "reduce": "tab:purple", "all_to_all": "tab:brown"}


def _padded(rows: list[list[float]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0) or 1
    return np.array([list(r) + [np.nan] * (width - len(r)) for r in rows], dtype=float)


def _draw_table(ax, values: np.ndarray, defined: list[bool], title: str, norm) -> None:
    """One row per rank, one cell per element, the value written in the cell; undefined rows greyed."""
    shown = np.ma.masked_invalid(values)
    ax.imshow(shown, cmap="YlGnBu", norm=norm, aspect="auto")
    for r, row in enumerate(values):
        for c, v in enumerate(row):
            if np.isnan(v):
                continue
            dark = defined[r] and norm(v) > 0.6
            ax.text(c, r, f"{v:g}", ha="center", va="center", fontsize=8,
                    color="white" if dark else ("black" if defined[r] else "0.55"))
        if not defined[r]:
            ax.axhspan(r - 0.5, r + 0.5, color="0.92", zorder=2)
            ax.annotate("unspecified", xy=(1.02, r), xycoords=("axes fraction", "data"), va="center",
                        fontsize=8, color="0.4", style="italic")
    ax.set_yticks(range(len(values)), [f"rank {r}" for r in range(len(values))])
    ax.set_xticks([])
    ax.set_title(title, fontsize=9)


def collective_grid(records, op: str, label: str = ""):
    """Every rank's tensor before and after `op`: one row per rank, values printed in the cells.

    records: dicts as the chapter 01 demo logs them, {"rank", "op", "before", "after"} and optionally
    "defined" (False where the op leaves a rank's result unspecified, e.g. reduce off the root).
    """
    recs = sorted((r for r in records if r.get("op") == op), key=lambda r: r["rank"])
    if not recs:
        raise ValueError(f"no records for op {op!r}; ops present: {sorted({r.get('op') for r in records})}")
    before, after = _padded([r["before"] for r in recs]), _padded([r["after"] for r in recs])
    defined = [r.get("defined", True) for r in recs]
    finite = np.concatenate([before[~np.isnan(before)], after[~np.isnan(after)]])
    lo, hi = (finite.min(), finite.max()) if finite.size else (0, 1)
    norm = colors.Normalize(lo, hi if hi > lo else lo + 1)
    width = 1.2 + 0.42 * (before.shape[1] + after.shape[1])
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(width, 6), 0.45 * len(recs) + 1.1),
                               gridspec_kw={"width_ratios": [before.shape[1], after.shape[1]]})
    unit = f" ({recs[0]['unit']})" if recs[0].get("unit") else ""
    _draw_table(a, before, [True] * len(recs), "before" + unit, norm)
    _draw_table(b, after, defined, "after" + unit, norm)
    b.set_yticks([])
    fig.suptitle(f"{op} — {label}" if label else op, fontsize=10)
    return finished(fig)


def ring_schedule(n: int) -> list[dict]:
    """Simulate a ring all-reduce on n ranks: for each step, how many ranks' data each chunk holds.

    Returns [{"phase", "step", "counts": n x n list (rank, chunk), "sent": {rank: chunk}}], starting
    with the initial state. Reduce-scatter step s: rank r sends chunk (r - s) mod n to rank r + 1,
    which adds it to its own copy. All-gather step s: rank r sends its finished chunk
    (r + 1 - s) mod n on, and the receiver overwrites its copy.
    """
    if n < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got n={n}")
    have = [[{r} for _ in range(n)] for r in range(n)]  # have[rank][chunk]: ranks summed into it
    steps = [{"phase": "start", "step": 0, "counts": [[1] * n for _ in range(n)], "sent": {}}]
    for phase, first in (("reduce-scatter", 0), ("all-gather", 1)):
        for s in range(n - 1):
            sent = {r: (r + first - s) % n for r in range(n)}
            incoming = {(r + 1) % n: (c, set(have[r][c])) for r, c in sent.items()}
            for dst, (c, ranks) in incoming.items():
                have[dst][c] = have[dst][c] | ranks if phase == "reduce-scatter" else ranks
            steps.append({"phase": phase, "step": s + 1, "sent": sent,
                          "counts": [[len(have[r][c]) for c in range(n)] for r in range(n)]})
    return steps


def ring_steps(n: int = 4):
    """The ring schedule drawn: per step, each rank's chunks (how many ranks summed in); sent chunks boxed."""
    steps = ring_schedule(n)
    fig, axes = plt.subplots(1, len(steps), figsize=(1.45 * len(steps) + 0.6, 0.42 * n + 1.4), sharey=True)
    norm = colors.Normalize(1, n)
    for ax, st in zip(axes, steps):
        counts = np.array(st["counts"], dtype=float)
        ax.imshow(counts, cmap="Blues", norm=norm)
        for r in range(n):
            for c in range(n):
                full = counts[r, c] == n
                ax.text(c, r, f"{int(counts[r, c])}", ha="center", va="center", fontsize=8,
                        color="white" if full else "black", fontweight="bold" if full else "normal")
        for r, c in st["sent"].items():
            ax.add_patch(patches.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec="tab:red", lw=2))
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_title("start" if st["phase"] == "start" else f"{st['phase']}\nstep {st['step']}", fontsize=8)
    axes[0].set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
    fig.suptitle(f"ring all-reduce on {n} ranks — the algorithm, not a measurement\n"
                 f"cell: how many ranks' data the chunk holds; red box: the chunk each rank sent right in that step",
                 fontsize=9)
    return finished(fig)


def crossover_bytes(fit: costs.AlphaBeta) -> float:
    """Size where the model's latency term equals its bandwidth term: below it, latency dominates."""
    latency_terms = costs.collective_time(fit.collective, 0, fit.n, 1.0, 0.0, fit.algorithm)
    bytes_per_byte = costs.collective_time(fit.collective, 1, fit.n, 0.0, 1.0, fit.algorithm)
    return math.inf if fit.beta == 0 else latency_terms * fit.alpha / (bytes_per_byte * fit.beta)


def _mark_regimes(ax, cross: float, lo: float, hi: float) -> None:
    """Shade the latency-bound sizes (below the crossover) and name both regimes where they are."""
    text = {"transform": transforms.blended_transform_factory(ax.transData, ax.transAxes),
            "fontsize": 8, "va": "top", "ha": "center", "color": "0.3"}
    if cross <= lo:
        ax.text(math.sqrt(lo * hi), 0.98, "bandwidth-bound (all sizes)", **text)
    elif cross >= hi:
        ax.axvspan(lo, hi, color="0.92", zorder=0)
        ax.text(math.sqrt(lo * hi), 0.98, f"latency-bound (all sizes: S* = {human_bytes(cross)})", **text)
    else:
        ax.axvspan(lo, cross, color="0.92", zorder=0)
        ax.axvline(cross, color="0.5", lw=0.8, ls=":")
        ax.text(math.sqrt(lo * cross), 0.98, "latency-bound", **text)
        ax.text(math.sqrt(cross * hi), 0.98, "bandwidth-bound", **text)
        ax.text(cross, 0.02, f" S* = {human_bytes(cross)}", **{**text, "va": "bottom", "ha": "left"})


def bandwidth_plot(rows, fit: costs.AlphaBeta | None = None, holdout: dict | None = None, label: str = ""):
    """Time and bus bandwidth against message size, one line per collective, log axes.

    rows: [{"op", "bytes", "time_s", "busbw"}]. fit: an α–β model (fitted on one of the ops) drawn
    over the time plot, with its latency- and bandwidth-bound regimes shaded. holdout: {"bytes",
    "time_s", "predicted_s"} of a size left out of the fit, marked with its prediction error.
    """
    if not rows:
        raise ValueError("bandwidth_plot needs at least one row {'op', 'bytes', 'time_s', 'busbw'}")
    fig, (t_ax, bw_ax) = plt.subplots(1, 2, figsize=(12, 4.4))
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = sorted((r["bytes"], r["time_s"], r["busbw"]) for r in rows if r["op"] == op)
        x, t, bw = map(np.array, zip(*pts))
        t_ax.plot(x, t * 1e6, "o-", ms=3, color=OP_COLOURS.get(op), label=op)
        bw_ax.plot(x, bw / GB, "o-", ms=3, color=OP_COLOURS.get(op), label=op)
    sizes = np.array([r["bytes"] for r in rows], dtype=float)
    if fit is not None:
        grid = np.geomspace(sizes.min(), sizes.max(), 100)
        t_ax.plot(grid, [fit.predict(s) * 1e6 for s in grid], "k--", lw=1.2,
                  label=f"α–β model of {fit.collective}: {fit}")
        for ax in (t_ax, bw_ax):
            _mark_regimes(ax, crossover_bytes(fit), sizes.min(), sizes.max())
    if holdout is not None:
        err = (holdout["predicted_s"] - holdout["time_s"]) / holdout["time_s"]
        t_ax.plot([holdout["bytes"]], [holdout["time_s"] * 1e6], "s", ms=11, mfc="none", mec="k", mew=1.5,
                  label=f"held out of the fit: predicted {human_seconds(holdout['predicted_s'])}, "
                        f"measured {human_seconds(holdout['time_s'])} ({err:+.0%})")
    for ax, ylabel in ((t_ax, "time per call (µs)"), (bw_ax, "bus bandwidth (GB/s per rank)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("message size (bytes, nccl-tests convention)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
    t_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    t_ax.set_title(f"time vs size — {label}", fontsize=10)
    bw_ax.set_title(f"busbw vs size — {label}", fontsize=10)
    return finished(fig)


def interconnect_plot(times: dict, n: int, label: str = ""):
    """The same all-reduce on n ranks over several links: {size_bytes: [(name, seconds, measured?)]}.

    One panel per size. Measured bars are solid and named with `label` (where they were measured); the
    others are hatched, and the title says they are modelled from nominal link rates.
    """
    if not times:
        raise ValueError("interconnect_plot needs {size_bytes: [(name, seconds, measured)]}")
    fig, axes = plt.subplots(1, len(times), figsize=(6.2 * len(times), 0.38 * max(map(len, times.values())) + 1.6))
    for ax, (size, bars) in zip(np.atleast_1d(axes), times.items()):
        names = [f"{name} (measured: {label})" if measured else name for name, _, measured in bars]
        secs = [s * 1e6 for _, s, _ in bars]
        colours = ["tab:orange" if m else "tab:blue" for _, _, m in bars]
        hatches = ["" if m else "//" for _, _, m in bars]
        ys = range(len(bars))
        for y, s, c, h in zip(ys, secs, colours, hatches):
            ax.barh(y, s, color=c, hatch=h, alpha=0.8, edgecolor="white")
            ax.text(s, y, f" {human_seconds(s / 1e6)}", va="center", fontsize=7)
        ax.set_yticks(list(ys), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("all_reduce time (µs)")
        ax.set_title(f"all_reduce of {human_bytes(size)} on {n} ranks\nhatched = modelled (ring α–β model, "
                     f"nominal link rates); solid = measured", fontsize=9)
        ax.set_xlim(right=max(secs) * 20)
    return finished(fig)
