"""Chapter 02: mixed precision inside DDP, and compressing DDP's communication with a comm hook.

    torchrun --nproc-per-node 2 scripts/02_precision.py [--steps 5]

Modes, each from the same initial model on the same data, each profiled (traces/<mode><rank>.json):
  fp32       plain DDP
  autocast   forward under torch.autocast: bfloat16 (on a GPU without bf16: float16 with a GradScaler)
  fp16_hook  float32 training; DDP casts each bucket to float16 for its all_reduce (fp16_compress_hook)
  bf16_hook  the same in bfloat16 (bf16_compress_hook: needs NCCL; elsewhere the error is logged)
Each logs the dtypes it saw (output, parameters, gradients) and, after every step, its loss and largest
parameter difference from fp32.
"""
import argparse

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5, help="optimizer steps; the last ones are profiled")
parser.add_argument("--batch", type=int, default=16)
args = parser.parse_args()

ctx = runtime.setup(seed=0)
device = ctx.device
MODES = ("fp32", "autocast", "fp16_hook", "bf16_hook")
gpu = device.type == "cuda"
AMP_DTYPE = runtime.amp_dtype()  # bfloat16, or float16 on a GPU without it (T4): then with a GradScaler
HOOKS = {"fp16_hook": default_hooks.fp16_compress_hook, "bf16_hook": default_hooks.bf16_compress_hook}


def make_model(mode):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    model = DDP(net, bucket_cap_mb=0.2, device_ids=[device] if gpu else None)
    if mode in HOOKS:
        model.register_comm_hook(None, HOOKS[mode])  # state: the process group (None: the default one)
    return model


def batch(step):
    gen = torch.Generator().manual_seed(100 * step + ctx.rank)
    return torch.randn(args.batch, 64, generator=gen).to(device), torch.randn(args.batch, 8, generator=gen).to(device)


def train(mode, reference):
    try:
        model = make_model(mode)
    except Exception as err:  # noqa: BLE001 - what DDP refuses on this backend is the finding: log it, go on
        runtime.log(mode=mode, error=f"{type(err).__name__}: {str(err).splitlines()[0]}")
        return None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = runtime.grad_scaler(AMP_DTYPE) if mode == "autocast" else None
    params = []
    with runtime.profile(wait=1, warmup=1, active=max(1, args.steps - 2), record_shapes=True, name=mode) as prof:
        for step in range(args.steps):
            x, y = batch(step)
            with torch.autocast(device.type, dtype=AMP_DTYPE, enabled=mode == "autocast"):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            (scaler.scale(loss) if scaler else loss).backward()
            grad_dtype = str(next(model.parameters()).grad.dtype)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            prof.step()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            params.append(flat)
            diff = (flat - reference[step]).abs().max().item() if reference else 0.0
            runtime.log(step=MODES.index(mode) * args.steps + step, total=len(MODES) * args.steps, mode=mode,
                        loss=loss.item(), max_diff=diff, output_dtype=str(out.dtype),
                        param_dtype=str(next(model.parameters()).dtype), grad_dtype=grad_dtype,
                        scaler=scaler is not None and scaler.is_enabled())
    return params


reference = train("fp32", None)
for mode in MODES[1:]:
    train(mode, reference)
runtime.teardown()
