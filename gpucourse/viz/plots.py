"""The course's figures: small functions, each returning one matplotlib Figure. What several chapters draw lives here
(with `timeline.py` and `widgets.py`); a figure one chapter draws lives in its chapter's module (`gpucourse/chapters/`),
by the same rules.

Every figure says where its numbers came from. Pass `label=run_label(result)` ("cpu · gloo · 4 ranks")
and it goes into the title (`runs_label` for several runs in one figure); numbers from a model, not a run,
are titled as modelled. A figure is built without pyplot's state (`Figure(...)`), or closed before it is
returned (`finished`), so a notebook shows each one once: where you display it (the cell's last expression, or
`display(fig)`; the chapter's first cell runs `%matplotlib inline` so that a bare Figure is drawn).
"""
from __future__ import annotations

import math
import sys
import textwrap

import matplotlib

if "ipykernel" not in sys.modules:  # scripts and tests: no display, and no GUI toolkit needed
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from ..models.memory import PARTS, STAGE_NAMES, gb  # noqa: E402
from ..models.units import human_bytes, human_seconds  # noqa: E402, F401 - the chapters call plots.human_bytes

GB = 1e9


def run_label(result) -> str:
    """'cpu · gloo · 4 ranks': the device the ranks reported (RunResult.device), backend and world size of a run."""
    ranks = f"{result.world_size} rank" + ("s" if result.world_size != 1 else "")
    return f"{result.device} · {result.manifest.get('backend', '?')} · {ranks}"


def finished(fig):
    """fig laid out tight and closed to pyplot, so that it is drawn once, where the caller displays it."""
    fig.tight_layout()
    plt.close(fig)  # the caller displays it; pyplot must not show it a second time
    return fig


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


def runs_label(results) -> str:
    """'cpu · gloo · 1, 2, 4 ranks': device(s), backend(s) and world sizes of several runs drawn in one figure."""
    results = list(results)
    if not results:
        raise ValueError("runs_label needs at least one run")
    devices = " / ".join(dict.fromkeys(r.device for r in results))
    backends = " / ".join(dict.fromkeys(str(r.manifest.get("backend", "?")) for r in results))
    sizes = ", ".join(str(n) for n in sorted({r.world_size for r in results}))
    return f"{devices} · {backends} · {sizes} rank{'' if sizes == '1' else 's'}"


def log_y(ax) -> None:
    """A log y axis labelled with plain numbers (0.5, 1, 2, 3, 5, ...)."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(ticker.FuncFormatter(
        lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 3, 5) else ""))


# --- the same training done two ways, step by step (chapters 02 and 09) ----------------------------

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


# --- a plan at scale, modelled (chapter 12, and its planner widget) -------------------------------------------

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
