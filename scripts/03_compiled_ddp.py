"""Chapter 03: DDP under torch.compile, against eager DDP, on the same model and batches.

    03_compiled_ddp.py [--steps 20 --warmup 3 --batch 64 --hidden 512 --layers 6 --bucket-cap-mb 1
                        --compiled-autograd]

Copies of one model (same initial weights), each in DistributedDataParallel with the same buckets:
  eager       DDP as in the rest of the chapter
  compiled    DDP(torch.compile(model)): TorchDynamo's DDPOptimizer splits the graph at DDP's bucket boundaries,
              so a bucket's gradients are finished, and its all-reduce starts, while the rest of backward runs
  one-graph   the same compiled with torch._dynamo.config.optimize_ddp=False: one graph whose backward hands
              every gradient over at its very end, so no all-reduce can overlap backward
  compiled-autograd (with --compiled-autograd) optimize_ddp="python_reducer" and compiled autograd: DDP built
              under that setting replaces its C++ reducer by a hook per parameter that all-reduces its gradient
              (functional collectives); the whole step (forward and backward) is torch.compile'd with
              torch._dynamo.config.compiled_autograd=True, so the backward, all-reduces included, is traced as one
              graph, and inductor fuses the all-reduces into buckets (its _fuse_ddp_communication pass)
A backend that wraps inductor counts the graphs each compiles (and the all-reduces in each). The first step of
each compiled model is timed apart (compilation); then they take turns, step by step, so each sees the same
machine. The script ASSERTS that all end with the same parameters (float32 rounding: inductor may fuse and
reorder). With --compiled-autograd it also profiles one more step of eager DDP and of compiled-autograd and logs
the all-reduces gloo ran in each. Also, as "mistake": a bucket cap below DDP's 1 MiB first bucket, compiled, and
what the DDPOptimizer says about it.
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
parser.add_argument("--compiled-autograd", action="store_true", help="also DDP's python reducer + compiled autograd")
args = parser.parse_args()

ctx = runtime.setup(seed=0, seed_per_rank=False)  # the same initial weights for every copy, on every rank


def make_ddp(cap_mb, backend=None):
    """DDP around the MLP; with a backend, around the MLP compiled with it."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.ReLU())])
    net = net.to(ctx.device)
    return DDP(net if backend is None else torch.compile(net, backend=backend), bucket_cap_mb=cap_mb)


def counting_backend(graphs: list):
    """inductor, noting the all-reduces in each graph it is given (the DDPOptimizer hands it one per bucket)."""
    def backend(gm, example_inputs):
        graphs.append(sum(1 for node in gm.graph.nodes if "all_reduce" in str(node.target)))
        return compile_fx(gm, example_inputs)
    return backend


models, graphs = {"eager": make_ddp(args.bucket_cap_mb)}, {"compiled": [], "one-graph": []}
for name in graphs:
    models[name] = make_ddp(args.bucket_cap_mb, counting_backend(graphs[name]))
OPTIMIZE_DDP = {"compiled": True, "one-graph": False, "compiled-autograd": "python_reducer"}
steps = {}
if args.compiled_autograd:
    graphs["compiled-autograd"] = []
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):  # read when DDP is built
        models["compiled-autograd"] = make_ddp(args.bucket_cap_mb)

    def forward_backward(x, y):
        loss = nn.functional.mse_loss(models["compiled-autograd"](x), y)
        loss.backward()
        return loss
    with torch._dynamo.config.patch(compiled_autograd=True):  # read when torch.compile wraps the function
        steps["compiled-autograd"] = torch.compile(forward_backward,
                                                   backend=counting_backend(graphs["compiled-autograd"]))
optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}


def step(name, x, y):
    with torch._dynamo.config.patch(optimize_ddp=OPTIMIZE_DDP.get(name, True)):
        if name in steps:
            loss = steps[name](x, y)
        else:
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
for name in models.keys() - {"eager"}:
    for p, want in zip(models[name].parameters(), reference):
        torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n} trained a different model than eager DDP: {m}")
runtime.log(case="compare", compile_s=compile_s, step_ms={n: statistics.median(t) for n, t in times.items()},
            graphs={n: len(g) for n, g in graphs.items()}, loss=losses, all_reduces_in_graphs=graphs,
            params=sum(p.numel() for p in reference), tensors=len(reference), bucket_cap_mb=args.bucket_cap_mb)

if args.compiled_autograd:  # the all-reduces gloo runs in one step, eager DDP's buckets against the fused ones
    ran = {}
    for name in ("eager", "compiled-autograd"):
        with torch.profiler.profile() as prof:
            step(name, *batches[-1])
        ran[name] = sum(e.name == "gloo:all_reduce" for e in prof.events())
    runtime.log(case="compiled-autograd", all_reduces_run=ran)

# The mistake: a bucket cap below the first bucket's 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)
small = make_ddp(0.25, counting_backend([]))
try:
    small(batches[0][0]).sum().backward()
    runtime.log(case="mistake", error=None)
except Exception as err:  # noqa: BLE001 - what torch says is the point
    runtime.log(case="mistake", error=f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}")
runtime.teardown()
