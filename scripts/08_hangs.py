"""Four classic ways to break a collective, one per --mode, for the chapter's debugging section.

  mismatch   rank 0 calls all_reduce, the others broadcast: different operations
  skip       at step 2, rank 1 skips the all_reduce every other rank calls ("if nothing to sync: continue")
  shape      rank 0 all-reduces 4 numbers, the others 8: same operation, different sizes
  straggler  rank 1 never arrives at the barrier (stuck in its own code); --monitored uses
             dist.monitored_barrier, which names the rank that did not arrive

Every rank prints what it is about to do before each collective, so the last line of each rank's log
says where it stopped. Run with TORCH_DISTRIBUTED_DEBUG=DETAIL to have torch check every collective's
operation and shapes across ranks before running it.
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["mismatch", "skip", "shape", "straggler"], required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--monitored", action="store_true", help="straggler: use dist.monitored_barrier")
parser.add_argument("--collective-timeout", type=float, default=None, help="seconds (runtime.setup(timeout_s=))")
args = parser.parse_args()

ctx = runtime.setup(timeout_s=args.collective_timeout)
rank = ctx.rank


def say(text: str) -> None:
    print(f"rank {rank}: {text}", flush=True)


for step in range(args.steps):
    t = torch.full((4,), float(step + 1))
    if args.mode == "mismatch" and step == 1:
        op = "all_reduce" if rank == 0 else "broadcast"
        say(f"step {step}: {op}")
        dist.all_reduce(t) if rank == 0 else dist.broadcast(t, src=0)
    elif args.mode == "skip" and step == 2 and rank == 1:
        say(f"step {step}: skipping the all_reduce")
        continue
    elif args.mode == "shape" and step == 1:
        t = torch.ones(4 if rank == 0 else 8)
        say(f"step {step}: all_reduce of {t.numel()} numbers")
        dist.all_reduce(t)
    elif args.mode == "straggler" and step == 1:
        if rank == 1:
            say(f"step {step}: busy in my own code (no collective)")
            time.sleep(3600)  # a deadlock, an endless loop, a dead disk: the rank never comes back
        say(f"step {step}: {'monitored_barrier' if args.monitored else 'barrier'}")
        if args.monitored:
            dist.monitored_barrier(timeout=timedelta(seconds=5))  # rank 0 checks in every rank, one by one
        else:
            dist.barrier()
    else:
        say(f"step {step}: all_reduce")
        dist.all_reduce(t)
        # Every rank put step + 1 in: the sum is world_size * (step + 1) on every rank, unless desynchronised.
        say(f"step {step}: got {t[0].item():g} (expected {ctx.world_size * (step + 1)})")
    runtime.log(step=step, total=args.steps)
say("done")
runtime.teardown()
