"""Chapter 02: DDP on N ranks (batch B each) against one process on the whole batch of N*B, step by step.

    torchrun --nproc-per-node 2 scripts/02_equivalence.py [--steps 8] [--batch 8]

Each rank trains a DDP model on its slice of every global batch and ALSO, by itself, a plain copy of the
model on the whole global batch, with no communication at all: that copy is "one process with batch N*B".
After every step it logs the largest parameter difference between the two. Variants, one after the other:
  mean       mean-reduced loss: the two stay equal up to float rounding
  sum        sum-reduced loss: DDP averages gradients over ranks, so its gradient is 1/N of the single process's
  batchnorm  BatchNorm normalises with each rank's own batch statistics, not the global batch's
  syncbn     the fix for batchnorm: SyncBatchNorm, which needs GPUs (elsewhere the error is logged)
  dropout    each rank draws its own dropout masks: equal in distribution, not step by step
Last, how many dropout decisions rank 0 and rank 1 share, with per-rank seeds and with one seed for all.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--variants", nargs="+", default=["mean", "sum", "batchnorm", "syncbn", "dropout"])
args = parser.parse_args()

ctx = runtime.setup(seed=0)  # seeds torch with 0 + rank: every rank initialises its model differently
rank, world, device = ctx.rank, ctx.world_size, ctx.device
B = args.batch


def make_model(variant):
    layers = [nn.Linear(16, 32)]
    if variant in ("batchnorm", "syncbn"):
        layers.append(nn.BatchNorm1d(32))
    layers.append(nn.Tanh())
    if variant == "dropout":
        layers.append(nn.Dropout(0.5))
    layers.append(nn.Linear(32, 4))
    return nn.Sequential(*layers).to(device)


def global_batch(step):
    """Step `step`'s global batch of world*B samples: the same on every rank (a shared generator seed)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(world * B, 16, generator=gen), torch.randn(world * B, 4, generator=gen)
    return x.to(device), y.to(device)


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def grad_norm(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()


def run(variant, first_step):
    net = make_model(variant)
    if variant == "syncbn":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    try:
        model = DDP(net, device_ids=[device] if device.type == "cuda" else None)  # broadcasts rank 0's state
    except Exception as err:  # noqa: BLE001 - what DDP refuses on this backend is the finding: log it, go on
        runtime.log(variant=variant, error=f"{type(err).__name__}: {str(err).splitlines()[0]}")
        return
    single = make_model("batchnorm" if variant == "syncbn" else variant)  # plain: no DDP, no communication
    single.load_state_dict(model.module.state_dict())  # starts from the state DDP broadcast from rank 0
    reduction = "sum" if variant == "sum" else "mean"
    lr = args.lr / (world * B) if variant == "sum" else args.lr  # a sum's gradient is N*B times larger
    opt, single_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(single.parameters(), lr=lr)
    mine = slice(rank * B, (rank + 1) * B)
    for step in range(args.steps):
        x, y = global_batch(step)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine], reduction=reduction)
        loss.backward()  # DDP all-reduces (averages) the gradients during this call
        single_loss = nn.functional.mse_loss(single(x), y, reduction=reduction)
        single_loss.backward()
        ratio = grad_norm(model.module) / grad_norm(single)
        opt.step()
        single_opt.step()
        opt.zero_grad()
        single_opt.zero_grad()
        runtime.log(step=first_step + step, total=len(args.variants) * args.steps, variant=variant,
                    max_diff=max_diff(model.module, single), grad_ratio=ratio, local_loss=loss.item(),
                    single_loss=single_loss.item())


def mask_agreement():
    """Fraction of 10,000 dropout keep/drop decisions that are the same on rank 0 and rank 1."""
    mask = (nn.functional.dropout(torch.ones(10_000, device=device), 0.5) > 0).float()
    masks = [torch.zeros_like(mask) for _ in range(world)]
    dist.all_gather(masks, mask)
    return (masks[0] == masks[1]).float().mean().item()


for i, variant in enumerate(args.variants):
    run(variant, i * args.steps)
if world > 1:
    per_rank_seeds = mask_agreement()  # seeded with 0 + rank by runtime.setup
    torch.manual_seed(0)  # now the same seed on every rank
    runtime.log(mask_agreement_per_rank_seeds=per_rank_seeds, mask_agreement_same_seed=mask_agreement())
runtime.teardown()
