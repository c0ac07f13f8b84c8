"""Chapter 03: train a small MLP with DistributedDataParallel, time every step, profile a few.

Three ways to run a step, all on the same DDP-wrapped model:
    (default)       ddp         gradients all-reduced in buckets of --bucket-cap-mb while backward still runs
    --no-overlap    no-overlap  backward under no_sync(), then the same buckets all-reduced: no overlap possible
    --no-ddp        no-ddp      backward under no_sync() and nothing else: compute alone, no communication
    --compare       all three, alternating step by step, so that all three see the same load on the machine

With --compare on more than one rank, every step also times the no-overlap mode's all-reduces alone, bucket by
bucket, with no compute beside them (mode "comm", bucket_ms: one time per bucket in the order they are sent):
what communication costs on this machine during this very launch, measured apart from the steps it helps predict.

Each rank trains on its own random batch of --batch samples (weak scaling: the global batch grows with the
world size). After --warmup untimed steps per mode (DDP settles its buckets in the second), --steps steps per
mode are timed and logged (mode, step_ms, forward_ms, backward_ms, samples_per_s of this rank; no-ddp's
backward is compute alone, the others' include the all-reduces it waits for). Then, unless --profile-steps 0,
each mode profiles a few more steps with runtime.profile: traces/rank<r>.json, or traces/<mode>-rank<r>.json with
--compare. The first record holds the model's size and DDP's buckets.

    gpucourse dryrun scripts/03_ddp_train.py --world 1024 -- --steps 1 --warmup 2 --profile-steps 0
runs it as ranks 0 and 1023 of 1,024 with a fake process group: the last warm-up step's all-reduces (one per
bucket, over all 1,024 ranks), memory and FLOPs counted, values read as None.
"""
import argparse
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20, help="timed steps (per mode)")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (per mode)")
parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps at the end (0: no trace)")
parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
parser.add_argument("--hidden", type=int, default=512, help="width of every layer")
parser.add_argument("--layers", type=int, default=6, help="hidden x hidden Linear layers")
parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="DDP's bucket cap, passed explicitly (torch's default, None, is 25 with a 1 MiB first bucket)")
which = parser.add_mutually_exclusive_group()
which.add_argument("--no-overlap", action="store_true", help="all-reduce the buckets after backward")
which.add_argument("--no-ddp", action="store_true", help="no gradient synchronisation at all")
which.add_argument("--compare", action="store_true", help="alternate ddp, no-overlap and no-ddp steps")
args = parser.parse_args()
if args.warmup < 2:
    parser.error("--warmup must be at least 2: DDP rebuilds its buckets, in gradient order, in the second step")
MODES = (["ddp", "no-overlap", "no-ddp"] if args.compare else ["no-overlap"] if args.no_overlap else
         ["no-ddp"] if args.no_ddp else ["ddp"])

ctx = runtime.setup(seed=0, seed_per_rank=False)  # same initial weights everywhere (DDP broadcasts them anyway)
torch.manual_seed(1000 + ctx.rank)  # ...but each rank draws its own data
net = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.ReLU())])
params = list(net.parameters())
model = DDP(net.to(ctx.device), bucket_cap_mb=args.bucket_cap_mb)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(args.batch, args.hidden, device=ctx.device)
y = torch.randn(args.batch, args.hidden, device=ctx.device)


def buckets_after_backward():
    """--no-overlap: the gradients grouped as DDP groups them (last layer first, each bucket filled to >= cap)."""
    cap, groups, size = args.bucket_cap_mb * 2**20, [[]], 0
    for p in reversed(params):
        if size >= cap:  # DDP closes a bucket once it holds at least the cap
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return groups


GROUPS = buckets_after_backward()


def allreduce_after_backward():
    """What DDP does, minus the overlap: average each bucket's gradients, one bucket after the other.
    Returns the seconds each bucket took (copies in and out included, as DDP's reducer does them too)."""
    seconds = []
    for group in GROUPS:
        start = time.perf_counter()
        flat = torch.cat([p.grad.flatten() for p in group])
        dist.all_reduce(flat)
        flat /= ctx.world_size
        offset = 0
        for p in group:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def sync():
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()


def train_step(mode):
    """One step; returns the seconds of its forward and of its backward pass, timed apart because the
    gradient all-reduces can hide behind backward only (forward runs before any gradient exists)."""
    opt.zero_grad(set_to_none=True)
    # ddp: buckets all-reduce as soon as they fill up; otherwise DDP's hooks stay silent (local gradients only)
    with contextlib.nullcontext() if mode == "ddp" else model.no_sync():
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        sync()
        forward_end = time.perf_counter()
        loss.backward()
        sync()
        backward_end = time.perf_counter()
    if mode == "no-overlap":
        allreduce_after_backward()  # every byte is sent after backward has returned
    opt.step()
    return forward_end - start, backward_end - forward_end


def ddp_buckets():
    """The sizes in bytes of DDP's buckets, read from its reducer (a private API: DDP has no public one)."""
    return [b.buffer().numel() * b.buffer().element_size() for b in model.reducer._get_zeros_like_grad_buckets()]


for mode in MODES:
    for _ in range(args.warmup):
        train_step(mode)
buckets = (ddp_buckets() if "ddp" in MODES else
           [sum(p.numel() * p.element_size() for p in g) for g in GROUPS] if "no-overlap" in MODES else [])
runtime.log(modes=MODES, params=sum(p.numel() for p in params), grad_bytes=sum(p.numel() * p.element_size()
            for p in params), batch=args.batch, hidden=args.hidden, layers=args.layers,
            bucket_cap_mb=args.bucket_cap_mb, buckets=buckets, threads=torch.get_num_threads())

for step in range(args.steps):
    for i in range(len(MODES)):
        mode = MODES[(step + i) % len(MODES)]  # rotate the order: no mode always runs first
        sync()
        start = time.perf_counter()
        forward_s, backward_s = train_step(mode)
        sync()
        seconds = time.perf_counter() - start
        runtime.log(step=step, total=args.steps, mode=mode, step_ms=seconds * 1e3, forward_ms=forward_s * 1e3,
                    backward_ms=backward_s * 1e3, samples_per_s=args.batch / seconds)
    if args.compare and ctx.world_size > 1:  # the same all-reduces alone (the gradients of the last step)
        sync()
        dist.barrier()  # all ranks start together: no rank's wait for a slower one's compute counts as comm
        bucket_s = allreduce_after_backward()
        runtime.log(step=step, total=args.steps, mode="comm", step_ms=sum(bucket_s) * 1e3,
                    bucket_ms=[s * 1e3 for s in bucket_s])

if args.profile_steps:
    for mode in MODES:
        with runtime.profile(wait=1, warmup=1, active=args.profile_steps,
                             name=f"{mode}-rank" if args.compare else None) as prof:
            for _ in range(args.profile_steps + 2):
                train_step(mode)
                sync()
                prof.step()
runtime.teardown()
