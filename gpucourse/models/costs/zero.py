"""ZeRO, FSDP and HSDP (chapter 07): model-state bytes per GPU under each ZeRO stage, the bytes ZeRO communicates,
and what each collective of a fully_shard step carries on a (replicate x shard) mesh."""
from ._checks import check_nonneg, require
from .comms import bytes_moved_per_rank


# --- ZeRO memory and communication (chapter 07) -------------------------------------------------------------

def _check_stage(stage):
    require(stage in (0, 1, 2, 3), f"stage must be 0, 1, 2 or 3, got {stage!r}")


def zero_memory_bytes(num_params, dp_degree, stage, *, param_bytes=2, grad_bytes=2,
                      optimizer_bytes=12, offload=False):
    """Model-state bytes per GPU under ZeRO (Rajbhandari et al., 2019).

    Mixed-precision Adam keeps fp16 params (2), fp16 grads (2) and fp32
    master params + momentum + variance (12): 16 bytes/param. Each stage
    shards one more of these over the dp_degree ranks:
      stage 0 (plain DP) 16Ψ; 1: 4Ψ + 12Ψ/N; 2: 2Ψ + 14Ψ/N; 3: 16Ψ/N.
    offload=True (ZeRO-Offload, stage >= 1): optimizer states live in CPU
    memory, and from stage 2 the gradient shards too; only GPU bytes are
    returned. Activations and buffers are not counted.
    """
    check_nonneg(num_params, "num_params")
    require(dp_degree >= 1, f"dp_degree must be >= 1, got {dp_degree}")
    _check_stage(stage)
    require(stage >= 1 or not offload, "offload=True needs stage >= 1 (ZeRO-Offload shards the optimizer)")
    P, G, O = param_bytes, grad_bytes, optimizer_bytes
    if offload:
        O = 0
        G = 0 if stage >= 2 else G
    sharded = {0: 0, 1: O, 2: G + O, 3: P + G + O}[stage]
    replicated = P + G + O - sharded
    return num_params * (replicated + sharded / dp_degree)


def zero_comm_volume(num_params, stage, bytes_per_elem=2):
    """Bytes each rank communicates per step, following the ZeRO paper.

    DP and stages 1-2 do a reduce-scatter + all-gather (= one all-reduce):
    2Ψ elements (the paper rounds 2(N-1)/N to 2). Stage 3 must all-gather
    parameters again for the backward pass: 3Ψ, i.e. 1.5x data parallel.
    """
    check_nonneg(num_params, "num_params")
    _check_stage(stage)
    return (3 if stage == 3 else 2) * num_params * bytes_per_elem


# --- FSDP, HSDP and DDP as one family: what each collective carries per step (chapter 07; DiLoCo 08d) --------

def sharded_dp_comm_bytes(param_bytes, replicate, shard, *, grad_bytes=None, reshard_after_forward=True):
    """The collectives of one training step under fully_shard on a (replicate x shard) mesh, per rank.

    Ranks form a replicate x shard grid: parameters, gradients and optimizer states are sharded over the `shard`
    ranks of a group and replicated over the `replicate` groups. shard = N is FSDP (ZeRO-3), replicate = N with
    shard = 1 is DDP, both > 1 is HSDP (hybrid sharding). Per step, with the whole model in one or many groups:
      all_gather      over the shard group, payload = the gathered parameters (param_bytes): in forward, and
                      again in backward when the forward freed them (reshard_after_forward=True, the default);
      reduce_scatter  over the shard group, payload = the full gradients (grad_bytes, default param_bytes);
      all_reduce      over the replicate group, payload = the reduce-scatter's output, grad_bytes / shard.
    Collectives over a group of one rank are not run and are left out. Returns {collective: {"group": "shard"
    or "replicate", "ranks": the group's size, "calls_bytes": the payload summed over the step, "sent": bytes
    this rank sends in a bandwidth-optimal algorithm (bytes_moved_per_rank)}}. Padding (FSDP pads each
    parameter's first dimension to a multiple of `shard`) is not modelled: sizes that divide evenly have none.
    """
    check_nonneg(param_bytes, "param_bytes")
    for value, name in ((replicate, "replicate"), (shard, "shard")):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{name} must be a whole number >= 1 (ranks along that mesh dimension), got {value!r}")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    check_nonneg(grad_bytes, "grad_bytes")
    out = {}
    if shard > 1:
        gathered = (2 if reshard_after_forward else 1) * param_bytes
        out["all_gather"] = {"group": "shard", "ranks": shard, "calls_bytes": gathered,
                             "sent": bytes_moved_per_rank("all_gather", gathered, shard)}
        out["reduce_scatter"] = {"group": "shard", "ranks": shard, "calls_bytes": grad_bytes,
                                 "sent": bytes_moved_per_rank("reduce_scatter", grad_bytes, shard)}
    if replicate > 1:
        out["all_reduce"] = {"group": "replicate", "ranks": replicate, "calls_bytes": grad_bytes / shard,
                             "sent": bytes_moved_per_rank("all_reduce", grad_bytes / shard, replicate)}
    return out


def diloco_bytes(param_bytes, steps, sync_every=1):
    """Bytes each replica hands to all-reduces over `steps` training steps when replicas sync every `sync_every`
    steps: data parallelism all-reduces a gradient the size of the parameters every step (sync_every=1); DiLoCo
    (Douillard et al. 2023, arXiv 2311.08105) all-reduces the pseudo-gradient, also the parameters' size, once every
    H = sync_every inner steps: param_bytes * (steps // sync_every), H times fewer (chapter 08d's run counts it).
    On the wire a ring all-reduce of it moves 2(n-1)/n of that a rank (bytes_moved_per_rank)."""
    check_nonneg(param_bytes, "param_bytes")
    for value, name in ((steps, "steps"), (sync_every, "sync_every")):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name} must be a whole number >= 1, got {value!r}")
    return param_bytes * (steps // sync_every)
