"""The reference BucketedDDP (solutions/ex02_ddp.py) against torch's DistributedDataParallel: training throughput.

    python benchmarks/bucketed_ddp_vs_torch_ddp.py [--nproc 2] [--hidden 1024] [--layers 6] [--bucket-mb 5] [--impl F]

Launches itself through gpucourse.launch (one real torchrun job). Every rank holds two copies of one MLP,
from the same initial weights: one wrapped in torch's DDP (bucket_cap_mb), one in BucketedDDP
(bucket_size_mb, the same size). Each step trains both on the same batch, one after the other, swapping which
goes first every step so that neither always runs on a warmer machine, and logs the time of each (after a
barrier). Per step the slowest rank sets the time. Printed: samples/s of each from the median step, the
throughput ratio ours/torch (goal: >= 0.95) from the median steps and as the median of each step's own ratio
(the two ran back to back, so that one is least disturbed by a machine whose load drifts), each side's buckets,
then the largest parameter difference between the two copies at the end.

Both use torch's defaults otherwise (optimizer.zero_grad() sets .grad to None; torch's gradient_as_bucket_view
is off). The two bucket rules differ: torch closes a bucket once it has reached bucket_cap_mb, ours before it
would exceed bucket_size_mb. At the default 5 MiB torch sends 3 buckets of 8 MiB (two layers each), ours 6 of
about 4 MiB; `--bucket-mb 8.0078125` (two layers with their biases, exactly) gives both the same 3 buckets.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solutions" / "ex02_ddp.py"
GOAL = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024, help="width of every Linear layer")
    parser.add_argument("--layers", type=int, default=6, help="hidden x hidden Linear layers (4 MiB each at 1024)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=5.0, help="bucket size of both (about one layer)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (torch DDP rebuilds buckets)")
    parser.add_argument("--impl", default=str(SOLUTION), help="the file whose BucketedDDP is timed (default: the "
                        "reference solution; an older version or your own exercise work)")
    return parser.parse_args()


def worker(args) -> None:
    import importlib.util

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from gpucourse import runtime

    spec = importlib.util.spec_from_file_location("ddp_solution", args.impl)
    solution = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(solution)
    ctx = runtime.setup(seed=0)
    device, gpu = ctx.device, ctx.device.type == "cuda"

    def make_net():
        torch.manual_seed(0)
        layers = [m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.ReLU())]
        return nn.Sequential(*layers).to(device)

    models = {"torch": DistributedDataParallel(make_net(), bucket_cap_mb=args.bucket_mb,
                                               device_ids=[device] if gpu else None),
              "ours": solution.BucketedDDP(make_net(), bucket_size_mb=args.bucket_mb)}
    optims = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}

    def step(name, x, y):
        optims[name].zero_grad()
        nn.functional.mse_loss(models[name](x), y).backward()
        if name == "ours":
            models[name].finish_gradient_synchronization()
        optims[name].step()
        if gpu:  # GPU work is asynchronous: the step ends when the device is done
            torch.cuda.synchronize()

    total = args.warmup + args.steps
    for i in range(total):
        gen = torch.Generator().manual_seed(1000 * i + ctx.rank)
        x, y = torch.randn(args.batch, args.hidden, generator=gen), torch.randn(args.batch, args.hidden, generator=gen)
        x, y = x.to(device), y.to(device)
        times = {}
        for name in (["ours", "torch"] if i % 2 == 0 else ["torch", "ours"]):
            dist.barrier()
            start = time.perf_counter()
            step(name, x, y)
            times[name] = time.perf_counter() - start
        if i >= args.warmup:
            runtime.log(step=i - args.warmup, total=args.steps, ours_s=times["ours"], torch_s=times["torch"])
    diff = max((p - q).abs().max().item() for p, q in zip(models["ours"].parameters(), models["torch"].parameters()))
    torch_buckets = models["torch"]._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")  # bytes, "a, b, c"
    runtime.log(max_diff=diff, buckets=[sum(p.numel() * p.element_size() for p in b) for b in models["ours"].buckets],
                torch_buckets=[int(b) for b in str(torch_buckets).split(",") if b.strip()])
    runtime.teardown()


def main(args) -> None:
    import gpucourse

    # --nproc is not passed on to the ranks: torchrun would read it as its own (--nproc*)
    res = gpucourse.launch(__file__, nproc=args.nproc, name="bench-bucketed-ddp-vs-torch", timeout=600, live=False,
                           args=["--hidden", str(args.hidden), "--layers", str(args.layers), "--batch",
                                 str(args.batch), "--bucket-mb", str(args.bucket_mb), "--steps", str(args.steps),
                                 "--warmup", str(args.warmup), "--impl", str(Path(args.impl).resolve())])
    n = args.nproc

    def slowest_rank(key):
        return [max(ts) for ts in zip(*(res.metric(key, rank=r) for r in range(n)))]

    ours, theirs = slowest_rank("ours_s"), slowest_rank("torch_s")
    final = next(rec for rec in res.metrics[0] if "max_diff" in rec)
    mib = args.layers * (args.hidden + 1) * args.hidden * 4 / 2**20
    samples = args.batch * n
    print(f"MLP {args.layers} x {args.hidden} ({mib:.1f} MiB of float32 parameters), {args.batch} samples per rank, "
          f"buckets of {args.bucket_mb:g} MiB, {n} ranks ({res.manifest['backend']}, {res.manifest['device']}), "
          f"{args.steps} alternating steps; ours from {args.impl}")
    print(f"{'':22}{'median step':>12}{'samples/s':>11}{'best step':>11}")
    for name, times in (("BucketedDDP (ours)", ours), ("torch DDP", theirs)):
        med = statistics.median(times)
        print(f"{name:22}{med * 1e3:>9.1f} ms{samples / med:>11.0f}{min(times) * 1e3:>8.1f} ms")
    ratio = statistics.median(theirs) / statistics.median(ours)  # throughput ours / torch
    paired = statistics.median(t / o for t, o in zip(theirs, ours))
    ratio_best = min(theirs) / min(ours)
    verdict = "meets" if ratio >= GOAL else "misses"
    print(f"throughput ratio ours/torch: {ratio:.2f} (median steps), {paired:.2f} (median of per-step ratios), "
          f"{ratio_best:.2f} (best steps): {verdict} the {GOAL} goal")
    def layout(sizes):
        return f"{len(sizes)} ({', '.join(f'{b / 2**20:.2f}' for b in sizes)} MiB)" if sizes else "not reported"

    print(f"buckets: ours {layout(final['buckets'])}; torch's after its rebuild {layout(final['torch_buckets'])}")
    print(f"largest parameter difference after training: {final['max_diff']:.1e}")
    print(f"run: {res.run_dir}")


if __name__ == "__main__":
    if "RANK" in os.environ:  # a rank of the job main() launched
        worker(parse_args())
    else:
        sys.exit(main(parse_args()))
