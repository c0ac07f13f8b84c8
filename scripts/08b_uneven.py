"""Uneven shards under DDP: the buggy loop of exercise ex08, or your fixed `train`.

  --impl FILE   the file defining train / evaluate / common_steps (your exercises/ex08_fix_the_hang.py)
  --buggy       run FILE's _train_that_hangs instead (uneven shards + a rank-0-only evaluation)

Rank r holds 7, 4, 5, ... training batches (uneven, as when a data set does not split evenly over the
ranks) and 2 evaluation batches. Logs the steps run, the evaluations and the final parameters' checksum.
"""
import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import exercises, runtime

parser = argparse.ArgumentParser()
parser.add_argument("--impl", required=True)
parser.add_argument("--buggy", action="store_true")
parser.add_argument("--eval-every", type=int, default=2)
args = parser.parse_args()

ctx = runtime.setup(seed=0, seed_per_rank=False)
impl = exercises.load_file(args.impl, "ex08")


def batches(seed: int, count: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(count)]


train_batches = batches(100 + ctx.rank, (7, 4, 5)[ctx.rank % 3])
eval_batches = batches(200 + ctx.rank, 2)
print(f"rank {ctx.rank}: {len(train_batches)} training batches", flush=True)
model = DDP(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
train = impl._train_that_hangs if args.buggy else impl.train
out = train(model, opt, train_batches, eval_batches, eval_every=args.eval_every)
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"rank {ctx.rank}: done, {out['steps']} steps, parameter checksum {checksum:.6f}", flush=True)
runtime.log(steps=out["steps"], evals=out["evals"], checksum=checksum)
runtime.teardown()
