"""Browser test job for a cell that launches many short runs, as chapter 03's scaling loop does.

By default every rank works three steps and prints nothing (the runs that must collapse to a status line);
--profile adds the profiler, whose Kineto 'USDT: ... profiler_start/stop' lines must stay off the page;
--say prints a line per step; --fail-rank R makes rank R print a line and then raise (the traceback must
come after that line in its pane).
"""
import argparse
import contextlib

import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--say", action="store_true", help="each rank prints a line per step")
parser.add_argument("--profile", action="store_true", help="profile the steps with runtime.profile")
parser.add_argument("--fail-rank", type=int, default=-1, help="this rank prints a line, then raises ValueError")
args = parser.parse_args()

ctx = runtime.setup(seed=0)
steps = 3
profiler = runtime.profile(wait=0, warmup=1, active=2) if args.profile else contextlib.nullcontext()
with profiler as prof:
    for step in range(steps):
        value = torch.tensor([float(ctx.rank + step)])
        dist.all_reduce(value)
        if args.say:
            print(f"rank {ctx.rank} step {step} sum {value.item():g}", flush=True)
        runtime.log(step=step, total=steps, sum=value.item())
        if args.profile:
            prof.step()
if ctx.rank == args.fail_rank:
    print(f"rank {ctx.rank} printed this before failing", flush=True)
    raise ValueError(f"deliberate failure on rank {ctx.rank}")
runtime.teardown()
