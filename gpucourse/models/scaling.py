"""DDP weak scaling, modelled: the numbers chapter 03's simulator draws and its table reads.

    from gpucourse.models.scaling import simulate, turning_point
    rows = simulate(25.6e6, 0.08, [1, 8, 64, 512], alpha=7e-6, beta=1 / 25e9)
    turning_point(rows)        # the first world size from which every larger one is communication-bound

Each GPU keeps its batch, so its compute per step stays the same; one step is the one model of a DDP step,
`costs.ddp_step_time`: compute + the all-reduce time that the backward pass does not hide (ring all-reduce in
buckets, α–β per message). It is a model: no stragglers, no data loading, one flat ring (NCCL switches to trees
and hierarchical rings at scale, so at thousands of GPUs the ring's 2(N−1)·α latency term overstates real latency).
"""
from __future__ import annotations

import math
import numbers

from . import costs


def simulate(params_count, compute_s, world_sizes, alpha, beta, bucket_bytes=25 * 2**20, overlap=True, *,
             bytes_per_param=4, batch_per_gpu=1, backward_fraction=costs.BACKWARD_FRACTION,
             overlap_cost=0.0) -> list[dict]:
    """Modelled DDP step at each world size N (weak scaling: the per-GPU batch and compute stay fixed).

    The model is costs.ddp_step_time, one call per N; this only turns parameters into gradient bytes and adds
    what the plots need. Per N: comm_s = all-reduce time of all gradient buckets (ring, α–β), exposed_s = the
    part backward does not hide (with overlap: the last bucket, or all comm beyond backward_fraction ×
    compute_s; without: all of it), penalty_s = overlap_cost × the hidden part (what running the all-reduces
    beside compute costs compute; 0 by default: free overlap), step_s = compute_s + exposed_s + penalty_s,
    throughput = N·batch_per_gpu / step_s (samples/s), efficiency = throughput / (N × throughput at N=1) =
    compute_s / step_s, and comm_bound = exposed_s + penalty_s > compute_s: more than half of every step is
    spent on communication (efficiency below 50 %), so adding GPUs buys less than half a GPU each.
    """
    check_positive(params_count, "params_count", "the number of parameters, e.g. 25.6e6")
    check_positive(compute_s, "compute_s", "seconds of forward + backward per step on one GPU")
    check_positive(bucket_bytes, "bucket_bytes", "DDP's bucket_cap_mb × 2**20")
    check_positive(bytes_per_param, "bytes_per_param", "4 for fp32 gradients, 2 for bf16/fp16")
    check_positive(batch_per_gpu, "batch_per_gpu", "samples per GPU per step")
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0 (got {alpha}, {beta}): seconds per message and per byte")
    sizes = list(world_sizes)
    if not sizes or not all(isinstance(n, numbers.Integral) and n >= 1 for n in sizes):
        raise ValueError(f"world_sizes must be whole numbers >= 1, e.g. [1, 2, 4, 8], got {world_sizes!r}")
    grad_bytes = round(params_count * bytes_per_param)
    rows = []
    for n in sizes:
        m = costs.ddp_step_time(compute_s, grad_bytes, n, alpha, beta, bucket_bytes=bucket_bytes, overlap=overlap,
                                backward_fraction=backward_fraction, overlap_cost=overlap_cost)
        rows.append({"world_size": n, "compute_s": compute_s, "backward_s": m.backward, "comm_s": m.comm,
                     "exposed_s": m.exposed, "penalty_s": m.overlap_penalty, "step_s": m.step,
                     "throughput": n * batch_per_gpu / m.step, "efficiency": m.efficiency,
                     "comm_bound": m.exposed + m.overlap_penalty > compute_s,
                     "buckets": m.num_buckets})
    return rows


def turning_point(rows) -> int | None:
    """The smallest world size from which every larger one is communication-bound (None if it never is)."""
    point = None
    for row in sorted(rows, key=lambda r: r["world_size"]):
        if row["comm_bound"]:
            point = row["world_size"] if point is None else point
        else:
            point = None
    return point


def check_positive(value, name, hint):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number ({hint}), got {value!r}")
