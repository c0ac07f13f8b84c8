"""Chapter 02: a complete DDP training script in plain PyTorch, with none of the course's helpers.

    torchrun --nproc-per-node 2 scripts/02_plain_ddp.py [--epochs 2] [--batch 8] [--samples 96]

What every DDP script does, in this order:
  1. init_process_group: torchrun has put RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment
  2. LOCAL_RANK (this process's number on its machine) picks its GPU: torch.cuda.set_device
  3. DistributedSampler gives each rank its shard of the data; set_epoch reshuffles it every epoch
  4. DDP wraps the model: it broadcasts rank 0's weights, and all-reduces (averages) gradients in backward
  5. leave cleanly: drop the DDP model, then destroy_process_group (why: see the end of the script)
Each rank prints how many samples it saw and a checksum of its final weights: DDP keeps them identical.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
parser.add_argument("--samples", type=int, default=96, help="size of the (random) dataset")
args = parser.parse_args()

# 1-2. One process per GPU with NCCL when every local rank has a GPU of its own; CPU processes with gloo otherwise.
local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
    torch.cuda.set_device(local_rank)
    device, backend = torch.device("cuda", local_rank), "nccl"
else:
    device, backend = torch.device("cpu"), "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()

# 3. The same dataset on every rank (same seed); the sampler decides which rank reads which samples.
torch.manual_seed(0)
data = TensorDataset(torch.randn(args.samples, 16), torch.randn(args.samples, 1))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=args.batch, sampler=sampler)

# 4. torch.manual_seed(rank): every rank starts from different weights, and DDP's constructor replaces them all
#    with rank 0's.
torch.manual_seed(rank)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device),
            device_ids=[local_rank] if device.type == "cuda" else None)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

seen = 0
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order
    total = torch.zeros(2, device=device)  # this rank's summed loss and step count
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP averages the gradients over the ranks here
        optimizer.step()
        total += torch.stack([loss.detach(), torch.ones((), device=device)])
        seen += len(x)
    dist.all_reduce(total)  # summed over ranks: the mean loss of the whole epoch, on every rank
    if rank == 0:
        print(f"epoch {epoch}: mean loss {total[0].item() / total[1].item():.4f} over {world} ranks", flush=True)

checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"rank {rank}: saw {seen} samples in {args.epochs} epochs; weight checksum {checksum:.10f}", flush=True)

# 5. Leave cleanly. Gloo finishes each collective on a worker thread of its own. destroy_process_group()
#    stops those threads only once nothing else references the group, and the DDP model does. A worker that
#    is still releasing a finished collective while the interpreter shuts down asks for the GIL, gets
#    terminated by CPython, and takes the whole process with it: "terminate called without an active
#    exception", SIGABRT, after the work is done. Dropping the model first lets destroy_process_group()
#    join the workers while Python is still fully alive.
del model, optimizer
gc.collect()
dist.destroy_process_group()
