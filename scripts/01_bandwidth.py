"""Chapter 01: time collectives over message sizes; log time, algbw and busbw as nccl-tests defines them.

For each op and size: a few warm-up calls, then `--repeats` timed calls, each started right after a
barrier so that all ranks start together. A rank's time is the median of its calls; the time logged
is the average of the ranks' medians (nccl-tests reports the average over ranks too).
Sizes follow nccl-tests: all_gather's size is its output (all shards), reduce_scatter's its input.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from gpucourse import costs, runtime

parser = argparse.ArgumentParser()
parser.add_argument("--sizes", type=int, nargs="+", default=[2**p for p in range(3, 25)], help="bytes")
parser.add_argument("--ops", nargs="+", default=["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
parser.add_argument("--repeats", type=int, default=20)
parser.add_argument("--warmup", type=int, default=5)
args = parser.parse_args()

ctx = runtime.setup()
world, device = ctx.world_size, ctx.device
ELEMENT = 4  # bytes per float32


def numel_for(op, size):
    """float32 elements for `size` bytes; all_gather/reduce_scatter need a total that splits into world shards."""
    numel = max(1, size // ELEMENT)
    return max(world, numel // world * world) if op in ("all_gather", "reduce_scatter") else numel


def make_call(op, numel):
    """A zero-argument function that runs `op` once on float32 buffers of `numel` elements (in all)."""
    full = torch.zeros(numel, device=device)  # zeros: repeated sums stay finite
    shard = torch.zeros(numel // world, device=device)
    return {"all_reduce": lambda: dist.all_reduce(full),
            "broadcast": lambda: dist.broadcast(full, src=0),
            "all_gather": lambda: runtime.all_gather_single(full, shard),  # dist's, whatever torch names it
            "reduce_scatter": lambda: runtime.reduce_scatter_single(shard, full)}[op]


def timed(call):
    """Seconds for one call on this rank, all ranks starting together."""
    dist.barrier()
    if device.type == "cuda":  # GPU work is asynchronous: time it with events on the stream
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def mean_over_ranks(seconds):
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world


# Sizes that round to the same buffer are measured once.
plan = list(dict.fromkeys((op, numel_for(op, size)) for op in args.ops for size in args.sizes))
unsupported = set()
for i, (op, numel) in enumerate(plan):
    if op in unsupported:
        continue
    call, nbytes = make_call(op, numel), numel * ELEMENT
    try:
        call()  # can this backend run `op` on these tensors at all? (gloo with GPU tensors lacks some)
    except Exception as err:  # noqa: BLE001 - every rank gets the same error: log it and go on
        unsupported.add(op)
        runtime.log(step=i, total=len(plan), op=op, error=str(err).splitlines()[0][:200])
        continue
    for _ in range(args.warmup):
        call()
    times = [timed(call) for _ in range(args.repeats)]
    mine = statistics.median(times)
    seconds = mean_over_ranks(mine)
    bus = costs.busbw(op, nbytes, seconds, world)
    runtime.log(step=i, total=len(plan), op=op, bytes=nbytes, time_s=seconds, rank_time_s=mine,
                fastest_s=min(times), slowest_s=max(times), algbw=costs.algbw(nbytes, seconds), busbw=bus)
    if ctx.rank == 0:
        print(f"{op:>15} {nbytes:>10} B {seconds * 1e6:10.1f} us   busbw {bus / 1e9:7.3f} GB/s", flush=True)
runtime.teardown()
