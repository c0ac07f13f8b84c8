"""The course's figures: small functions, each returning one matplotlib Figure.

Every figure says where its numbers came from. Pass `label=run_label(result)` ("cpu · gloo · 4 ranks")
and it goes into the title (`runs_label` for several runs in one figure); numbers from a model, not a run,
are titled as modelled. A figure is built without pyplot's state (`Figure(...)`), or closed before it is
returned, so a notebook shows each one once: where you display it (the cell's last expression, or
`display(fig)`; the chapter's first cell runs `%matplotlib inline` so that a bare Figure is drawn).
"""
from __future__ import annotations

import math
import statistics
import sys
import textwrap

import matplotlib

if "ipykernel" not in sys.modules:  # scripts and tests: no display, and no GUI toolkit needed
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib import colors, patches, ticker, transforms  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from ..models import costs  # noqa: E402
from ..models.memory import PARTS, STAGE_NAMES, gb  # noqa: E402
from ..models.units import human_bytes, human_seconds  # noqa: E402, F401 - the chapters call plots.human_bytes

GB = 1e9
OP_COLOURS = {"all_reduce": "tab:blue", "all_gather": "tab:orange", "reduce_scatter": "tab:green",
              "broadcast": "tab:red", "reduce": "tab:purple", "all_to_all": "tab:brown"}


def run_label(result) -> str:
    """'cpu · gloo · 4 ranks': the device the ranks reported (RunResult.device), backend and world size of a run."""
    return f"{result.device} · {result.manifest.get('backend', '?')} · {result.world_size} ranks"


def _finish(fig):
    fig.tight_layout()
    plt.close(fig)  # the caller displays it; pyplot must not show it a second time
    return fig


# --- what a collective did, rank by rank ----------------------------------------------------------

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
    return _finish(fig)


# --- the ring all-reduce, step by step (an algorithm, not a measurement) -------------------------

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
    return _finish(fig)


# --- bandwidth versus message size ----------------------------------------------------------------

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
    return _finish(fig)


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
    return _finish(fig)


def stacked_bars(ax, labels, parts: dict, *, totals=None, totals_label: str = "formula", modelled=(),
                 colours=None) -> None:
    """One bar per label, stacked from parts ({part: [value per label]}, in order, bottom up). totals: a black
    tick per bar (what a formula says the bar adds up to); labels in `modelled` are hatched and faded (modelled,
    not measured); colours: one per part (default C0, C1, ...)."""
    bottom = [0.0] * len(labels)
    for i, (part, values) in enumerate(parts.items()):
        bars = ax.bar(labels, values, bottom=bottom, color=(colours or {}).get(part, f"C{i}"), label=part)
        for bar, label in zip(bars, labels):
            if label in modelled:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
        bottom = [b + v for b, v in zip(bottom, values)]
    if totals is not None:
        ax.plot(labels, totals, "k_", ms=30, mew=2)  # a bar-wide tick...
        ax.plot([], [], "k_", ms=12, mew=2, label=totals_label)  # ...and a legend sample that fits beside its label


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


def bubble_plot(rows: list[dict], labels: dict):
    """A pipeline's measured bubble against the number of micro-batches m, one panel per depth p: each schedule's
    measured points beside (p-1)/(m+p-1). rows: [{"p", "kind", "m", "measured"}]; labels: {p: the run's label}."""
    depths = sorted({r["p"] for r in rows})
    fig = Figure(figsize=(5.2 * len(depths), 3.6), layout="constrained")
    for ax, p in zip(fig.subplots(1, len(depths), squeeze=False)[0], depths):
        ms = sorted({r["m"] for r in rows if r["p"] == p})
        ax.plot(ms, [costs.pipeline_bubble_fraction(p, m) for m in ms], "k--", label="(p-1)/(m+p-1)")
        for kind, marker in zip(dict.fromkeys(r["kind"] for r in rows), "osD^"):
            mine = sorted((r["m"], r["measured"]) for r in rows if r["p"] == p and r["kind"] == kind)
            ax.plot([m for m, _ in mine], [b for _, b in mine], marker, ms=7, label=f"{kind} measured", alpha=0.8)
        ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble (idle fraction)", ylim=(0, 1),
               title=f"p = {p} stages — {labels[p]}")
        ax.set_xticks(ms, [str(m) for m in ms])  # a tick at each m run, and no others
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.legend(fontsize=8)
    return fig


TITLE_CHARS = 90  # a title line longer than this is wrapped: at 9 pt it would not fit the 8.5-inch figure


def stages_plot(rows, *, title="", device_bytes=None):
    """Stacked bars of device memory per stage (parameters, gradients, optimizer states), offload in hatching.

    The title is wrapped (a long one ran past both edges of the figure) and set as the figure's suptitle, and
    the legend sits below the axes: inside them it covered whichever bar or label ended in its corner.
    Constrained layout makes room for both.
    """
    fig = Figure(figsize=(8.5, 4.4), layout="constrained")
    ax = fig.subplots()
    labels = [STAGE_NAMES[r["stage"]] for r in rows]
    bottom = [0.0] * len(rows)
    for i, part in enumerate(PARTS):
        values = [r[part] / 1e9 for r in rows]
        ax.barh(labels, values, left=bottom, color=f"C{i}", label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    if any(r["cpu"] for r in rows):
        ax.barh(labels, [r["cpu"] / 1e9 for r in rows], left=bottom, color="none", edgecolor="0.4", hatch="//",
                label="in CPU memory (offload)")
    for y, r in enumerate(rows):
        ax.text(r["total"] / 1e9, y, f"  {gb(r['total'])}", va="center", fontsize=8)
    if device_bytes:
        ax.axvline(device_bytes / 1e9, color="k", ls=":", lw=1, label=f"device memory {gb(device_bytes)}")
    ax.invert_yaxis()
    ax.set(xlabel="GB per device (model states only; activations come on top)")
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=len(names), fontsize=8)
    if title:
        fig.suptitle("\n".join(textwrap.fill(line, TITLE_CHARS) for line in title.splitlines()), fontsize=9)
    return fig


# --- chapter 10: context parallelism --------------------------------------------------------------------------

def saved_memory_plot(seqs, memory: dict, label: str = ""):
    """Bytes autograd saved for backward against the sequence length, one line per way of writing attention, log
    axes ticked at the measured lengths. memory: {name: [bytes per length in seqs]}."""
    if not seqs or not memory or any(len(v) != len(seqs) for v in memory.values()):
        raise ValueError("saved_memory_plot needs sequence lengths and, per name, one byte count for each of them")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, values in memory.items():
        ax.loglog(seqs, values, "o-", label=name)
    ax.xaxis.set_major_locator(ticker.FixedLocator(list(seqs)))
    ax.xaxis.set_major_formatter(ticker.FixedFormatter([str(s) for s in seqs]))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_yscale("log", base=2)  # bytes: ticks at powers of two (64 KiB, 1 MiB), never 3×10⁴
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: human_bytes(v)))
    ax.yaxis.set_minor_locator(ticker.NullLocator())
    ax.set(xlabel="sequence length S (tokens)", ylabel="saved for backward")
    ax.set_title(f"one causal attention, bytes saved for backward — {label} (measured)", fontsize=9)
    ax.legend(fontsize=8)
    return _finish(fig)


def causal_balance_plot(balance: dict, label: str = ""):
    """Per rank, two panels: the (query, key) pairs its causal attention computes (exact) and the seconds it took
    (measured), one bar per layout. balance: {layout: [{"pairs", "seconds"} for each rank]}."""
    if not balance or any(not recs for recs in balance.values()):
        raise ValueError("causal_balance_plot needs {layout: [{'pairs', 'seconds'} per rank]}")
    n = len(next(iter(balance.values())))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    panels = {"pairs": ("(query, key) pairs per rank (counted: exact)", "pairs", 1),
              "seconds": ("time per rank (measured: fastest of 5)", "µs", 1e6)}
    width = 0.8 / len(balance)
    for ax, (key, (title, unit, scale)) in zip(axes, panels.items()):
        for j, (layout, recs) in enumerate(balance.items()):
            ax.bar([r + width * j for r in range(n)], [rec[key] * scale for rec in recs], width, label=layout,
                   color=f"C{j}")
        ax.set_xticks([r + width * (len(balance) - 1) / 2 for r in range(n)], [f"rank {r}" for r in range(n)])
        ax.set(ylabel=unit, title=title)
        ax.legend(fontsize=8)
    fig.suptitle(f"causal attention's work per rank, by layout — {label}", fontsize=10)
    return _finish(fig)


def replica_drift_plot(records: list, label: str = ""):
    """Training under context parallelism, step by step: the largest parameter difference between ranks, with the
    weight gradients summed over the CP group and without. records: the script's cp_training records."""
    if not records:
        raise ValueError("replica_drift_plot needs the cp_training records (one with sync=True, one without)")
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for rec in records:
        steps = list(range(1, len(rec["rank_spread"]) + 1))
        name = "gradients all-reduced over the CP group" if rec["sync"] else "each rank steps on its own gradients"
        ax.plot(steps, rec["rank_spread"], "o-", label=name)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set(xlabel="SGD step", ylabel="max |parameter difference| between ranks")
    ax.set_title(f"replicas under context parallelism — {label}", fontsize=9)
    ax.legend(fontsize=8)
    return _finish(fig)


def runs_label(results) -> str:
    """'cpu · gloo · 1, 2, 4 ranks': device(s), backend(s) and world sizes of several runs drawn in one figure."""
    results = list(results)
    if not results:
        raise ValueError("runs_label needs at least one run")
    devices = " / ".join(dict.fromkeys(r.device for r in results))
    backends = " / ".join(dict.fromkeys(str(r.manifest.get("backend", "?")) for r in results))
    sizes = ", ".join(str(n) for n in sorted({r.world_size for r in results}))
    return f"{devices} · {backends} · {sizes} rank{'' if sizes == '1' else 's'}"


def _log_y(ax) -> None:
    """A log y axis labelled with plain numbers (0.5, 1, 2, 3, 5, ...)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 3, 5) else ""))


# --- the same training done two ways, step by step (chapters 02 and 09) ----------------------------

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


def loss_curves_plot(curves: dict, *, reference: str | None = None, title: str = "",
                     ylabel: str = "training loss", difference: bool = False):
    """Loss per step of several trainings that should agree, one line per name; the reference line solid.

    curves: {name: [loss at step 0, 1, ...]}. reference: the name the others are compared with (drawn
    thicker, the others dashed). difference: a second panel with |loss − reference's| per step (symlog y, 0
    to 1e-3: float rounding near the bottom, a real bug off the top). fig.axes: (losses[, differences]).
    """
    if not curves:
        raise ValueError("loss_curves_plot needs {name: [loss per step]}")
    if reference is not None and reference not in curves:
        raise ValueError(f"reference {reference!r} is not one of the curves {list(curves)}")
    if difference and reference is None:
        raise ValueError("difference=True needs a reference curve to subtract")
    fig = Figure(figsize=(11, 3.4) if difference else (7, 3), layout="constrained")
    axes = fig.subplots(1, 2 if difference else 1, squeeze=False)[0]
    for name, losses in curves.items():
        ref = name == reference
        axes[0].plot(losses, label=name, lw=2 if ref else 1, ls="-" if ref else "--")
        if difference:
            axes[1].plot([abs(a - b) for a, b in zip(losses, curves[reference])], label=name)
    axes[0].set(xlabel="step", ylabel=ylabel, title=title)
    axes[0].legend(fontsize=8)
    if difference:
        axes[1].set_yscale("symlog", linthresh=1e-8)
        axes[1].set(xlabel="step", ylabel=f"|loss − {reference}|", ylim=(0, 1e-3),
                    title=f"difference from {reference}")
    return fig


# --- learning-rate rules for large batches (chapter 04) ---------------------------------------------

LR_RULE_COLOURS = {"keep": "tab:blue", "linear": "tab:red", "warmup": "tab:green"}


def lr_schedule_plot(schedules: dict, *, title: str = ""):
    """A learning-rate schedule per world size, against optimizer steps (left) and epochs (right).

    schedules: {name: {"constant": [lr at step 0..T], "cosine": [the same with cosine decay],
    "steps_per_epoch": int}}; the cosine variant is dashed, in its run's colour.
    """
    if not schedules:
        raise ValueError("lr_schedule_plot needs {name: {'constant', 'cosine', 'steps_per_epoch'}}")
    fig = Figure(figsize=(11, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    for name, s in schedules.items():
        steps = list(range(len(s["constant"])))
        for ax, xs in zip(axes, (steps, [x / s["steps_per_epoch"] for x in steps])):
            line, = ax.plot(xs, s["constant"], label=name)
            ax.plot(xs, s["cosine"], "--", color=line.get_color(), lw=1)
    axes[0].set(xlabel="optimizer step", ylabel="learning rate", title=title)
    axes[1].set(xlabel="epoch", ylabel="learning rate", title="the same, against epochs")
    axes[0].legend(fontsize=8)
    return fig


def _rule_lines(baseline: dict, by_rule: dict, names: dict):
    """(curve, style) for the 1-rank baseline (black, dashed) then each rule's run in its colour."""
    yield baseline, {"color": "black", "ls": "--", "lw": 1.5, "label": "1 rank (baseline)"}
    for i, (rule, curve) in enumerate(by_rule.items()):
        yield curve, {"color": LR_RULE_COLOURS.get(rule, f"C{i}"), "lw": 1.5, "label": names.get(rule, rule)}


def lr_rules_plot(runs: dict, baseline: dict, *, names: dict, labels: dict):
    """Training loss (log) and test accuracy against epochs: one column per world size, a line per rule.

    runs: {world size: {rule: {"header": {...}, "points": [records]}}} as 04_large_batch.py logs them (rank
    0), without the 1-rank run; baseline: the 1-rank run's {"header", "points"}, dashed black in every column.
    names: {rule: legend name}; labels: {world size: plots.run_label of that run}.
    """
    if not runs:
        raise ValueError("lr_rules_plot needs the runs of at least one world size above 1")
    fig = Figure(figsize=(5.5 * len(runs), 7), layout="constrained")
    axes = fig.subplots(2, len(runs), sharex=True, squeeze=False)
    for col, (n, by_rule) in enumerate(runs.items()):
        loss_ax, acc_ax = axes[0][col], axes[1][col]
        for curve, style in _rule_lines(baseline, by_rule, names):
            pts = [p for p in curve["points"] if p["train_loss"] is not None]
            loss_ax.plot([p["epoch"] for p in pts], [p["train_loss"] for p in pts], **style)
            acc_ax.plot([p["epoch"] for p in curve["points"]], [p["test_acc"] for p in curve["points"]], **style)
        h = next(iter(by_rule.values()))["header"]
        _log_y(loss_ax)
        loss_ax.set(ylabel="training loss", title=f"{labels.get(n, '')}\nglobal batch {h['global_batch']} = "
                    f"{n} × {h['base_batch']}, k = {h['global_batch'] // h['base_batch']}")
        acc_ax.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
        acc_ax.axhline(0.1, color="0.7", lw=0.8)
        acc_ax.text(0.02, 0.11, "chance", color="0.5", fontsize=8, transform=acc_ax.get_yaxis_transform())
        loss_ax.legend(fontsize=8)
    return fig


def running_mean(values, width: int) -> list[float]:
    """The mean of the last `width` values at each position (fewer at the start)."""
    if width < 1:
        raise ValueError(f"width must be at least 1, not {width}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def first_epoch_plot(by_rule: dict, baseline: dict, *, names: dict, label: str = ""):
    """The first epoch step by step: each step's loss (faint, with a running mean over ~1/32 epoch) and the
    learning rate each rule used. by_rule, baseline, names: as lr_rules_plot's, for one world size."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    loss_ax, lr_ax = fig.subplots(1, 2)
    for curve, style in _rule_lines(baseline, by_rule, names):
        spe = curve["header"]["steps_per_epoch"]
        losses = [x for p in curve["points"] for x in p["step_losses"]][:spe]
        lrs = [x for p in curve["points"] for x in p["lrs"]][:spe]
        epochs = [(i + 1) / spe for i in range(len(losses))]
        loss_ax.plot(epochs, losses, color=style["color"], alpha=0.25, lw=0.8)
        loss_ax.plot(epochs, running_mean(losses, max(2, spe // 32)), color=style["color"], lw=1.5,
                     label=style["label"])
        lr_ax.plot(epochs, lrs, color=style["color"], lw=1.5, ls=style.get("ls", "-"), label=style["label"])
    _log_y(loss_ax)
    loss_ax.set(xlabel="epoch", ylabel="loss of each step", title=f"first epoch, {label}" if label else "first epoch")
    lr_ax.set(xlabel="epoch", ylabel="learning rate", title="learning rate of each step")
    loss_ax.legend(fontsize=8)
    return fig


# --- tensor parallelism (chapter 06) ----------------------------------------------------------------

RANK_COLOURS = plt.get_cmap("tab10").colors


def _blocks(ax, x, y, w, h, n, split, label, owner=None):
    """A matrix at (x, y), w wide and h tall, cut into n blocks along `split` ("cols", "rows" or None).

    Blocks are coloured by the rank that holds them; grey when every rank holds the whole matrix. owner:
    colour the whole matrix as that rank's (a partial result)."""
    for i in range(n if split else 1):
        if split == "cols":
            rect = (x + i * w / n, y, w / n, h)
        elif split == "rows":
            rect = (x, y + (n - 1 - i) * h / n, w, h / n)
        else:
            rect = (x, y, w, h)
        colour = RANK_COLOURS[owner if owner is not None else i] if (split or owner is not None) else "0.85"
        ax.add_patch(patches.Rectangle(rect[:2], *rect[2:], facecolor=colour, alpha=0.6 if owner is None else 1.0,
                                       edgecolor="k", lw=1))
        if split:
            ax.text(rect[0] + rect[2] / 2, rect[1] + rect[3] / 2, f"{label[0]}{i + 1}", ha="center", va="center",
                    fontsize=9)
    ax.text(x + w / 2, y - 0.35, label, ha="center", va="top", fontsize=10)


def tp_split_diagram(n: int):
    """Column- and row-parallel linear layers on n ranks, drawn as block matrices (a diagram, not a run).

    Top: X (whole) · A split by columns = Y split by columns. Bottom: X split by columns · A split by rows =
    n partial products of Y's full shape, summed by an all-reduce. Blocks are coloured by their rank.
    """
    if not 1 <= n <= len(RANK_COLOURS):
        raise ValueError(f"n must be between 1 and {len(RANK_COLOURS)} ranks (one colour each), not {n}")
    fig = Figure(figsize=(11, 6.5), layout="tight")
    top, bottom = fig.subplots(2, 1)
    m, k, o = 2.0, 3.0, 4.0  # token rows, input features, output features (drawing units)
    _blocks(top, 0, 0, k, m, n, None, "X  (whole, on every rank)")
    top.text(k + 0.5, m / 2, "·", fontsize=20, ha="center", va="center")
    _blocks(top, k + 1, -0.5, o, k, n, "cols", "A = Wᵀ, split by columns")
    top.text(k + o + 1.5, m / 2, "=", fontsize=16, ha="center", va="center")
    _blocks(top, k + o + 2, 0, o, m, n, "cols", "Y: rank r holds Y_r")
    top.annotate("all-gather (only if the\nfull Y is needed)", (k + 2 * o + 2.1, m / 2), fontsize=9, va="center")
    top.set_title(f"column-parallel linear on {n} ranks: split the output features, no communication to compute")
    _blocks(bottom, 0, 0, k, m, n, "cols", "X: rank r holds X_r")
    bottom.text(k + 0.5, m / 2, "·", fontsize=20, ha="center", va="center")
    _blocks(bottom, k + 1, -0.5, o, k, n, "rows", "A = Wᵀ, split by rows")
    bottom.text(k + o + 1.5, m / 2, "=", fontsize=16, ha="center", va="center")
    for r in range(n):  # n partial products, each of Y's full shape
        _blocks(bottom, k + o + 2 + 0.25 * r, 0.2 * (n - 1 - r), o, m, 1, None, "", owner=r)
    bottom.text(k + o + 2 + o / 2, -0.35, "partial X_r A_r, full shape, one per rank", ha="center", va="top")
    bottom.annotate("all-reduce (sum)\n→ Y on every rank,\nthen + b once", (k + 2 * o + 2.2 + 0.25 * n, m / 2),
                    fontsize=9, va="center")
    bottom.set_title(f"row-parallel linear on {n} ranks: split the input features, sum the partial outputs")
    for ax in (top, bottom):
        ax.set_xlim(-0.3, 2 * o + k + 5.5)
        ax.set_ylim(-1.3, k)
        ax.set_aspect("equal")
        ax.axis("off")
    return fig


def tp_cost_plot(model: dict, *, title: str = ""):
    """Modelled compute and communication time of one layer per tensor-parallel degree: grouped bars, log y.

    model: {(degree, link): (compute seconds, communication seconds)}, degrees and links in the order to draw;
    one grey compute bar per degree, then one bar per link. The title should say what was assumed.
    """
    if not model:
        raise ValueError("tp_cost_plot needs {(degree, link): (compute_s, comm_s)}")
    degrees, links = list(dict.fromkeys(d for d, _ in model)), list(dict.fromkeys(lk for _, lk in model))
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / (len(links) + 1)
    for i, tp in enumerate(degrees):
        ax.bar(i, model[tp, links[0]][0] * 1e3, width, color="0.4",
               label="compute (assumed throughput)" if i == 0 else None)
        for j, link in enumerate(links, 1):
            ax.bar(i + j * width, model[tp, link][1] * 1e3, width, color=RANK_COLOURS[j % len(RANK_COLOURS)],
                   label=f"communication, {link}" if i == 0 else None)
    ax.set_xticks([i + width * len(links) / 2 for i in range(len(degrees))], [f"TP = {tp}" for tp in degrees])
    _log_y(ax)  # plain numbers (0.5, 1, 2, 5 ms), never 3×10⁰
    ax.set(ylabel="ms per layer (forward + backward)", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


# --- chapter 11: mixture of experts -----------------------------------------------------------------------

def moe_tokens_per_expert(panels: dict, capacity_total: int, uniform: float, label: str = "", title: str = ""):
    """One bar chart per router of the assignments each expert received: {router: (counts per expert, aux loss)}.

    Bars above `capacity_total` (every rank's capacity together, N x C) are red, the others blue; the dashed line
    is that capacity, the dotted one the uniform share. Drops happen per rank, so a blue bar can still have lost
    some. The legend names every colour and line.
    """
    if not panels:
        raise ValueError("moe_tokens_per_expert needs {router: (counts per expert, aux loss)}")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), sharey=True, squeeze=False)
    for ax, (router, (counts, aux)) in zip(axes[0], panels.items()):
        over = [c > capacity_total for c in counts]
        ax.bar(range(len(counts)), counts, color=["tab:red" if o else "tab:blue" for o in over])
        ax.axhline(capacity_total, color="k", ls="--")
        ax.axhline(uniform, color="0.5", ls=":")
        ax.set(title=f"{router} router: aux loss {aux:.2f}", xlabel="expert", xticks=range(len(counts)))
    axes[0][0].set_ylabel("assignments (all ranks)")
    handles = [patches.Patch(color="tab:blue", label="at most every rank's capacity"),
               patches.Patch(color="tab:red", label="more than every rank's capacity: drops for sure"),
               Line2D([], [], color="k", ls="--", label=f"capacity x ranks = {capacity_total}"),
               Line2D([], [], color="0.5", ls=":", label=f"uniform share = {uniform:g}")]
    fig.legend(handles=handles, loc="lower center", ncols=2, fontsize=8, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"{title} ({label})" if title else label, fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    plt.close(fig)
    return fig


def moe_load_balance(series: dict, label: str = ""):
    """Max / mean expert load per training step, one line per balancing method: {method: [ratio per step]}.
    1.0 is a perfectly even load; E / k the worst (every token's k choices on the same k experts)."""
    if not series or not all(series.values()):
        raise ValueError("moe_load_balance needs {method: [max / mean load per step]}, each non-empty")
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for method, ratios in series.items():
        ax.plot(range(1, len(ratios) + 1), ratios, marker=".", label=method)
    ax.axhline(1.0, color="0.5", ls=":", label="even load (1.0)")
    ax.set(xlabel="step", ylabel="max / mean expert load", ylim=(0, None),
           title=f"Expert load per step, whole batch ({label})")
    ax.legend(fontsize=8)
    return _finish(fig)


# --- chapter 07: HSDP against FSDP and DDP --------------------------------------------------------------------
def hsdp_figure(state_rows: list, comm: dict, cross: dict, *, ranks_per_node: int, title: str = ""):
    """Left: model states per rank (MB, largest over the ranks) of each variant, measured. Right: MB each rank sends
    per step, stacked by collective, with a cross (x) for the part sent in groups that span nodes of
    `ranks_per_node`. state_rows: sharding.hsdp_states; comm: sharding.hsdp_comm's first value; cross:
    sharding.cross_node_sent."""
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = [f"{row['variant']}\n{row['mesh']}" for row in state_rows]
    parts = {"parameters": "params", "gradients": "grads", "optimizer m, v": "optimizer"}
    stacked_bars(left, names, {part: [row["measured"][key] / 1e6 for row in state_rows] for part, key in parts.items()})
    left.set(ylabel="MB per rank (max over ranks)", title="model states per rank, measured")
    left.legend(fontsize=8)
    variants = [row["variant"] for row in state_rows]
    ops = ("all_gather", "reduce_scatter", "all_reduce")
    sent = {op: [comm[v].get(op, {}).get("sent", 0) / 1e6 for v in variants] for op in ops}
    stacked_bars(right, names, sent, colours={op: f"C{i + 3}" for i, op in enumerate(ops)})
    right.plot(names, [cross[v] / 1e6 for v in variants], "kx", ms=10, mew=2,
               label=f"of which across nodes of {ranks_per_node}")
    top = max(sum(values) for values in zip(*sent.values()))
    right.set(ylabel="MB sent per rank per step", title="communication per rank: counted, sent as a ring would",
              ylim=(0, 1.35 * top if top else 1))
    right.legend(fontsize=8, ncols=2, loc="upper left")
    if title:
        fig.suptitle(title)
    return fig


def model_states_per_rank(rows: list, labels: dict, title: str = ""):
    """One panel per world size: each mode's measured model states per rank (MB, largest over the ranks), stacked
    by part, with the formula's total as a tick. rows: sharding.measured_states; labels: {N: "CPU, gloo"}, the
    device and backend each world size ran on (the panel's title)."""
    worlds = list(dict.fromkeys(row["N"] for row in rows))
    parts = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states"}
    fig = Figure(figsize=(5.5 * len(worlds), 3.6), layout="constrained")
    for ax, n in zip(fig.subplots(1, len(worlds), squeeze=False)[0], worlds):
        mine = [row for row in rows if row["N"] == n]
        stacked_bars(ax, [row["mode"] for row in mine],
                     {part: [row["measured"][key] / 1e6 for row in mine] for key, part in parts.items()},
                     totals=[row["model"]["total"] / 1e6 for row in mine], totals_label="formula (fp32)")
        ax.set(title=f"{n} ranks ({labels[n]})", ylabel="MB per rank (max)")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


# --- chapter 12: a plan at scale, modelled ---------------------------------------------------------------------

def plan_plot(plan: dict, title: str = ""):
    """A planner's result (models.planner.plan_parallelism), MODELLED: left, memory per GPU of the first and the
    last pipeline stage, stacked by part, against the device's memory; right, the step time by part."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.3])
    names = [f"{st['stage']} stage" for st in plan["stages"]]
    gib = 2 ** 30  # a device's "80 GB" of HBM is 80 GiB
    stacked_bars(left, names, {part: [st["memory"][part] / gib for st in plan["stages"]]
                               for part in ("params", "grads", "optimizer", "activations")})
    device = plan["device_bytes"] / gib
    left.axhline(device, color="k", ls="--", lw=1.5, label=f"device: {device:.0f} GiB")
    left.axhline(plan["reserved_bytes"] / gib, color="C3", ls=":", lw=1.5,
                 label="peak + CUDA context, NCCL, fragmentation")
    top = max(device, plan["reserved_bytes"] / gib)
    left.set(ylabel="GiB per GPU (modelled)", ylim=(0, 1.7 * top),
             title="fits" if plan["fits"] else "does NOT fit: out of memory")
    left.legend(fontsize=8, ncols=1, loc="upper left")  # above the device's line: the bars stop at 1x top
    shown = {k: v for k, v in plan["terms"].items() if v > 0}
    right.barh(list(shown), list(shown.values()), color=[f"C{i}" for i in range(len(shown))])
    right.invert_yaxis()
    right.set(xlabel="seconds per step (modelled)", title=f"step {human_seconds(plan['step_s'])}, "
              f"MFU {plan['mfu']:.0%} (an estimate)")
    lay = plan["layout"]
    fig.suptitle(title or (f"{plan['model']} on {plan['gpus']:,} × {plan['device']} (modelled, not run): "
                           f"dp {lay['dp']} × tp {lay['tp']} × pp {lay['pp']} × cp {lay['cp']}"
                           + (f", ep {lay['ep']}" if lay["ep"] > 1 else "")), fontsize=10)
    return fig
