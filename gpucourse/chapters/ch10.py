"""Chapter 10, context parallelism: the figures it shows from its runs.

`notebooks/10_context_parallel.ipynb` imports it by its short name:

    from gpucourse.chapters import ch10
    ch10.saved_memory_plot(seqs, memory, label)

A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib import ticker

from ..models.units import human_bytes
from ..viz.plots import finished


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
    return finished(fig)


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
    return finished(fig)


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
    return finished(fig)
