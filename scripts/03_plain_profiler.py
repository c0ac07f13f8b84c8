"""Chapter 03: torch.profiler around a few DDP steps, in plain PyTorch (no course helpers).

Runs under torchrun (or `python script.py`, one rank). Every rank profiles --steps DDP training steps of a
small MLP; rank 0 prints the profiler's table of operators, sorted by total CPU time: compute (aten::addmm,
autograd's backward nodes, ...) and communication (gloo:all_reduce on CPU, nccl:all_reduce on GPUs) side by side.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 unprofiled ones)")
parser.add_argument("--rows", type=int, default=15, help="rows of the table")
parser.add_argument("--backend", default="auto", help="'gloo', 'nccl', or 'auto': NCCL when every rank has a GPU")
args = parser.parse_args()

local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
backend = args.backend if args.backend != "auto" else "nccl" if gpus else "gloo"
if "RANK" not in os.environ:  # plain `python script.py`: a world of one
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend)
rank = dist.get_rank()

torch.manual_seed(rank)
net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())]).to(device)
model = DDP(net, bucket_cap_mb=0.25)  # 4 layers of 257 KiB: several buckets, so all-reduce overlaps backward
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 256, device=device), torch.randn(32, 256, device=device)


def step():
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()  # DDP all-reduces gradient buckets during backward
    opt.step()


for _ in range(2):  # warm up: DDP rebuilds its buckets in the second step
    step()
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
with profile(activities=activities) as prof:
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()

if rank == 0:
    sort_by = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"rank 0 of {dist.get_world_size()}, {backend}, {args.steps} DDP steps, sorted by {sort_by}:")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows))
del model  # gloo + DDP can abort at exit if the process group goes before DDP's reducer
gc.collect()
dist.destroy_process_group()
