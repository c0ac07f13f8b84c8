"""Chapter 02: what DistributedSampler gives each rank, and what batch_size means under DDP.

    torchrun --nproc-per-node 2 scripts/02_sampler.py [--items 11] [--epochs 3] [--batch 4]

Part 1: every rank logs the indices its DistributedSampler yields for a dataset of --items items, epoch
by epoch: without set_epoch (the classic mistake), with sampler.set_epoch(epoch), and with drop_last=True.
Part 2: a DataLoader(batch_size=--batch) over a DistributedSampler feeds a DDP model. Each rank logs how
many samples its model received per step; an all_reduce adds them up to the global batch.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--items", type=int, default=11)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch", type=int, default=4, help="DataLoader batch_size")
parser.add_argument("--samples", type=int, default=64, help="dataset size in part 2")
args = parser.parse_args()

ctx = runtime.setup(seed=0)
device = ctx.device

# Part 1: the indices. DistributedSampler reads the rank and world size from the process group.
items = TensorDataset(torch.arange(args.items))
for mode in ("without set_epoch", "with set_epoch", "drop_last"):
    sampler = DistributedSampler(items, shuffle=True, seed=0, drop_last=mode == "drop_last")
    for epoch in range(args.epochs):
        if mode != "without set_epoch":
            sampler.set_epoch(epoch)  # the line people forget
        runtime.log(part="sampler", mode=mode, epoch=epoch, indices=list(sampler))

# Part 2: batch_size is per rank.
data = TensorDataset(torch.randn(args.samples, 8), torch.randn(args.samples, 1))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
model = DDP(nn.Linear(8, 1).to(device), device_ids=[device] if device.type == "cuda" else None)
seen = []
model.module.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].shape[0]))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler.set_epoch(0)
for step, (x, y) in enumerate(loader):
    loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = torch.tensor([seen[-1]], device=device)
    dist.all_reduce(total)  # the samples of this step on all ranks: the global batch
    runtime.log(part="batch", step=step, total=len(loader), local_batch=seen[-1], global_batch=int(total.item()),
                steps_per_epoch=len(loader), dataset=len(data))
runtime.teardown()
