"""Chapter 06, tensor parallelism: the tables and figures it shows from its runs.

`notebooks/06_tensor_parallel.ipynb` imports it by its short name:

    from gpucourse.chapters import ch06
    ch06.tp_check(metrics, "mlp", tol=1e-5)

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import patches
from matplotlib.figure import Figure

from ..models import costs
from ..models.units import human_bytes
from ..viz.plots import log_y
from ..viz.tables import as_table


@as_table
def tp_check(metrics: dict, case: str, *, tol: float, skip: tuple = ()) -> pd.DataFrame:
    """One row per world size: the largest |parallel − dense| of each checked quantity over every rank, the
    verdict (every one within `tol`, except those named in `skip`) and rank 0's collectives (phase, op, size).
    A column per quantity, as the run named it. metrics: {world size: {rank: records}}, the records with
    "case" == case holding "diffs", "calls" and, for a single layer, "shapes"."""
    rows = []
    for n, by_rank in metrics.items():
        per_rank = [next(r for r in recs if r.get("case") == case) for recs in by_rank.values()]
        rank0 = next(r for r in by_rank[min(by_rank)] if r.get("case") == case)
        worst = {k: max(rec["diffs"][k] for rec in per_rank) for k in per_rank[0]["diffs"]}
        bad = [k for k, v in worst.items() if k not in skip and not v <= tol]
        rows.append({"ranks": n, **({"shapes": rank0["shapes"]} if "shapes" in rank0 else {}), **worst,
                     "verdict": f"all within {tol:g} of dense" if not bad else f"DIFFERENT from dense: {', '.join(bad)}",
                     "collectives (rank 0)": "; ".join(f"{c['phase']}: {c['op']} {human_bytes(c['bytes'])}"
                                                       for c in rank0["calls"]) or "none"})
    return pd.DataFrame(rows).set_index("ranks")


@as_table
def tp_block_traffic(records: dict, *, batch: int, seq: int, hidden: int, bytes_per_value: int = 4) -> pd.DataFrame:
    """One row per (world size, block): all-reduces in forward and in backward, their sizes (bytes) against
    the formula b·s·h·bytes, what each rank sends per all-reduce (ring), and whether the run matches Megatron's
    one all-reduce each way (none on 1 rank, no other collective). records: {world size: {case: rank 0's
    record}} for the cases "mlp" and "attention", each with its "calls" ({"phase", "op", "bytes"})."""
    formula = batch * seq * hidden * bytes_per_value
    rows = []
    for n, by_case in records.items():
        for case in ("mlp", "attention"):
            calls = by_case[case]["calls"]
            fwd = [c for c in calls if c["phase"] == "forward" and c["op"] == "all_reduce"]
            bwd = [c for c in calls if c["phase"] == "backward" and c["op"] == "all_reduce"]
            others = [c for c in calls if c["op"] != "all_reduce"]
            sizes = sorted({c["bytes"] for c in fwd + bwd})
            one_each = len(fwd) == len(bwd) == 1 and sizes == [formula]
            rows.append({"ranks": n, "block": case, "forward all-reduces": len(fwd),
                         "backward all-reduces": len(bwd), "bytes each (run)": ", ".join(map(str, sizes)),
                         "b·s·h·4 (bytes, formula)": formula,
                         "sent per rank per all-reduce": human_bytes(costs.bytes_moved_per_rank("all_reduce", formula, n)),
                         "Megatron's count": "matches" if not others and (one_each or n == 1 and not fwd + bwd)
                         else "DIFFERS"})
    return pd.DataFrame(rows).set_index(["ranks", "block"])


@as_table
def comm_counts(recs: dict) -> pd.DataFrame:
    """One row per implementation: its largest differences from dense (a column per quantity) and the
    collectives CommDebugMode counted in forward and in backward. recs: {name: {"diffs", "comms"}}, comms as
    {phase: {op: count}}."""
    rows = [{"implementation": name, **rec["diffs"],
             **{f"{phase} collectives": ", ".join(f"{op} ×{k}" for op, k in rec["comms"].get(phase, {}).items())
                or "none" for phase in ("forward", "backward")}} for name, rec in recs.items()]
    return pd.DataFrame(rows).set_index("implementation")


@as_table
def tp_cost(model: dict) -> pd.DataFrame:
    """One row per (tensor-parallel degree, link): the modelled compute per rank of one layer (ms), the link's
    nominal bandwidth (GB/s per GPU, per direction), the time of the layer's 4 all-reduces (ms) and their ratio
    to the compute. model: {(degree, link name in costs.INTERCONNECTS): (compute seconds, communication seconds)}."""
    rows = [{"TP": tp, "link": link, "compute (ms)": compute * 1e3,
             "link (GB/s, nominal)": costs.INTERCONNECTS[link].bandwidth_bytes_per_s / 1e9,
             "4 all-reduces (ms)": comm * 1e3, "comm / compute": comm / compute}
            for (tp, link), (compute, comm) in model.items()]
    return pd.DataFrame(rows).set_index(["TP", "link"]).round(
        {"compute (ms)": 3, "link (GB/s, nominal)": 0, "4 all-reduces (ms)": 3, "comm / compute": 2})


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
    log_y(ax)  # plain numbers (0.5, 1, 2, 5 ms), never 3×10⁰
    ax.set(ylabel="ms per layer (forward + backward)", title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig
