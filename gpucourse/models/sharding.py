"""What chapter 07's sharded runs say: model-state bytes per rank against the ZeRO formulas, how each mode's parts
compare with DDP's, the collectives of a step per process group against `costs.sharded_dp_comm_bytes`, and the
all-gather time a profiled FSDP2 step exposes.

    rows = measured_states({2: run2.metrics, 4: run4.metrics}, STAGES)      # one row per (world size, mode)
    sharding_faults(rows)                                                   # [] when every mode shards as it should
"""
from __future__ import annotations

from collections import defaultdict

from . import costs
from .memory import model_states

STATE_KEYS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states"}
# chapter 07's memory script: each mode and the ZeRO stage whose formula it should match
STAGES = {"ddp": 0, "zero1": 1, "sharded": 1, "fsdp2": 3, "fsdp": 3}


def dim0_shard_rows(rows: int, world: int, rank: int) -> int:
    """Rows of a tensor's first dimension that rank `rank` of `world` holds once FSDP2 shards it: torch.chunk's
    pieces of ceil(rows / world), so the last ranks hold what remains (possibly nothing) and a planner's even share
    rows / world is no rank's."""
    if rows < 0 or world < 1 or not 0 <= rank < world:
        raise ValueError(f"dim0_shard_rows: rows {rows} >= 0, world {world} >= 1 and rank {rank} in 0..{world - 1}")
    per = -(-rows // world)
    return max(0, min(per, rows - rank * per))


def fewest_devices(num_params, stage, device_bytes, *, largest=2**13, **kwargs) -> int | None:
    """The smallest power-of-2 number of devices whose per-device model states fit in device_bytes (None: none up
    to `largest` does; stages 1 and 2 never shrink below their replicated part)."""
    n = 1
    while n <= largest:
        if model_states(num_params, n, stage, **kwargs)["total"] <= device_bytes:
            return n
        n *= 2
    return None


def measured_states(metrics_by_world: dict, stages: dict = STAGES, *, optimizer="adamw", precision="fp32") -> list:
    """One row per (world size, mode) that ran: the bytes of each part, the largest over the ranks (what decides
    whether a job fits), beside model_states' formula for the mode's stage. metrics_by_world: {N: {rank: records}}
    where a record with "mode" carries "num_params", "params", "grads", "optimizer" and, on rank 0,
    "max_diff_vs_ddp" and "impl" (which file ran an exercise's mode)."""
    rows = []
    for world, metrics in metrics_by_world.items():
        records = {r: {rec["mode"]: rec for rec in recs if "mode" in rec} for r, recs in metrics.items()}
        for mode, stage in stages.items():
            per_rank = [records[r][mode] for r in sorted(records) if mode in records[r]]
            if not per_rank:
                continue
            numel = per_rank[0]["num_params"]
            measured = {k: max(rec[k] for rec in per_rank) for k in STATE_KEYS}
            rows.append({"N": world, "mode": mode, "numel": numel, "measured": measured,
                         "total": sum(measured.values()),
                         "model": model_states(numel, world, stage, optimizer=optimizer, precision=precision),
                         "diff": per_rank[0].get("max_diff_vs_ddp"), "impl": per_rank[0].get("impl")})
    return rows


def share_of_ddp(rows: list) -> dict:
    """{(N, mode): {part key: the mode's bytes / DDP's at the same N}} for the modes run beside DDP."""
    ddp = {row["N"]: row["measured"] for row in rows if row["mode"] == "ddp"}
    return {(row["N"], row["mode"]): {k: row["measured"][k] / ddp[row["N"]][k] for k in STATE_KEYS}
            for row in rows if row["N"] in ddp}


def sharding_faults(rows: list) -> list[str]:
    """What a mode holds that its stage should not, as sentences (empty: all as ZeRO says). DDP: 16 bytes per
    parameter plus AdamW's step counters (one 4-byte scalar per tensor: under 0.1 %); torch's ZeRO-1: parameters
    and gradients whole, optimizer states shared out; FSDP2: every part at least a 1/N shard and less than whole."""
    faults = []
    share = share_of_ddp(rows)
    for row in rows:
        n, mode = row["N"], row["mode"]
        if mode == "ddp" and not 0 < row["total"] - 16 * row["numel"] < 0.001 * row["total"]:
            faults.append(f"N={n} DDP held {row['total']:,} bytes, not 16 per parameter "
                          f"({16 * row['numel']:,}) + step counters")
        s = share.get((n, mode))
        if s is None or n == 1:
            continue
        if mode == "zero1" and not s["params"] == s["grads"] == 1 > s["optimizer"]:
            faults.append(f"N={n} ZeRO-1 should keep parameters and gradients whole, optimizer states shared: {s}")
        if mode == "fsdp2" and not all(1 / n <= v < 1 for v in s.values()):
            faults.append(f"N={n} FSDP2 should hold a 1/N shard (or a little more) of every part: {s}")
    return faults


def hsdp_states(records: dict, shapes: dict, stages: dict) -> list:
    """Rows of bytes per rank (largest over the ranks) for DDP, FSDP and HSDP against model_states, and how far
    each ended from one process. records: {(variant, rank): the run's record}; shapes: {variant: (replicate,
    shard)}; stages: {variant: ZeRO stage}. DDP's formula is over all N ranks, the sharded ones over their shard
    group."""
    world = len({rank for _, rank in records})
    rows = []
    for variant, (r, s) in shapes.items():
        recs = [records[variant, rank] for rank in range(world)]
        numel = recs[0]["num_params"]
        model = model_states(numel, world if stages[variant] == 0 else s, stages[variant], optimizer="adamw",
                             precision="fp32")
        rows.append({"variant": variant, "mesh": f"{r}x{s}", "numel": numel,
                     "measured": {k: max(rec[k] for rec in recs) for k in STATE_KEYS},
                     "model": {k: model[part] for k, part in STATE_KEYS.items()},
                     "loss diff": max(abs(a - b) for rec in recs for a, b in zip(rec["losses"], rec["ref_losses"])),
                     "param diff": max(rec["max_param_diff"] for rec in recs)})
    return rows


def collectives_by_group(calls: list) -> tuple[dict, dict]:
    """({(op, group): bytes handed to the collective}, {(op, group): the group's global ranks}) of one rank's
    recorded calls [{"op", "group", "ranks", "bytes"}]."""
    counted, ranks = defaultdict(int), {}
    for call in calls:
        counted[call["op"], call["group"]] += call["bytes"]
        ranks[call["op"], call["group"]] = call["ranks"]
    return dict(counted), ranks


def hsdp_comm(records: dict, shapes: dict, param_bytes: int) -> tuple[dict, list[str]]:
    """Rank 0's collectives of one step per variant, each with costs.sharded_dp_comm_bytes' numbers ("calls_bytes",
    "sent", "group") and what was counted ("counted", "ranks_list"); and, as sentences, every rank whose counts
    differ from the formula (empty: all equal)."""
    world = len({rank for _, rank in records})
    comm, faults = {}, []
    for variant, (r, s) in shapes.items():
        formula = costs.sharded_dp_comm_bytes(param_bytes, r, s)
        want = {(op, f["group"]): f["calls_bytes"] for op, f in formula.items()}
        for rank in range(world):
            counted, ranks = collectives_by_group(records[variant, rank]["calls"])
            if counted != want:
                faults.append(f"{variant} rank {rank}: counted {counted}, formula {want}")
            if rank == 0:
                comm[variant] = {op: {**f, "ranks_list": ranks.get((op, f["group"])),
                                      "counted": counted.get((op, f["group"]), 0)} for op, f in formula.items()}
    return comm, faults


def cross_node_sent(comm: dict, ranks_per_node: int) -> dict:
    """{variant: bytes a rank sends per step in collectives whose group spans more than one node}, ranks placed
    `ranks_per_node` to a node in order (torchrun's numbering)."""
    return {v: sum(f["sent"] for f in c.values()
                   if len({rank // ranks_per_node for rank in f["ranks_list"] or ()}) > 1) for v, c in comm.items()}


def all_gather_ms(analysis) -> list[tuple[float, float]]:
    """(all-gather time, exposed all-gather time) per profiled step, ms, every rank's steps, from a trace analysis
    (traces.analyze_run): gloo's "gloo:all_gather" on a CPU, every NCCL all-gather kernel on a GPU."""
    if analysis.kind == "cpu-gloo":
        names = {"gloo:all_gather"}
    else:  # NCCL kernels: one name per algorithm
        names = {n for ra in analysis.ranks.values() for n in ra.comm_by_name if "allgather" in n.lower()}
    rows = []
    for ra in analysis.ranks.values():
        per_name = [ra.collective(n) for n in names]
        rows += [(sum(t for t, _ in step) / 1e3, sum(e for _, e in step) / 1e3) for step in zip(*per_name)]
    return rows
