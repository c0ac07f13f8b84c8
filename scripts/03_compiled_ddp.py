"""Chapter 03: DDP under torch.compile, against eager DDP, on the same model and batches.

    03_compiled_ddp.py [--steps 20 --warmup 3 --batch 64 --hidden 512 --layers 6 --bucket-cap-mb 1]

Three copies of one model (same initial weights), each in DistributedDataParallel with the same buckets:
  eager       DDP as in the rest of the chapter
  compiled    torch.compile(ddp_model): TorchDynamo's DDPOptimizer splits the graph at DDP's bucket boundaries,
              so a bucket's gradients are finished, and its all-reduce starts, while the rest of backward runs
  one-graph   the same compiled with torch._dynamo.config.optimize_ddp=False: one graph whose backward hands
              every gradient over at its very end, so no all-reduce can overlap backward
A backend that wraps inductor counts the graphs each compiles. The first step of each compiled model is timed
apart (compilation); then the three take turns, step by step, so each sees the same machine. The script ASSERTS
that the three end with the same parameters (float32 rounding: inductor may fuse and reorder). Also, as
"mistake": a bucket cap below DDP's 1 MiB first bucket, compiled, and what the DDPOptimizer says about it.
"""
import argparse
import statistics
import time

import torch
import torch._dynamo
from torch import nn
from torch._inductor.compile_fx import compile_fx
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20, help="timed steps per model")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
parser.add_argument("--hidden", type=int, default=512, help="width of every layer")
parser.add_argument("--layers", type=int, default=6, help="hidden x hidden Linear layers")
parser.add_argument("--bucket-cap-mb", type=float, default=1.0, help="DDP's bucket cap (at least 1: see 'mistake')")
args = parser.parse_args()

ctx = runtime.setup(seed=0, seed_per_rank=False)  # the same initial weights for every copy, on every rank


def make_ddp(cap_mb, backend=None):
    """DDP around the MLP; with a backend, around the MLP compiled with it."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.ReLU())])
    net = net.to(ctx.device)
    return DDP(net if backend is None else torch.compile(net, backend=backend), bucket_cap_mb=cap_mb)


def counting_backend(graphs: list):
    """inductor, counting the graphs it is given (the DDPOptimizer hands it one per bucket)."""
    def backend(gm, example_inputs):
        graphs.append(sum(1 for node in gm.graph.nodes if node.op == "get_attr" or node.op == "placeholder"))
        return compile_fx(gm, example_inputs)
    return backend


models, graphs = {"eager": make_ddp(args.bucket_cap_mb)}, {"compiled": [], "one-graph": []}
for name in graphs:
    models[name] = make_ddp(args.bucket_cap_mb, counting_backend(graphs[name]))
optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}


def step(name, x, y):
    with torch._dynamo.config.patch(optimize_ddp=name != "one-graph"):
        loss = nn.functional.mse_loss(models[name](x), y)
        loss.backward()
    optimizers[name].step()
    optimizers[name].zero_grad()
    return loss.item()


gen = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own data; every model the same batches
batches = [(torch.randn(args.batch, args.hidden, generator=gen).to(ctx.device),
            torch.randn(args.batch, args.hidden, generator=gen).to(ctx.device)) for _ in range(args.warmup + args.steps)]
compile_s, times, losses = {}, {name: [] for name in models}, {}
for i, (x, y) in enumerate(batches):
    for name in models:  # same batch for each, in turns
        start = time.perf_counter()
        losses[name] = step(name, x, y)
        elapsed = time.perf_counter() - start
        if i == 0:
            compile_s[name] = elapsed
        elif i >= args.warmup:
            times[name].append(elapsed * 1e3)

reference = [p.detach() for p in models["eager"].parameters()]
for name in ("compiled", "one-graph"):
    for p, want in zip(models[name].parameters(), reference):
        torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n} trained a different model than eager DDP: {m}")
runtime.log(case="compare", compile_s=compile_s, step_ms={n: statistics.median(t) for n, t in times.items()},
            graphs={n: len(g) for n, g in graphs.items()}, loss=losses,
            params=sum(p.numel() for p in reference), bucket_cap_mb=args.bucket_cap_mb)

# The mistake: a bucket cap below the first bucket's 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
small = make_ddp(0.25, counting_backend([]))
try:
    small(batches[0][0]).sum().backward()
    runtime.log(case="mistake", error=None)
except Exception as err:  # noqa: BLE001 - what torch says is the point
    runtime.log(case="mistake", error=f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}")
runtime.teardown()
