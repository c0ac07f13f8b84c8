"""Chapter 07, ZeRO and FSDP: the tables and figures it shows from its runs.

`notebooks/07_zero_and_fsdp.ipynb` imports it by its short name:

    from gpucourse.chapters import ch07
    ch07.memory_per_rank(rows)           # bytes per rank against the ZeRO formulas

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure

from ..models import costs
from ..viz.plots import stacked_bars
from ..viz.tables import as_table


def _gb(num_bytes) -> float:
    return round(num_bytes / 1e9, 1)  # decimal GB, as the ZeRO paper counts


@as_table
def zero_stages(num_params, world_size, **kwargs) -> pd.DataFrame:
    """MODELLED: each ZeRO stage's model states per device (memory.model_states) and its communication per rank
    and step (costs.zero_comm_volume), in decimal GB. kwargs: model_states' optimizer, precision, offload."""
    from ..models.memory import model_states

    rows = []
    for stage in range(4):
        row = model_states(num_params, world_size, stage, **kwargs)
        rows.append({"stage": stage, "parameters (GB)": _gb(row["parameters"]), "gradients (GB)": _gb(row["gradients"]),
                     "optimizer states (GB)": _gb(row["optimizer states"]), "per device (GB)": _gb(row["total"]),
                     "communication per step (GB)": _gb(costs.zero_comm_volume(num_params, stage))})
    return pd.DataFrame(rows).set_index("stage")


@as_table
def model_sizes(sizes, device_bytes, *, node=8) -> pd.DataFrame:
    """MODELLED: for each model size (parameters), mixed-precision Adam's model states per device under DDP and on
    one `node`-device node under ZeRO-1 and ZeRO-3, and the fewest devices (a power of 2) whose states fit in
    device_bytes under each ("never": ZeRO-1's replicated 4 bytes per parameter alone do not fit)."""
    from ..models.memory import model_states
    from ..models.sharding import fewest_devices

    rows = []
    for psi in sizes:
        ddp = model_states(psi, 1, 0)["total"]
        rows.append({"model": f"{psi / 1e9:g}B", "DDP per device (GB)": _gb(ddp), "fits under DDP": ddp <= device_bytes,
                     f"ZeRO-1 on {node} (GB)": _gb(model_states(psi, node, 1)["total"]),
                     f"ZeRO-3 on {node} (GB)": _gb(model_states(psi, node, 3)["total"]),
                     "fewest devices, ZeRO-1": fewest_devices(psi, 1, device_bytes) or "never",
                     "fewest devices, ZeRO-3": fewest_devices(psi, 3, device_bytes) or "never"})
    return pd.DataFrame(rows).set_index("model")


@as_table
def memory_per_rank(rows: list) -> pd.DataFrame:
    """Chapter 07's measured bytes per rank (the largest over the ranks), MB, beside the formula's total, their
    ratio, and how far rank 0's final parameters ended from DDP's. rows: sharding.measured_states."""
    from ..models.sharding import STATE_KEYS

    out = []
    for row in rows:
        out.append({"N": row["N"], "mode": row["mode"],
                    **{f"{part} (MB)": round(row["measured"][k] / 1e6, 3) for k, part in STATE_KEYS.items()},
                    "total (MB)": round(row["total"] / 1e6, 3), "formula (MB)": round(row["model"]["total"] / 1e6, 3),
                    "measured / formula": round(row["total"] / row["model"]["total"], 6),
                    "|θ − θ_DDP|": row["diff"]})
    return pd.DataFrame(out).set_index(["N", "mode"])


@as_table
def share_of_ddp(rows: list) -> pd.DataFrame:
    """Each mode's bytes of each part as a share of DDP's at the same world size, beside 1/N."""
    from ..models.sharding import STATE_KEYS, share_of_ddp as shares

    out = [{"N": n, "mode": mode, **{part: round(s[k], 3) for k, part in STATE_KEYS.items()}, "1/N": round(1 / n, 3)}
           for (n, mode), s in shares(rows).items()]
    return pd.DataFrame(out).set_index(["N", "mode"])


@as_table
def prefetch(analyses: dict, records: dict) -> pd.DataFrame:
    """FSDP2's variants from their traces, per step over every rank's profiled steps: all-gathers counted (how
    many, MB each, how many issued asynchronously), all-gather time and its exposed part (mean, min, max, ms), the
    share hidden under compute, the step time. analyses: {variant: traces.analyze_run}; records: {variant: rank
    0's record}."""
    import statistics

    from ..models.sharding import all_gather_ms

    rows = []
    for v, analysis in analyses.items():
        rec, ag = records[v], all_gather_ms(analysis)
        total, exposed = [t for t, _ in ag], [e for _, e in ag]
        rows.append({"variant": v, "all-gathers": rec["all_gathers"],
                     "MB each": round(rec["all_gather_bytes"][0] / 1e6, 2),
                     "async": rec["async_all_gathers"], "all-gather (ms)": round(statistics.mean(total), 1),
                     "min (ms)": round(min(total), 1), "max (ms)": round(max(total), 1),
                     "exposed (ms)": round(statistics.mean(exposed), 1),
                     "hidden (%)": round(100 * (1 - sum(exposed) / sum(total)), 0) if sum(total) else math.nan,
                     "step (ms)": round(statistics.mean(s.duration_us / 1e3 for s in analysis.steps), 1)})
    return pd.DataFrame(rows).set_index("variant")


@as_table
def unsharded(records: dict) -> pd.DataFrame:
    """Per FSDP2 wrapping (records: {name: rank 0's record}): all-gathers and reduce-scatters of a step, MB each,
    and the most parameter MB unsharded while a layer runs forward, against the model's."""
    rows = [{"wrapping": name, "all-gathers": rec["all_gathers"], "MB each": round(rec["all_gather_bytes"][0] / 1e6, 2),
             "reduce-scatters": rec["reduce_scatters"],
             "unsharded at most (MB)": round(rec["peak_unsharded_bytes"] / 1e6, 2),
             "model (MB)": round(rec["model_bytes"] / 1e6, 2)} for name, rec in records.items()]
    return pd.DataFrame(rows).set_index("wrapping")


@as_table
def hsdp_states(rows: list) -> pd.DataFrame:
    """DDP, FSDP and HSDP bytes per rank (MB, largest over the ranks) beside the formula, "= formula" when every
    part is exact, and the largest loss and parameter differences from one process. rows: sharding.hsdp_states."""
    from ..models.sharding import STATE_KEYS

    out = []
    for row in rows:
        out.append({"variant": row["variant"], "mesh": row["mesh"],
                    **{f"{part} (MB)": round(row["measured"][k] / 1e6, 3) for k, part in STATE_KEYS.items()},
                    "formula total (MB)": round(sum(row["model"].values()) / 1e6, 3),
                    "= formula": row["measured"] == row["model"],
                    "max |Δloss|": row["loss diff"], "max |Δθ|": row["param diff"]})
    return pd.DataFrame(out).set_index("variant")


@as_table
def hsdp_comm(comm: dict) -> pd.DataFrame:
    """Rank 0's collectives of one step per variant and group (sharding.hsdp_comm): MB counted (handed to the
    collective), the formula's, and MB a bandwidth-optimal algorithm sends for it."""
    rows = [{"variant": v, "collective": op, "group": f["group"], "ranks": str(f["ranks_list"]),
             "counted (MB)": round(f["counted"] / 1e6, 3), "formula (MB)": round(f["calls_bytes"] / 1e6, 3),
             "sent per rank (MB)": round(f["sent"] / 1e6, 3)} for v, ops in comm.items() for op, f in ops.items()]
    return pd.DataFrame(rows).set_index(["variant", "collective"])


@as_table
def accumulation_calls(records: dict, ops=("all_gather", "reduce_scatter")) -> pd.DataFrame:
    """Per gradient-accumulation variant (records: {variant: rank 0's record with "calls" [{"op", "bytes"}] and
    "max_param_diff"}): calls and MB of each collective in one step, and the distance from one process."""
    rows = []
    for variant, rec in records.items():
        row = {"variant": variant}
        for op in ops:
            sizes = [c["bytes"] for c in rec["calls"] if c["op"] == op]
            row |= {f"{op} calls": len(sizes), f"{op} (MB)": round(sum(sizes) / 1e6, 3)}
        rows.append(row | {"max |Δθ| vs one process": rec["max_param_diff"]})
    return pd.DataFrame(rows).set_index("variant")


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
