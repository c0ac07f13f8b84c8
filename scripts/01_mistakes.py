"""Chapter 01: three classic mistakes with collectives. Each one fails or hangs, on purpose.

    --mistake order   rank 0 calls all_reduce then broadcast; the others broadcast then all_reduce
    --mistake skip    only rank 0 calls all_reduce ("only rank 0 logs the loss"); all then wait at a barrier
    --mistake shape   ranks all_reduce tensors of different lengths (an uneven last batch)

Every collective must be called by every rank of the group, in the same order, with tensors of the
same shape and dtype. Nothing checks that for you unless you ask (TORCH_DISTRIBUTED_DEBUG=DETAIL).
"""
import argparse
import os
import time

print(f"rank {os.environ.get('RANK', 0)}: starting", flush=True)  # before torch's import: shows the job is alive

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpucourse import runtime  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--mistake", choices=["order", "skip", "shape"], required=True)
args = parser.parse_args()

ctx = runtime.setup()
rank = ctx.rank
x = torch.ones(4, device=ctx.device)

start = time.perf_counter()
try:
    if args.mistake == "order":
        if rank == 0:
            print(f"rank {rank}: all_reduce, then broadcast", flush=True)
            dist.all_reduce(x)
            dist.broadcast(x, src=0)
        else:
            print(f"rank {rank}: broadcast, then all_reduce", flush=True)
            dist.broadcast(x, src=0)
            dist.all_reduce(x)
    elif args.mistake == "skip":
        if rank == 0:
            print(f"rank {rank}: in all_reduce (the others skipped it)", flush=True)
            dist.all_reduce(x)
        print(f"rank {rank}: at the barrier", flush=True)
        dist.barrier()
    elif args.mistake == "shape":
        batch = torch.ones(4 + rank, device=ctx.device)  # rank r has 4 + r elements
        print(f"rank {rank}: all_reduce of {batch.numel()} elements", flush=True)
        dist.all_reduce(batch)
finally:  # reached when a collective raises; a hang or an abort never gets here
    print(f"rank {rank}: out of the collectives after {time.perf_counter() - start:.3f} s", flush=True)

print(f"rank {rank}: done", flush=True)  # never printed: every branch above fails or hangs
runtime.teardown()
