"""One configurable job for the launcher's tests: each flag is a way a real script behaves or misbehaves."""
import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--step-time", type=float, default=0.0)
parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises ValueError at step 1")
parser.add_argument("--exit-rank", type=int, default=-1, help="this rank calls sys.exit(3) at step 1")
parser.add_argument("--hang", action="store_true", help="after the steps, sleep forever (silently)")
parser.add_argument("--ignore-sigterm", action="store_true")
parser.add_argument("--grandchild", action="store_true", help="start a sleeping child process of our own")
parser.add_argument("--profile", action="store_true", help="profile the steps with runtime.profile")
parser.add_argument("--flood", type=int, default=0, help="print this many lines as fast as possible")
args = parser.parse_args()

if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
ctx = runtime.setup(seed=0)
if args.grandchild:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
for i in range(args.flood):
    print(f"flood line {i} from rank {ctx.rank} " + "x" * 60)
total = torch.zeros(1)
profiler = runtime.profile(wait=1, warmup=1, active=2) if args.profile else contextlib.nullcontext()
prof = profiler.__enter__()
for step in range(args.steps):
    if step == 1 and ctx.rank == args.fail_rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    if step == 1 and ctx.rank == args.exit_rank:
        sys.exit(3)
    value = torch.tensor([float(ctx.rank + step)])
    dist.all_reduce(value)
    total += value
    print(f"rank {ctx.rank} step {step} sum {value.item():g}", flush=True)
    runtime.log(step=step, total=args.steps, sum=value.item(), pid=os.getpid())
    time.sleep(args.step_time)
    if args.profile:
        prof.step()
profiler.__exit__(None, None, None)
if args.hang:
    time.sleep(3600)
runtime.teardown()
