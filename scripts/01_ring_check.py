"""Chapter 01: check a ring all-reduce (exercise ex01) against dist.all_reduce, then time it against gloo's.

    torchrun --nproc-per-node 4 scripts/01_ring_check.py exercises/ex01_ring_allreduce.py

Loads `ring_all_reduce` from the file given, runs it on a few lengths (some not a multiple of the
world size) and compares with dist.all_reduce. If every case matches, it times both on one buffer,
alternating them, and logs the median time and bus bandwidth of each.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from gpucourse import costs, exercises, runtime

parser = argparse.ArgumentParser()
parser.add_argument("impl", help="a .py file that defines ring_all_reduce(tensor)")
parser.add_argument("--lengths", type=int, nargs="+", default=[1, 3, 1000, 2**16 + 3])
parser.add_argument("--bytes", type=int, default=4 * 2**20, help="buffer size for the timing")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()

ctx = runtime.setup(seed=0)
ring_all_reduce = exercises.load_file(args.impl, "ring_impl").ring_all_reduce

all_ok = True
for length in args.lengths:
    x = torch.randint(-8, 9, (length,), device=ctx.device).float()  # small integers: sums are exact in any order
    expected = x.clone()
    dist.all_reduce(expected)
    out = ring_all_reduce(x)
    got = out if isinstance(out, torch.Tensor) and out.shape == x.shape else x  # judge what was returned
    wrong = int((got != expected).sum())
    ok = out is x and wrong == 0  # right values, in the caller's own tensor
    all_ok &= ok
    runtime.log(case=f"length {length}", length=length, ok=ok, in_place=out is x, wrong_elements=wrong)



def sync():
    if ctx.device.type == "cuda":  # GPU work is asynchronous: wait for it before reading the clock
        torch.cuda.synchronize()


if all_ok and ctx.world_size > 1:
    buf = torch.randn(args.bytes // 4, device=ctx.device)
    times = {"ring_all_reduce": [], "dist.all_reduce": []}
    for repeat in range(args.repeats + 1):  # round 0 warms both up
        for name, fn in (("ring_all_reduce", ring_all_reduce), ("dist.all_reduce", dist.all_reduce)):
            work = buf.clone()
            dist.barrier()
            sync()
            start = time.perf_counter()
            fn(work)
            sync()
            if repeat:
                times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        t = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(t)  # the average of the ranks' medians, as in 01_bandwidth.py
        seconds = t.item() / ctx.world_size
        runtime.log(timing=name, bytes=args.bytes, time_s=seconds,
                    busbw=costs.busbw("all_reduce", args.bytes, seconds, ctx.world_size))
runtime.teardown()
