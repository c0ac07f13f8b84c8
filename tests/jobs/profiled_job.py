"""A profiled job whose time split is known in advance, for the trace analysis tests.

Each step "computes" for a known time — time.sleep inside record_function("compute"), which the analysis counts
as compute (a CPU-bound loop would make the number depend on how busy the 2 shared cores are) — and all-reduces
a tensor of known size. Two profiled phases, one trace each (traces/<phase><rank>.json):

    sync      compute, then a blocking all_reduce: nothing overlaps, step ≈ compute + comm
    overlap   all_reduce(async_op=True), compute, then wait(): the collective runs during the compute

Every step logs how long the sleep really took (phase, step, sleep_ms), so tests compare against the measurement.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.profiler import record_function

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--compute-ms", type=float, default=30.0)
parser.add_argument("--numel", type=int, default=1 << 20, help="float32 elements all-reduced per step")
parser.add_argument("--active", type=int, default=3, help="profiled steps per phase (after 1 wait + 1 warmup)")
parser.add_argument("--phases", default="sync,overlap")
args = parser.parse_args()

ctx = runtime.setup(seed=0)
grads = torch.ones(args.numel)  # all-reduced (summed) every step: 2**steps stays finite
small = torch.ones(32, 32)


def compute(phase: str, step: int) -> None:
    with record_function("compute"):
        t0 = time.perf_counter()
        time.sleep(args.compute_ms / 1e3)
        slept_ms = (time.perf_counter() - t0) * 1e3
    runtime.log(phase=phase, step=step, sleep_ms=slept_ms)


for phase in args.phases.split(","):
    steps = 2 + args.active
    with runtime.profile(wait=1, warmup=1, active=args.active, name=phase) as prof:
        for step in range(steps):
            if phase == "sync":
                compute(phase, step)
                dist.all_reduce(grads)
            elif phase == "overlap":
                work = dist.all_reduce(grads, async_op=True)
                compute(phase, step)
                work.wait()
            else:
                raise ValueError(f"unknown phase {phase!r}: use sync or overlap")
            torch.mm(small, small)  # a real cpu_op too, microseconds long: compute stays ≈ the sleep
            prof.step()
runtime.teardown()
