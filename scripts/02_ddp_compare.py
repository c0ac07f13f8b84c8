"""Chapter 02: your DDP and BucketedDDP (exercise ex02) against torch's DistributedDataParallel.

    torchrun --nproc-per-node 2 scripts/02_ddp_compare.py exercises/ex02_ddp.py [--steps 30]
    gpucourse dryrun scripts/02_ddp_compare.py --world 1024 -- exercises/ex02_ddp.py --steps 2   # DDP over 1,024 ranks

Three copies of one MLP, from the same initial weights, train on the same batches: torch's DDP, your DDP and
your BucketedDDP. Every step runs all three, in rotating order so that none always goes first, and times
each. Logged per step: each one's loss and step time, and its largest parameter difference from torch's (None in
a dry run, where no value means anything).
"""
import argparse
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gpucourse import exercises, runtime

parser = argparse.ArgumentParser()
parser.add_argument("impl", help="a .py file defining DDP and BucketedDDP")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size of both bucketed versions")
args = parser.parse_args()

ctx = runtime.setup(seed=0)
device = ctx.device
impl = exercises.load_file(args.impl, "ddp_impl")


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10)).to(device)


models = {"torch DDP": TorchDDP(make_net(), bucket_cap_mb=args.bucket_mb,
                                device_ids=[device] if device.type == "cuda" else None),
          "your DDP": impl.DDP(make_net()),
          "your BucketedDDP": impl.BucketedDDP(make_net(), bucket_size_mb=args.bucket_mb)}
optims = {name: torch.optim.SGD(m.parameters(), lr=0.02) for name, m in models.items()}
names = list(models)


def train_step(name, x, y):
    model, opt = models[name], optims[name]
    start = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if name != "torch DDP":
        model.finish_gradient_synchronization()
    opt.step()
    value = runtime.value(loss)  # waits for the GPU, if any: the time below includes the step's work
    return value, time.perf_counter() - start


for step in range(args.steps):
    gen = torch.Generator().manual_seed(10_000 * step + ctx.rank)  # each rank its own batch
    x, y = torch.randn(args.batch, 128, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)
    x, y = x.to(device), y.to(device)
    losses, seconds = {}, {}
    for name in names[step % 3:] + names[:step % 3]:
        losses[name], seconds[name] = train_step(name, x, y)
    reference = list(models["torch DDP"].parameters())
    diffs = {name: runtime.value(max((p - q).abs().max() for p, q in zip(models[name].parameters(), reference)))
             for name in names[1:]}
    runtime.log(step=step, total=args.steps, loss=losses, seconds=seconds, max_diff=diffs)
runtime.teardown()
