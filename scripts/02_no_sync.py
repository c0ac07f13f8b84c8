"""Chapter 02: gradient accumulation with DDP's no_sync(), against one larger batch, with communication traced.

    torchrun --nproc-per-node 2 scripts/02_no_sync.py [--accum 4] [--batch 8] [--steps 5]

Three ways to train on --accum micro-batches of --batch samples per rank per optimizer step, each from the
same initial model on the same data, each profiled (traces/<mode><rank>.json, shapes recorded):
  big       one backward on all accum*batch samples                      (the reference)
  every     accum backwards, each all-reducing the gradients as usual    (same result, accum x the traffic)
  no_sync   the first accum-1 backwards inside model.no_sync(), where gradients only accumulate locally;
            the last one all-reduces the accumulated sum                 (same result, 1x the traffic)
Each micro-batch's loss is divided by accum, so the accumulated gradient is the mean over all samples.
After every step each mode logs its largest parameter difference from `big`.
"""
import argparse
import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--accum", type=int, default=4)
parser.add_argument("--batch", type=int, default=8, help="samples per rank per micro-batch")
parser.add_argument("--steps", type=int, default=5, help="optimizer steps; the last ones are profiled")
parser.add_argument("--bucket-cap-mb", type=float, default=0.05, help="small: several buckets per backward")
args = parser.parse_args()

ctx = runtime.setup(seed=0)
rank, world, device = ctx.rank, ctx.world_size, ctx.device
MODES = ("big", "every", "no_sync")


def make_model():
    torch.manual_seed(0)
    layers = [nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
              nn.Linear(128, 8)]
    model = nn.Sequential(*layers).to(device)
    return DDP(model, bucket_cap_mb=args.bucket_cap_mb, device_ids=[device] if device.type == "cuda" else None)


def micro_batches(step):
    """This rank's accum micro-batches of step `step` (slices of global micro-batches shared by all ranks)."""
    out = []
    for k in range(args.accum):
        gen = torch.Generator().manual_seed(1000 * step + k)
        x, y = torch.randn(world * args.batch, 64, generator=gen), torch.randn(world * args.batch, 8, generator=gen)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        out.append((x[mine].to(device), y[mine].to(device)))
    return out


def train(mode, reference):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = []
    active = max(1, args.steps - 2)
    with runtime.profile(wait=1, warmup=1, active=active, record_shapes=True, name=mode) as prof:
        for step in range(args.steps):
            micro = micro_batches(step)
            if mode == "big":
                x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
                nn.functional.mse_loss(model(x), y).backward()
            else:
                for k, (x, y) in enumerate(micro):
                    last = k == args.accum - 1
                    quiet = model.no_sync() if mode == "no_sync" and not last else contextlib.nullcontext()
                    with quiet:  # forward AND backward inside no_sync
                        (nn.functional.mse_loss(model(x), y) / args.accum).backward()
            opt.step()
            opt.zero_grad()
            prof.step()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            params.append(flat)
            diff = (flat - reference[step]).abs().max().item() if reference else 0.0
            runtime.log(step=MODES.index(mode) * args.steps + step, total=len(MODES) * args.steps, mode=mode,
                        max_diff=diff, profiled=step >= 2)
    return params


reference = train("big", None)
for mode in MODES[1:]:
    train(mode, reference)
runtime.teardown()
