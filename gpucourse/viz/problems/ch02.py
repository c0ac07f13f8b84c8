"""Chapter 02's problems: what DistributedSampler gives each rank and the steps an epoch takes (training), the bytes
gradient accumulation and compression hooks save (costs.comms), and an audit of DDP's default buckets."""
from __future__ import annotations

from ...models import costs, training
from .base import Problem

NDR = "InfiniBand NDR 400G"
MiB = 2 ** 20
# chapter 02's no_sync model: Linear(512, 2048) and Linear(2048, 512) with biases, fp32 gradients
NO_SYNC_KIB = (512 * 2048 + 2048 + 2048 * 512 + 512) * 4 / 1024  # KiB, as the table shows them
DDP_DOCS = ("PyTorch documentation of torch.nn.parallel.DistributedDataParallel (bucket_cap_mb: 25 MiB unless set, "
            "https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html)")


def _padding(items, world_size):
    shard = training.sampler_shard(items, world_size)
    return {"answer": shard["padded"], "per_rank": shard["per_rank"], "total": shard["per_rank"] * world_size,
            "dropped": training.sampler_shard(items, world_size, drop_last=True)["dropped"]}


def _steps(items, batch_size, world_size):
    shard = training.sampler_shard(items, world_size)
    return {"answer": training.steps_per_epoch(items, batch_size, world_size), "per_rank": shard["per_rank"],
            "global_batch": batch_size * world_size, "as_global": training.steps_per_epoch(items, batch_size, 1)}


def _accumulation_bytes(grad_gb, n, k):
    size = grad_gb * 1e9
    once = costs.bytes_moved_per_rank("all_reduce", size, n)
    return {"answer": k * once, "once_GB": once / 1e9, "factor": costs.busbw_factor("all_reduce", n),
            "no_sync": once, "buffer_k": k * size}


def _no_sync_saves(grad_gb, n, k, link):
    ic = costs.INTERCONNECTS[link]
    one = costs.collective_time("all_reduce", grad_gb * 1e9, n, ic.alpha, ic.beta)
    return {"answer": (k - 1) * one, "one": one, "saved": k - 1, "bw_GBs": ic.bandwidth_bytes_per_s / 1e9,
            "no_ring": (k - 1) * grad_gb * 1e9 * ic.beta, "all_k": k * one}


def _hook_bytes(params_m, n):
    params = params_m * 1e6
    fp16 = costs.bytes_moved_per_rank("all_reduce", params * 2, n)
    return {"answer": fp16, "fp32": costs.bytes_moved_per_rank("all_reduce", params * 4, n),
            "bucket_MB": params * 2 / 1e6, "factor": costs.busbw_factor("all_reduce", n)}


def _your_accumulation(kib_per_step, accum, n):
    once = costs.bytes_moved_per_rank("all_reduce", kib_per_step * 1024, n)
    return {"answer": accum * once, "once_MiB": once / MiB, "factor": costs.busbw_factor("all_reduce", n),
            "buffer_k": accum * kib_per_step * 1024, "no_sync": once}


def _buckets(params_b, bucket_mib):
    grad_bytes = params_b * 1e9 * 4
    step = costs.ddp_step_time(1.0, grad_bytes, 2, 0.0, 0.0, bucket_bytes=bucket_mib * MiB)
    return {"answer": step.num_buckets, "grad_GB": grad_bytes / 1e9, "bucket_MB": bucket_mib * MiB / 1e6,
            "decimal": costs.ddp_step_time(1.0, grad_bytes, 2, 0.0, 0.0, bucket_bytes=bucket_mib * 1e6).num_buckets}


PROBLEMS = [
    Problem(
        "02.sampler-padding",
        "A dataset of {items:,} samples, {world_size} DDP ranks, DistributedSampler with drop_last=False. How many "
        "samples are read twice in each epoch?",
        inputs={"items": 50_000, "world_size": 64}, work=_padding, unit="samples", digits=0, tolerance=0,
        hint="every rank must read as many samples, ceil(items / N) each: the sampler repeats indices from the start "
             "of the permutation until N x that many are listed.",
        traps={"dropped": "That is what drop_last=True leaves out (items mod N); without it the sampler pads up "
                          "to the next multiple of N instead."},
        solution="per rank: ceil({items:,} / {world_size}) = {per_rank:,}; {world_size} x {per_rank:,} = {total:,} "
                 "indices for {items:,} samples: {answer} repeated."),
    Problem(
        "02.steps-per-epoch",
        "DDP on {world_size} ranks, each with DataLoader(batch_size={batch_size}) over a DistributedSampler, "
        "{items:,} training samples. How many optimizer steps does one epoch take?",
        inputs={"items": 1_000_000, "batch_size": 32, "world_size": 8}, work=_steps, unit="steps", digits=0,
        tolerance=0,
        hint="under DDP batch_size is per rank: each rank reads its shard of ceil(items / N) samples in batches of "
             "batch_size, so a step consumes batch_size x N samples.",
        traps={"as_global": "That read batch_size as the global batch (DataParallel's meaning): under DDP each of "
                            "the ranks takes a batch of that size every step."},
        solution="each rank's shard: {per_rank:,} samples; / {batch_size} a batch, the last one kept: {answer} "
                 "(global batch {global_batch})."),
    Problem(
        "02.accumulation-bytes",
        "A model with {grad_gb} GB of gradients accumulates {k} micro-batches a step on {n} GPUs, and every "
        "backward all-reduces them (no no_sync). How many GB does each rank send per step (ring all-reduce)?",
        inputs={"grad_gb": 1.0, "n": 8, "k": 8}, work=_accumulation_bytes, unit="GB", scale=1e9, digits=2,
        hint="each backward outside no_sync all-reduces every bucket, and a ring all-reduce sends 2(n-1)/n of the "
             "buffer per rank: k times that.",
        traps={"no_sync": "That is one all-reduce: what no_sync sends, not a backward that synchronises every time.",
               "buffer_k": "That counted the buffer k times, without the ring's 2(n-1)/n."},
        solution="one all-reduce: {factor:.3f} x {grad_gb} GB = {once_GB:.2f} GB a rank; {k} of them: {answer} "
                 "(no_sync: {once_GB:.2f} GB)."),
    Problem(
        "02.no-sync-saves",
        "The same {grad_gb} GB of gradients, {k} micro-batches a step, {n} GPUs over {link}, all-reduced as one "
        "buffer. By the alpha-beta model, how much time per step does no_sync save?",
        inputs={"grad_gb": 1.0, "n": 8, "k": 8, "link": NDR}, work=_no_sync_saves, unit="s", digits=3,
        level="combine", source=costs.INTERCONNECTS[NDR].source,
        hint="no_sync skips all the all-reduces but the last: k - 1 of them, each 2(n-1) latencies plus 2(n-1)/n "
             "of the buffer at the link's rate.",
        traps={"all_k": "That is all k all-reduces: no_sync keeps the last one.",
               "no_ring": "That sent the buffer once per all-reduce: a ring sends 2(n-1)/n of it."},
        solution="one ring all-reduce of {grad_gb} GB at {bw_GBs:.0f} GB/s: {one:.4f} s; {saved} of them saved: "
                 "{answer}."),
    Problem(
        "02.compress-hook-bytes",
        "A {params_m:,} M-parameter model trains in fp32 with DDP on {n} GPUs, with fp16_compress_hook. How many MB "
        "does each rank send in one step's all-reduces?",
        inputs={"params_m": 350, "n": 16}, work=_hook_bytes, unit="MB", scale=1e6, digits=0,
        hint="the hook casts each fp32 bucket to fp16 before the all-reduce: 2 bytes a parameter on the wire, then "
             "the ring's 2(n-1)/n.",
        traps={"fp32": "That sent fp32 gradients, 4 bytes each: what autocast alone sends. The hook halves it."},
        solution="{params_m} M x 2 bytes = {bucket_MB:.0f} MB of fp16 buckets; x {factor:.4f} = {answer} a rank."),
    Problem(
        "02.your-accumulation",
        "Your chapter 02 run: the no_sync row of the accumulation table all-reduced {kib_per_step:,} KiB a step. "
        "With the same model on {n} GPUs, {accum} micro-batches a step and no no_sync, how many MiB would each rank "
        "send per step?",
        inputs={"kib_per_step": NO_SYNC_KIB, "accum": 4, "n": 8}, own=("kib_per_step", "accum"),
        work=_your_accumulation, unit="MiB", scale=MiB, digits=1, level="your run",
        hint="the table's KiB are the buffer (the gradients, once); each of the accum backwards all-reduces it, and "
             "on n ranks a ring sends 2(n-1)/n of it (on 2 ranks that factor is 1, which is why the table's bytes "
             "looked like the buffer).",
        traps={"buffer_k": "That is accum times the buffer, without the ring's 2(n-1)/n on 8 ranks.",
               "no_sync": "That is one all-reduce: what no_sync sends."},
        solution="one all-reduce of {kib_per_step:,} KiB on {n} ranks: x {factor:.3f} = {once_MiB:.2f} MiB a rank; "
                 "x {accum} micro-batches = {answer}."),
    Problem(
        "02.audit-ddp-buckets",
        "Audit: DDP's documentation gives bucket_cap_mb a default of 25 (MiB). A {params_b} B-parameter model "
        "trains in fp32: how many gradient buckets, each one all-reduce, does DDP fill per step (the small first "
        "bucket left aside)?",
        inputs={"params_b": 1.5, "bucket_mib": 25}, work=_buckets, unit="buckets", digits=0, tolerance=0,
        level="audit", source=DDP_DOCS,
        hint="fp32 gradients are 4 bytes a parameter, and 25 MiB is 25 x 2^20 bytes: the buckets are the gradient "
             "bytes over that, rounded up (the last one smaller).",
        traps={"decimal": "That took 25 MB as 25 x 10^6 bytes: DDP's cap is in MiB."},
        solution="{params_b} B x 4 bytes = {grad_GB:.1f} GB of gradients; / {bucket_MB:.3f} MB a bucket, rounded "
                 "up: {answer}."),
]
