"""Chapter 08d: DiLoCo against synchronous data parallelism, one replica group per torchrun job (torchft, gloo).

--mode ddp     torchft's DistributedDataParallel all-reduces the gradients at every step (AdamW on the average).
--mode diloco  torchft's DiLoCo: each replica takes --sync-every AdamW steps on its own data ("inner steps"), then
               all-reduces its pseudo-gradient (the weights at the last sync minus its weights now) and an outer SGD
               with Nesterov momentum applies the average to the weights of the last sync (Douillard et al. 2023).

Both modes see the same data: replica r's batch of step s depends on (r, s) alone. Every tensor handed to the Manager's
all-reduce is counted (calls and bytes: what this replica sends into the all-reduce), each step logs the loss of its
batch, and the run ends with the loss of the final model on a held-out set and a digest of its parameters.
"""
import argparse
import hashlib
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.local_sgd import DiLoCo

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["ddp", "diloco"], required=True)
parser.add_argument("--replica", type=int, required=True, help="this replica group's index")
parser.add_argument("--replicas", type=int, default=2, help="replica groups in the job")
parser.add_argument("--steps", type=int, default=200, help="training steps (inner steps, for DiLoCo)")
parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo: inner steps between two syncs")
parser.add_argument("--batch", type=int, default=32, help="samples per replica per step")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--start-dir", required=True, help="a folder the replicas meet in before the first step")
args = parser.parse_args()
if args.mode == "diloco" and args.steps % args.sync_every:
    parser.error(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every} (end on a sync)")

torch.use_deterministic_algorithms(True)
ctx = runtime.setup(seed=0, seed_per_rank=False)  # the same initial model in every replica
model = nn.Sequential(nn.Linear(16, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.hidden), nn.Tanh(),
                      nn.Linear(args.hidden, 1))
inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
teacher = torch.Generator().manual_seed(7)
w1, w2 = torch.randn(16, 32, generator=teacher), torch.randn(32, 1, generator=teacher) / 4


def data(seed: int, n: int):
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ w1) @ w2


def load_state_dict(state):
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])


manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=args.replicas,
                  load_state_dict=load_state_dict if args.mode == "ddp" else None,
                  state_dict=(lambda: {"model": model.state_dict(), "optim": inner.state_dict()})
                  if args.mode == "ddp" else None,
                  replica_id=f"{args.mode}{args.replica}", use_async_quorum=False, timeout=timedelta(seconds=30),
                  quorum_timeout=timedelta(seconds=60), rank=ctx.rank, world_size=ctx.world_size,
                  hostname="127.0.0.1")
sent = {"calls": 0, "bytes": 0}
allreduce = manager.allreduce


def counted(tensor, *more, **kw):
    """The Manager's all-reduce, counted: every tensor any torchft wrapper hands to it."""
    sent["calls"] += 1
    sent["bytes"] += tensor.numel() * tensor.element_size()
    return allreduce(tensor, *more, **kw)


manager.allreduce = counted
start = Path(args.start_dir)
(start / f"{args.mode}{args.replica}").touch()  # meet the other replicas, so that every quorum has them all
while len(list(start.glob(f"{args.mode}*"))) < args.replicas:
    time.sleep(0.05)

if args.mode == "ddp":
    net, opt = DistributedDataParallel(manager, model), Optimizer(manager, inner)
    for step in range(args.steps):
        x, y = data(1000 * args.replica + step, args.batch)
        opt.zero_grad()  # the quorum of this step
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()  # after the gradients' all-reduce, if every replica succeeded
        runtime.log(step=step, total=args.steps, loss=loss.item(), mode=args.mode, **sent)
    del net, opt
else:
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every, pin_memory=False):
        for step in range(args.steps):
            x, y = data(1000 * args.replica + step, args.batch)
            inner.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            inner.step()  # DiLoCo's hook syncs after every --sync-every of these
            runtime.log(step=step, total=args.steps, loss=loss.item(), mode=args.mode, **sent)

x, y = data(99_999, 2048)  # held out: no replica trains on this seed
with torch.no_grad():
    held_out = nn.functional.mse_loss(model(x), y).item()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:12]
params = sum(p.numel() for p in model.parameters())
runtime.log(final=True, mode=args.mode, held_out=held_out, digest=digest, params=params,
            param_bytes=params * 4, syncs=manager.current_step(), **sent)
print(f"{args.mode} replica {args.replica}: held-out loss {held_out:.4f}, {sent['calls']} all-reduces, "
      f"{sent['bytes']} bytes sent into them", flush=True)
manager.shutdown(wait=False)
del manager
runtime.teardown()
