"""Chapter 13, the 3-D capstone: the figure it draws from its run.

`notebooks/13_3d_parallel_and_silent_bugs.ipynb` imports it by its short name:

    from gpucourse.chapters import ch13
    ch13.mesh_figure(coords, label)      # where each rank sat on the (pp, dp, tp) mesh, and its groups

A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib import patches
from matplotlib.lines import Line2D

from ..viz.plots import finished


def mesh_figure(coords: dict, label: str = ""):
    """The ranks of a 3-D run where each said it sat ({rank: (pp, dp, tp)}, from its log): one panel per pipeline
    stage, a row per dp index and a column per tp index; a tp group is a row (solid outline), a dp group a column
    of one stage (dashed), a pp group the ranks at the same (dp, tp) place of every stage (an arrow a stage)."""
    if not coords:
        raise ValueError("mesh_figure needs {rank: (pp, dp, tp)}")
    pp, dp, tp = (max(c[i] for c in coords.values()) + 1 for i in range(3))
    if len(coords) != pp * dp * tp or len(set(coords.values())) != len(coords):
        raise ValueError(f"{len(coords)} ranks do not fill a {pp} x {dp} x {tp} mesh once each: {coords}")
    gap = 1.2  # between stages, in boxes
    fig, ax = plt.subplots(figsize=(min(2.2 * pp * tp + 1.5, 11), 1.1 * dp + 1.6))
    place = {c: (c[0] * (tp + gap) + c[2], dp - 1 - c[1]) for c in coords.values()}  # (x, y) of a box's corner
    for rank, c in coords.items():
        x, y = place[c]
        ax.add_patch(patches.Rectangle((x + 0.08, y + 0.12), 0.84, 0.76, color=f"C{c[1] % 10}", alpha=0.35))
        ax.text(x + 0.5, y + 0.5, f"rank {rank}", ha="center", va="center", fontsize=9)
    for s in range(pp):
        for d in range(dp):  # a tp group: one row of a stage
            x, y = place[(s, d, 0)]
            ax.add_patch(patches.Rectangle((x + 0.03, y + 0.07), tp - 0.06, 0.86, fill=False, lw=1.5))
        for t in range(tp):  # a dp group: one column of a stage
            x, _ = place[(s, 0, t)]
            ax.add_patch(patches.Rectangle((x + 0.01, 0.02), 0.98, dp - 0.04, fill=False, ls="--", lw=1))
        ax.text(s * (tp + gap) + tp / 2, dp + 0.15, f"stage {s}", ha="center", fontsize=10)
        if s + 1 < pp:  # each rank sends its activations to the rank at its (dp, tp) place of the next stage
            x = s * (tp + gap) + tp
            ax.annotate("", (x + gap - 0.1, dp / 2), (x + 0.1, dp / 2),
                        arrowprops={"arrowstyle": "simple,head_width=1.2", "color": "0.5"})
            ax.text(x + gap / 2, dp / 2 - 0.35, "to the same\n(dp, tp) place", ha="center", va="top", fontsize=8, color="0.3")
    ax.set_xlim(-0.2, pp * (tp + gap) - gap + 0.2)
    ax.set_ylim(-0.2, dp + 0.6)
    ax.set_axis_off()
    ax.legend(handles=[Line2D([], [], color="k", lw=1.5, label=f"tp group ({tp} ranks)"),
                       Line2D([], [], color="k", ls="--", lw=1, label=f"dp group ({dp} ranks)"),
                       Line2D([], [], color="0.5", marker=">", lw=3, label=f"pp group ({pp} ranks): activations")],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=8, frameon=False)
    ax.set_title(f"the (pp, dp, tp) = ({pp}, {dp}, {tp}) mesh, where each rank said it sat"
                 + (f" ({label})" if label else ""), fontsize=10)
    return finished(fig)
