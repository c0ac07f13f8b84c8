"""A `gpucourse dryrun` report's step on a named system (a device and its links), modelled: compute at the dense
peak, each counted collective on the link it crosses."""
from ._checks import require
from .comms import INTERCONNECTS, collective_time
from .flops import peak_flops


# --- a dry run's step on a named system, modelled (gpucourse dryrun) -----------------------------------------

# A system: the device (a PEAK_DENSE_TFLOPS name), GPUs per node, the link inside a node and between nodes.
SYSTEMS = {
    "h100-sxm": {"device": "NVIDIA H100 80GB HBM3", "node_size": 8, "inside": "NVLink 4 (H100 SXM)",
                 "between": "InfiniBand NDR 400G"},
    "a100-sxm": {"device": "NVIDIA A100-SXM4-80GB", "node_size": 8, "inside": "NVLink 3 (A100 SXM)",
                 "between": "InfiniBand HDR 200G"},
}
# The recorder's op names (dist's) -> this module's collectives; a name that starts with a key takes its value.
_DRYRUN_OPS = (("all_reduce", "all_reduce"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
               ("all_to_all", "all_to_all"), ("broadcast", "broadcast"), ("reduce", "reduce"),
               ("barrier", "all_reduce"), ("monitored_barrier", "all_reduce"), ("send", "send_recv"),
               ("isend", "send_recv"), ("recv", "send_recv"), ("irecv", "send_recv"),
               ("batch_isend_irecv", "send_recv"))


def dryrun_step_time(rank_report, *, system="h100-sxm", dtype="bf16"):
    """A step time and MFU for one rank of a `gpucourse dryrun` report, MODELLED, never measured.

    Compute: the rank's counted FLOPs at the device's dense `dtype` peak (a lower bound: real kernels reach a
    fraction of it). Communication: each counted call's ring α–β time (`collective_time`) on the system's link
    inside a node when every rank of its group sits in one node of `node_size` GPUs (ranks node_size*k ...), its
    link between nodes otherwise; a send or receive on the link between the rank and its peer(s), whatever group
    it was issued in; nothing overlapped with compute. Returns {"label": "modelled", "system",
    "device", "dtype", "compute_s", "comm_s", "latency_s" (the alpha part of comm_s), "step_s", "mfu", "assumes"};
    mfu = compute_s / step_s.
    """
    require(system in SYSTEMS, f"system must be one of {sorted(SYSTEMS)}, got {system!r}")
    spec = SYSTEMS[system]
    compute = rank_report["flops"] / peak_flops(spec["device"], dtype)
    comm = latency = 0.0
    for row in rank_report["comms"]:
        kind = next((k for prefix, k in _DRYRUN_OPS if row["op"].startswith(prefix)), None)
        n = row["group_size"]
        if kind is None or row["calls"] == 0 or n < 2 and kind != "send_recv":
            continue
        # a send or receive rides the link to its peer; a collective, the links its group spans
        members = [rank_report["rank"], *row["peers"]] if row.get("peers") else row["group"] or []
        nodes = {r // spec["node_size"] for r in members}
        link = INTERCONNECTS[spec["inside"] if len(nodes) <= 1 else spec["between"]]
        comm += row["calls"] * collective_time(kind, row["bytes"] / row["calls"], max(n, 2), link.alpha, link.beta)
        latency += row["calls"] * collective_time(kind, 0, max(n, 2), link.alpha, 0.0)
    step = compute + comm
    return {"label": "modelled", "system": system, "device": spec["device"], "dtype": dtype, "compute_s": compute,
            "comm_s": comm, "latency_s": latency, "step_s": step, "mfu": compute / step if step > 0 else None,
            "assumes": f"compute at the {dtype} dense peak; ring alpha-beta per call on nominal links "
                       f"({spec['inside']} inside a node of {spec['node_size']}, {spec['between']} between); "
                       "no overlap"}
