"""Chapter 02: three beliefs about DDP, each tested.

    torchrun --nproc-per-node 2 scripts/02_mistakes.py

1. "DDP averages the loss."  After backward, every rank's loss is its own; the gradients are identical on
   all ranks and equal to the average of what each rank computes alone.
2. "Every rank needs the same seed so that the replicas start equal."  Each rank here is seeded differently
   (seed + rank); after DDP(...) every rank holds rank 0's initial parameters.
3. "batch_size in DDP is the global batch."  DataLoader(batch_size=32) gives each rank 32 samples per step.
Every rank logs what it saw; all_gather puts the other ranks' values next to its own.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from gpucourse import runtime

ctx = runtime.setup(seed=0)  # seed 0 + rank: a different initialisation on every rank
rank, world, device = ctx.rank, ctx.world_size, ctx.device


def everyone(value: torch.Tensor) -> list:
    """This tensor on every rank, in rank order."""
    out = [torch.zeros_like(value) for _ in range(world)]
    dist.all_gather(out, value)
    return [t.tolist() for t in out]


def params_of(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# 2. Different seeds, then DDP.
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
before = params_of(net)
rank0_before = before.clone()
dist.broadcast(rank0_before, src=0)  # only to compare with, below
model = DDP(net, device_ids=[device] if device.type == "cuda" else None)
after = params_of(net)
runtime.log(belief="seed", first_weights_before=everyone(before[:3]), first_weights_after=everyone(after[:3]),
            equals_rank0_initial=bool(torch.equal(after, rank0_before)))

# 3. batch_size=32, meant as "a global batch of 32".
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, seed=0))
x, y = next(iter(loader))
x, y = x.to(device), y.to(device)
runtime.log(belief="batch", batch_size=32, local_batch=x.shape[0],
            global_batch=sum(n[0] for n in everyone(torch.tensor([x.shape[0]], device=device))))

# 1. The loss, and the gradients.
alone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
alone.load_state_dict(net.state_dict())  # the same weights, without DDP: this rank's own gradient
nn.functional.mse_loss(alone(x), y).backward()
own_grad = torch.cat([p.grad.flatten() for p in alone.parameters()])
mean_of_own = own_grad.clone()
dist.all_reduce(mean_of_own)
mean_of_own /= world
loss = nn.functional.mse_loss(model(x), y)
loss.backward()
ddp_grad = torch.cat([p.grad.flatten() for p in net.parameters()])
runtime.log(belief="loss", loss_after_backward=everyone(loss.detach().reshape(1)),
            ddp_grad_first=everyone(ddp_grad[:3]), own_grad_first=everyone(own_grad[:3]),
            ddp_grad_is_mean_of_own=(ddp_grad - mean_of_own).abs().max().item())
runtime.teardown()
