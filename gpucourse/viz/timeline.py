"""Figures of where the time went (from gpucourse.models.traces) and of how a job scales.

    from gpucourse.models.traces import analyze_run
    from gpucourse import timeline
    a = analyze_run(result)
    timeline.timeline_plot(a)        # one lane per rank: compute above, communication below, steps shaded
    timeline.breakdown_plot(a)       # mean step per rank: compute | overlapped comm | exposed comm | other
    timeline.step_time_plot(a)       # spread of step times per rank
    timeline.scaling_plot({1: 410.0, 2: 760.0, 4: 1310.0}, mode="strong")  # measured: throughput, efficiency
    timeline.throughput_efficiency_plot({"modelled": scaling.simulate(...)})  # the same chart, of any rows

Every function returns a matplotlib Figure built without pyplot (a notebook shows it once, and nothing is left
in pyplot's global state); pass ax= to draw into an axes of your own. Titles name the run, device, backend
and world size, so a saved PNG says what it shows.
"""
from __future__ import annotations

import math
import re
import textwrap

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..models import costs
from ..models.traces import RunAnalysis, clip, intersect, subtract
from ..models.units import human_percent

COLORS = {"compute": "#4c72b0", "overlapped": "#f0a33a", "exposed": "#c44e52", "other": "#c8c8c8",
          "step": "#f2f2f2"}


def _axes(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots()


def _bars(intervals, t0):
    """(start, width) pairs in ms from t0, for broken_barh."""
    return [((s - t0) / 1e3, (e - s) / 1e3) for s, e in intervals]


def timeline_plot(analysis: RunAnalysis, *, ax=None):
    """One lane per rank over the profiled steps: compute on top, communication below it (orange where
    compute hides it, red where it is exposed); steps alternate shading and start at a thin line."""
    fig, ax = _axes(ax, (11, 1.2 + 0.9 * analysis.world_size))
    starts = [ra.steps[0].start_us for ra in analysis.ranks.values() if ra.steps]
    t0 = min(starts) if starts else 0.0
    for rank in range(analysis.world_size):
        ra = analysis.ranks.get(rank)
        if ra is None or not ra.steps:
            continue
        lo, hi = ra.steps[0].start_us, ra.steps[-1].start_us + ra.steps[-1].duration_us
        ax.broken_barh([((s.start_us - t0) / 1e3, s.duration_us / 1e3) for s in ra.steps[::2]],
                       (rank - 0.45, 0.9), facecolor=COLORS["step"], zorder=0)
        ax.vlines([(s.start_us - t0) / 1e3 for s in ra.steps], rank - 0.45, rank + 0.45, color="0.5", lw=0.8)
        for s in ra.steps:
            ax.text((s.start_us - t0) / 1e3, rank - 0.47, f" step {s.step}", fontsize=7, va="bottom", color="0.3")
        compute, comm = clip(ra.intervals["compute"], lo, hi), clip(ra.intervals["comm"], lo, hi)
        ax.broken_barh(_bars(compute, t0), (rank - 0.38, 0.36), facecolor=COLORS["compute"])
        ax.broken_barh(_bars(intersect(comm, compute), t0), (rank + 0.02, 0.36), facecolor=COLORS["overlapped"])
        ax.broken_barh(_bars(subtract(comm, compute), t0), (rank + 0.02, 0.36), facecolor=COLORS["exposed"])
    ax.set_yticks(range(analysis.world_size),
                  [f"rank {r}" + ("" if r in analysis.ranks else " (no trace)") for r in range(analysis.world_size)])
    ax.set_ylim(analysis.world_size - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel("time since the first profiled step (ms)")
    ax.set_title(f"Timeline: {analysis.label()}")
    ax.legend(handles=[Patch(color=COLORS["compute"], label="compute"),
                       Patch(color=COLORS["overlapped"], label="comm, hidden by compute"),
                       Patch(color=COLORS["exposed"], label="comm, exposed")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def timelines_figure(analyses: dict, *, title: str = "", mark: str | None = None, zoom: bool = False):
    """Several runs' timelines stacked, one panel each ({panel title: RunAnalysis}), sharing the time axis; each
    panel names its run, device, backend and world size. mark: communication whose name contains it (e.g.
    "all_gather") drawn as a black line on each rank's communication lane. zoom: the first profiled step of the
    lowest rank only."""
    world = max(a.world_size for a in analyses.values())
    fig = Figure(figsize=(12, 0.6 + (0.9 + 0.8 * world) * len(analyses)), layout="constrained")
    axes = fig.subplots(len(analyses), 1, sharex=not zoom, squeeze=False)[:, 0]
    for ax, (name, a) in zip(axes, analyses.items()):
        timeline_plot(a, ax=ax)
        starts = [ra.steps[0].start_us for ra in a.ranks.values() if ra.steps]
        t0 = min(starts) if starts else 0.0
        if mark:
            key = mark.replace("_", "").lower()  # gloo's "all_gather", NCCL's "AllGather"
            for rank, ra in a.ranks.items():
                if not ra.steps:
                    continue
                lo, hi = ra.steps[0].start_us, ra.steps[-1].start_us + ra.steps[-1].duration_us
                marked = [iv for op, ivs in ra.comm_by_name.items() if key in op.replace("_", "").lower()
                          for iv in clip(ivs, lo, hi)]
                ax.broken_barh(_bars(marked, t0), (rank + 0.02, 0.07), facecolor="black")
        if zoom and a.ranks[min(a.ranks)].steps:
            first = a.ranks[min(a.ranks)].steps[0]
            ax.set_xlim((first.start_us - t0) / 1e3, (first.start_us + first.duration_us - t0) / 1e3)
            for text in ax.texts:  # the other steps' labels, outside the window
                text.set_clip_on(True)
        ax.set_title(f"{name} — {a.name}: {a.device}, {a.backend}, {a.world_size} ranks"
                     + (f" (black: {mark})" if mark else ""), fontsize=9)
        if ax is not axes[0]:
            ax.get_legend().remove()
        if ax is not axes[-1] and not zoom:
            ax.set_xlabel("")
    if title:
        fig.suptitle(title)
    return fig


PIPELINE_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}  # forward, backward, its halves
PIPELINE_KINDS = {"F": "forward", "B": "backward", "I": "backward, input grad", "W": "backward, weight grad"}
_ACTION = re.compile(r"(\d*)([FBIW])(\d*)")  # [stage]kind[micro-batch]: "F3", "1B0", "0W7"


LABEL_PT = 7  # a bar's label; its width in inches is about 0.6 × points / 72 per character


def pipeline_rows(ax, timeline: dict, title: str, *, span_ms: float | None = None,
                  axes_inches: float | None = None) -> None:
    """A pipeline's actions, one row per rank ({rank: [(label, start ms, end ms)]}, labels like "F3" or "1B3":
    stage, kind, micro-batch), coloured by kind; a rank's later stages lighter; actions run as one block (same
    start and end) split the row's height; a label on each bar whose width holds it (span_ms: the time axis's
    width, default this timeline's; axes_inches: the panel's width, default 10 inches)."""
    span_ms = span_ms or max(end for spans in timeline.values() for _, _, end in spans)
    ms_per_inch = span_ms / (axes_inches or 10.0)
    for rank, spans in timeline.items():
        local = sorted({_ACTION.fullmatch(a)[1] for a, _, _ in spans})  # this rank's stages ("" when unnamed)
        blocks = {}  # actions that share a start and an end (an overlapped block: DualPipe's F&B) share the row
        for action, start, end in spans:
            blocks.setdefault((start, end), []).append(action)
        for (start, end), actions in blocks.items():
            height = 0.8 / len(actions)
            for k, action in enumerate(actions):
                stage, kind, _ = _ACTION.fullmatch(action).groups()
                shade = 1.0 - 0.45 * local.index(stage) / max(1, len(local) - 1)
                bottom = rank - 0.4 + k * height
                ax.broken_barh([(start, end - start)], (bottom, height), facecolor=PIPELINE_COLORS[kind],
                               alpha=shade, edgecolor="white")
                if (end - start) / ms_per_inch > (len(action) + 1) * 0.6 * LABEL_PT / 72:
                    ax.text((start + end) / 2, bottom + height / 2, action, ha="center", va="center", color="white",
                            fontsize=LABEL_PT)
    ax.set_yticks(list(timeline), [f"rank {r}" for r in timeline])
    ax.set_ylim(len(timeline) - 0.5, -0.5)
    ax.set_xlabel("time since the step started (ms)")
    ax.set_title(textwrap.fill(title, max(40, int((axes_inches or 10.0) * 72 / (8 * 0.55)))), fontsize=8)


def pipeline_figure(panels: list[list[tuple[dict, str]]], *, title: str = ""):
    """A grid of pipeline timelines: panels[row][column] = (timeline, title), every panel on one time axis,
    one legend for the kinds of action drawn. A panel's title wraps to its width; a bar's label is drawn only
    where the bar is wide enough to hold it."""
    rows, cols = len(panels), len(panels[0])
    ranks = max(len(t) for row in panels for t, _ in row)
    width = 11 if cols == 1 else 14
    axes_inches = (width - 2.2) / cols - 0.5  # the legend's column and each panel's rank labels taken off
    title_lines = max(len(textwrap.wrap(name, max(40, int(axes_inches * 72 / (8 * 0.55)))))
                      for row in panels for _, name in row)
    fig = Figure(figsize=(width, 0.8 + (0.55 * ranks + 0.65 + 0.15 * title_lines) * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True)
    span_ms = max(end for row in panels for t, _ in row for spans in t.values() for _, _, end in spans)
    kinds, staged = set(), False
    for i, (ax_row, row) in enumerate(zip(axes, panels)):
        for ax, (t, name) in zip(ax_row, row):
            pipeline_rows(ax, t, name, span_ms=span_ms, axes_inches=axes_inches)
            if i < rows - 1:
                ax.set_xlabel("")  # the shared time axis is named once, under the last row
            actions = [_ACTION.fullmatch(a) for spans in t.values() for a, _, _ in spans]
            kinds |= {a[2] for a in actions}
            staged = staged or any(a[1] for a in actions)
    fig.legend(handles=[Patch(color=c, label=PIPELINE_KINDS[k]) for k, c in PIPELINE_COLORS.items() if k in kinds],
               loc="outside right upper", fontsize=8, title="darker: a rank's\nfirst stage" if staged else None,
               title_fontsize=7)
    if title:
        fig.suptitle(textwrap.fill(title, int(width * 72 / (9 * 0.55))), fontsize=9)
    return fig


def breakdown_plot(analysis: RunAnalysis, *, ax=None):
    """Mean step of each rank as a stacked bar that sums to the step time:
    compute alone | compute overlapped with comm | exposed comm | other/idle (ms)."""
    fig, ax = _axes(ax, (5.5 + 1.0 * analysis.world_size, 4.5))
    ranks = sorted(analysis.ranks)
    parts = {
        "compute (no comm)": [analysis.ranks[r].mean("compute_us") - analysis.ranks[r].mean("overlapped_comm_us")
                              for r in ranks],
        "compute ∥ comm (overlapped)": [analysis.ranks[r].mean("overlapped_comm_us") for r in ranks],
        "exposed comm": [analysis.ranks[r].mean("exposed_comm_us") for r in ranks],
        "other / idle": [analysis.ranks[r].mean("other_us") for r in ranks],
    }
    bottom = [0.0] * len(ranks)
    for (label, values), color in zip(parts.items(), ("compute", "overlapped", "exposed", "other")):
        ms = [v / 1e3 for v in values]
        ax.bar([f"rank {r}" for r in ranks], ms, bottom=bottom, label=label, color=COLORS[color])
        bottom = [b + m for b, m in zip(bottom, ms)]
    for i, r in enumerate(ranks):
        overlap = analysis.ranks[r].overlap
        text = "no comm" if math.isnan(overlap) else f"{human_percent(overlap)} overlap"
        ax.annotate(text, (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("mean time per step (ms)")
    ax.set_title(f"Mean step per rank\n{analysis.label()}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def step_time_plot(analysis: RunAnalysis, *, ax=None):
    """Step times of each rank: a box per rank with every step as a dot (few steps: the dots matter)."""
    fig, ax = _axes(ax, (4 + 0.8 * analysis.world_size, 4))
    ranks = sorted(analysis.ranks)
    times = [[s.duration_us / 1e3 for s in analysis.ranks[r].steps] for r in ranks]
    ax.boxplot(times, positions=range(len(ranks)), widths=0.5, showfliers=False)  # the dots show every step
    for i, values in enumerate(times):
        ax.plot([i] * len(values), values, "o", color=COLORS["compute"], alpha=0.7, ms=4, gid="steps")
    ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"Step times\n{analysis.label()}", fontsize=9)
    return fig


# --- scaling ----------------------------------------------------------------------------------------
def _mean(values) -> float:
    return sum(values) / len(values)


def efficiencies(throughput_by_world_size: dict) -> dict[int, float]:
    """costs.scaling_efficiency at each world size N, against the smallest N measured (N0, usually 1).

    Values may be numbers or lists of repeats (their mean is used).
    """
    if not throughput_by_world_size:
        raise ValueError("no measurements: pass {world_size: samples_per_s}, e.g. {1: 400.0, 2: 760.0}")
    means = {}
    for n, value in sorted(throughput_by_world_size.items()):
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not isinstance(n, int) or n < 1 or not values or not all(
                isinstance(v, (int, float)) and v > 0 for v in values):
            raise ValueError(f"bad measurement {n!r}: {value!r}: world sizes are whole numbers >= 1 and "
                             "throughputs positive numbers (or lists of them)")
        means[n] = _mean(values)
    base = min(means)
    return {n: costs.scaling_efficiency(t, means[base], n, base) for n, t in means.items()}


def scaling_plot(throughput_by_world_size: dict, *, mode: str = "strong", unit: str = "samples/s",
                 label: str = ""):
    """Measured throughput and efficiency against world size (throughput_efficiency_plot), with the ideal.

    throughput_by_world_size: {N: samples_per_s} or {N: [repeats]} (then the error bars span min..max).
    mode: "strong" (fixed global problem) or "weak" (fixed problem per rank), for the titles.
    label: what was measured (device, backend, model...), shown in the title.
    """
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode must be 'strong' or 'weak', not {mode!r}")
    eff = efficiencies(throughput_by_world_size)
    runs = {n: (list(v) if isinstance(v, (list, tuple)) else [v]) for n, v in throughput_by_world_size.items()}
    rows = [{"world_size": n, "throughput": _mean(runs[n]), "efficiency": eff[n], "throughput_min": min(runs[n]),
             "throughput_max": max(runs[n])} for n in sorted(eff)]
    base = rows[0]["world_size"]
    fig = throughput_efficiency_plot(
        {"measured": rows}, unit=unit, title=f"{mode.capitalize()} scaling" + (f": {label}" if label else ""))
    ax_t, ax_e = fig.axes
    ax_t.set_title("Throughput")
    ax_e.set_title(f"Efficiency = throughput / (N/{base} × throughput at N={base})" if base != 1 else
                   "Efficiency = throughput / (N × single-worker throughput)", fontsize=9)
    return fig


def throughput_efficiency_plot(curves: dict, *, unit: str = "samples/s", log: bool = False, title: str = "",
                               vlines: dict | None = None, measured: dict | None = None):
    """Throughput and efficiency against world size N: the course's one scaling chart, measured or modelled.

    curves: {label: rows}, rows [{"world_size", "throughput", "efficiency"}] as models.scaling.simulate returns them;
    "throughput_min" and "throughput_max" in a row (repeats) draw error bars. Each curve gets its ideal: linear
    from its first row. log: log axes (world sizes in powers of two). vlines: {label: N}, a dotted line in that
    curve's colour (the simulator's turning points). measured: {N: efficiency} drawn as dots over modelled
    curves. One legend below both panels, so it never hides a curve; fig.axes: (throughput, efficiency).
    """
    fig = Figure(figsize=(11, 4.4 + 0.3 * len(curves)), layout="constrained")
    ax_t, ax_e = fig.subplots(1, 2)
    for i, (label, rows) in enumerate(curves.items()):
        ns, tp = [r["world_size"] for r in rows], [r["throughput"] for r in rows]
        style = {"color": f"C{i}", "ls": "-" if i == 0 else "--", "lw": 2 if i == 0 else 1.2,
                 "marker": "o", "ms": 3}
        spread = [[t - r.get("throughput_min", t) for t, r in zip(tp, rows)],
                  [r.get("throughput_max", t) - t for t, r in zip(tp, rows)]]
        ax_t.errorbar(ns, tp, yerr=spread if any(map(any, spread)) else None, capsize=3, label=label, **style)
        ax_e.plot(ns, [100 * r["efficiency"] for r in rows], label=label, **style)
        per_rank = tp[0] / ns[0]
        ax_t.plot(ns, [per_rank * n for n in ns], color=f"C{i}", ls=":", lw=0.8,
                  label="ideal (linear), dotted" if i == 0 else None)
        if (vlines or {}).get(label) is not None:
            for ax in (ax_t, ax_e):
                ax.axvline(vlines[label], color=f"C{i}", ls=":", lw=1)
    ax_e.axhline(100, color="0.5", ls=":", lw=0.8)
    if measured:
        sizes = sorted(measured)
        ax_e.plot(sizes, [100 * measured[n] for n in sizes], "ko", ms=5, label="measured on this machine")
    ns = sorted({r["world_size"] for rows in curves.values() for r in rows})
    top = max(100 * r["efficiency"] for rows in curves.values() for r in rows)
    ax_t.set(xlabel="world size N", ylabel=f"throughput ({unit})")
    ax_e.set(xlabel="world size N", ylabel="efficiency (%)", ylim=(0, max(105, 1.05 * top)))
    for ax in (ax_t, ax_e):
        if log:
            ax.set_xscale("log")
        ax.set_xticks([n for n in ns if math.log2(n) % 2 == 0] if len(ns) > 8 else ns)
        ax.get_xaxis().set_major_formatter("{x:g}")
    if log:
        ax_t.set_yscale("log")
    handles = {}  # one entry per label, from both panels
    for ax in (ax_t, ax_e):
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


# --- a run's history and a step's parts ---------------------------------------------------------------
ATTEMPT_COLOURS = ("tab:red", "tab:blue", "tab:green", "tab:purple")


def restart_plot(uninterrupted: list[dict], killed: list[dict], *, kill_at: int, kill_rank: int, label: str = ""):
    """Loss per step of a job killed and restarted (a line per attempt) over the same job uninterrupted.

    uninterrupted, killed: one rank's records ({"step", "loss"}, and "attempt" in the killed run's), as
    08_resume.py logs them. A dotted line marks the step before which rank `kill_rank` was killed. Log y.
    """
    attempts = sorted({m["attempt"] for m in killed if "attempt" in m and "loss" in m})
    if not attempts:
        raise ValueError("restart_plot needs the killed run's records with 'step', 'loss' and 'attempt'")
    fig, ax = _axes(None, (9, 3.6))
    steps = [(m["step"], m["loss"]) for m in uninterrupted if "step" in m and "loss" in m]
    ax.plot([s for s, _ in steps], [v for _, v in steps], color="0.6", lw=5, alpha=0.5, label="uninterrupted")
    for attempt in attempts:
        recs = [m for m in killed if m.get("attempt") == attempt and "loss" in m]
        ax.plot([m["step"] for m in recs], [m["loss"] for m in recs], "o-", ms=3,
                color=ATTEMPT_COLOURS[attempt % len(ATTEMPT_COLOURS)],
                label=f"killed run, attempt {attempt}" + (" (restarted)" if attempt else ""))
    ax.axvline(kill_at, color="tab:red", ls=":", label=f"rank {kill_rank} SIGKILLed before step {kill_at}")
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)", yscale="log",
           title="kill and resume" + (f" — {label}" if label else ""))
    ax.legend(fontsize=8)
    return fig


FRACTION_COLOURS = {"compute": "tab:blue", "exposed": "tab:red", "other": "tab:gray"}


def step_fractions_plot(fractions: dict, *, title: str = ""):
    """One bar per run: the mean profiled step split into compute | exposed comm | other, as fractions of it.

    fractions: {run name: RunAnalysis.fractions()} ({"step_ms", "compute", "exposed", "other", "comm"});
    each bar is annotated with its step time and the share of the step that communicated.
    """
    if not fractions:
        raise ValueError("step_fractions_plot needs {run name: analysis.fractions()}")
    fig, ax = _axes(None, (8, 1.4 + 0.55 * len(fractions)))
    for i, f in enumerate(fractions.values()):
        left = 0
        for part, colour in FRACTION_COLOURS.items():
            ax.barh(i, f[part], left=left, color=colour, label=part if i == 0 else None)
            left += f[part]
        ax.text(1.01, i, f"{f['step_ms']:.0f} ms/step, comm {f['comm']:.0%} of step", va="center", fontsize=8)
    ax.set_yticks(range(len(fractions)), list(fractions))
    ax.invert_yaxis()  # the first run on top, in the order the runs are printed
    ax.set(xlim=(0, 1), xlabel="fraction of a profiled step (mean over ranks)", title=title)
    fig.legend(loc="outside lower center", fontsize=8, ncols=3)  # below: above the bars it covered the title
    return fig
