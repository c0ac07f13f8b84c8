"""Chapter 11, expert parallelism: the tables and figures it shows from its runs.

`notebooks/11_expert_parallel.ipynb` imports it by its short name:

    from gpucourse.chapters import ch11
    ch11.moe_per_rank(records)           # each rank's values against one process

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import patches
from matplotlib.lines import Line2D

from ..viz.plots import finished
from ..viz.tables import as_table


@as_table
def moe_per_rank(records: dict, columns: dict | None = None, *, diffs: bool = True) -> pd.DataFrame:
    """One row per rank of an 11_moe.py run ({rank: its case record}): the record's values named in `columns`
    ({header: key}), then, with diffs, each quantity's |expert parallel − one process| (the record's "diffs"),
    one column each ("|Δ| output", "|Δ| tokens.grad", ...)."""
    if not records:
        raise ValueError("moe_per_rank needs {rank: record}")
    rows = [{"rank": rank, **{header: rec[key] for header, key in (columns or {}).items()},
             **({f"|Δ| {k}": v for k, v in rec["diffs"].items()} if diffs else {})}
            for rank, rec in sorted(records.items())]
    return pd.DataFrame(rows).set_index("rank")


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
    return finished(fig)
