"""The reference ring all-reduce (solutions/ex01_ring_allreduce.py) against gloo's own dist.all_reduce.

    python benchmarks/ring_allreduce_vs_gloo.py [--nproc 4] [--mib 16] [--repeats 10]

Launches itself through gpucourse.launch (one real torchrun job). Every rank alternates the two
implementations on the same float32 buffer, swapping which goes first each repeat so that neither
always runs on a warmer machine, and logs its times. Per repeat the slowest rank sets the time;
the busbw of each (nccl-tests definition, gpucourse.models.costs.busbw) and the ratio ours/gloo are
printed from the median repeat (goal: ratio >= 0.8) and from the best one.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex01_ring_allreduce.py"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--mib", type=float, default=16.0, help="buffer size in MiB (float32)")
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def worker(args) -> None:
    import importlib.util

    import torch
    import torch.distributed as dist

    from gpucourse import runtime

    spec = importlib.util.spec_from_file_location("ring_solution", SOLUTION)
    ring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ring)
    ctx = runtime.setup(seed=0)
    data = torch.randn(int(args.mib * 2**20) // 4)
    ours, gloo = data.clone(), data.clone()
    ring.ring_all_reduce(ours)  # also the warm-up of both
    dist.all_reduce(gloo)
    torch.testing.assert_close(ours, gloo, rtol=1e-5, atol=1e-4 * ctx.world_size)
    impls = {"ours": ring.ring_all_reduce, "gloo": dist.all_reduce}
    for repeat in range(args.repeats):
        order = ["ours", "gloo"] if repeat % 2 == 0 else ["gloo", "ours"]
        times = {}
        for name in order:
            buf = data.clone()
            dist.barrier()
            start = time.perf_counter()
            impls[name](buf)
            times[name] = time.perf_counter() - start
        runtime.log(step=repeat, total=args.repeats, ours_s=times["ours"], gloo_s=times["gloo"])
    runtime.teardown()


def main(args) -> None:
    import gpucourse
    from gpucourse import costs

    res = gpucourse.launch(__file__, nproc=args.nproc, name="bench-ring-vs-gloo", timeout=600, live=False,
                           args=["--mib", str(args.mib), "--repeats", str(args.repeats)])  # (torchrun reads --nproc*)
    nbytes, n = int(args.mib * 2**20) // 4 * 4, args.nproc

    def slowest_rank(key):
        return [max(ts) for ts in zip(*(res.metric(key, rank=r) for r in range(n)))]

    ours, gloo = slowest_rank("ours_s"), slowest_rank("gloo_s")
    print(f"all_reduce of {args.mib:g} MiB float32 on {n} gloo ranks (CPU), {args.repeats} alternating repeats")
    print(f"{'':18}{'median busbw':>14}{'best busbw':>14}")
    rows = {}
    for name, times in (("ring (ours)", ours), ("gloo all_reduce", gloo)):
        med = costs.busbw("all_reduce", nbytes, statistics.median(times), n)
        best = costs.busbw("all_reduce", nbytes, min(times), n)
        rows[name] = (med, best)
        print(f"{name:18}{med / 1e9:>10.3f} GB/s{best / 1e9:>9.3f} GB/s")
    ratio_med = rows["ring (ours)"][0] / rows["gloo all_reduce"][0]
    ratio_best = rows["ring (ours)"][1] / rows["gloo all_reduce"][1]
    verdict = "meets" if ratio_med >= 0.8 else "misses"
    print(f"ratio ours/gloo: {ratio_med:.2f} (median), {ratio_best:.2f} (best): {verdict} the 0.8 goal")
    print(f"run: {res.run_dir}")


if __name__ == "__main__":
    if "RANK" in os.environ:  # a rank of the job main() launched
        worker(parse_args())
    else:
        sys.exit(main(parse_args()))
