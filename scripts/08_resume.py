"""Train with checkpoints; on the first attempt one rank kills itself; the restarted job resumes.

Every `--ckpt-every` steps all ranks save model + optimizer state with torch.distributed.checkpoint
(each rank writes its own file, rank 0 the metadata); rank 0 then records the step in `latest` (written
to a temporary file and renamed, so a crash mid-save never leaves a pointer to half a checkpoint).
On start, every rank loads the checkpoint `latest` names, if any, and continues from the next step.

A resumed run equals an uninterrupted one bit for bit, at any world size, because the restarted job
reproduces everything a step depends on:
- the parameters and the optimizer's state (AdamW's moments and step count): in the checkpoint;
- the data position: each step's batch is a function of the step number alone, never of how many steps
  this process has run;
- random numbers: fixed seeds, and nothing random during training (a model with dropout would also have
  to save and restore every rank's generator state); torch.use_deterministic_algorithms;
- the order in which gradients are summed: DDP's gradient buckets, which a new DDP model lays out
  differently from the one that had run a step (see rebuild_buckets).
"""
import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--ckpt-every", type=int, default=5)
parser.add_argument("--kill-at", type=int, default=-1, help="step at which --kill-rank dies (first attempt only)")
parser.add_argument("--kill-rank", type=int, default=0)
parser.add_argument("--ckpt-dir", default=None, help="default: <run dir>/checkpoints")
parser.add_argument("--batch", type=int, default=24, help="global batch, split evenly over the ranks")
parser.add_argument("--resume-from", default=None, help="a checkpoint (.../stepNNNNN) to start from, if none of our own")
args = parser.parse_args()

torch.use_deterministic_algorithms(True)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # on a GPU, cuBLAS is deterministic only so
ctx = runtime.setup(seed=0, seed_per_rank=False)  # same initial model on every rank
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # 0, then 1 after the first restart
if args.batch % ctx.world_size:
    parser.error(f"--batch {args.batch} does not split evenly over {ctx.world_size} ranks")
ckpt_dir = Path(args.ckpt_dir or ctx.run_dir / "checkpoints")
latest = ckpt_dir / "latest"

model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(ctx.device))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
true_w = torch.linspace(-1, 1, 8)


def batch(step: int):
    """This rank's slice of the global batch of `step`: a function of the step alone."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(args.batch, 8, generator=g)
    y = torch.tanh(x @ true_w).unsqueeze(1)
    per = args.batch // ctx.world_size  # whole global batch, no sample dropped: checked above
    mine = slice(ctx.rank * per, (ctx.rank + 1) * per)
    return x[mine].to(ctx.device), y[mine].to(ctx.device)


def save(step: int) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt_dir / f"step{step:05d}"))
    dist.barrier()  # every rank's shard is on disk before the pointer moves
    if ctx.rank == 0:
        tmp = latest.with_suffix(".tmp")
        tmp.write_text(str(step))
        tmp.replace(latest)


def resume() -> int:
    """Load the last complete checkpoint (else --resume-from, else nothing); return the first step to run."""
    if latest.exists():
        path = ckpt_dir / f"step{int(latest.read_text()):05d}"
    elif args.resume_from:  # e.g. written by a job of another world size: DCP loads it at ours
        path = Path(args.resume_from)
    else:
        return 0
    msd, osd = get_state_dict(model, opt)  # the structure to load into (optimizer state included)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(path.name.removeprefix("step")) + 1


def rebuild_buckets(step: int) -> None:
    """Give the restarted DDP the gradient buckets the uninterrupted run had at `step`: one backward, then nothing.

    A new DDP model puts the gradients in one bucket in the order the parameters were defined. Its first
    backward records the order in which the gradients became ready, and the next forward rebuilds the bucket
    in that order (here the reverse). The uninterrupted run did so after its step 0; a restarted job would
    run its first step on the first-iteration layout. With 3 or more ranks, gloo's ring all-reduce adds the
    ranks' values of an element in an order that depends on where the element sits in the bucket, so the
    same gradients can sum to a different last bit. This backward's gradients are thrown away and no
    optimizer step follows: only the layout changes. (With static_graph=True, DDP rebuilds one iteration
    later: it would need two.)
    """
    x, y = batch(step)
    nn.functional.mse_loss(model(x), y).backward()
    opt.zero_grad()


start = resume()
if start > 0:  # the uninterrupted run had rebuilt its buckets by this step: so must we
    rebuild_buckets(start)
print(f"attempt {attempt}: rank {ctx.rank}/{ctx.world_size} starts at step {start}", flush=True)
for step in range(start, args.steps):
    if attempt == 0 and step == args.kill_at and ctx.rank == args.kill_rank:
        print(f"rank {ctx.rank}: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no cleanup: like a machine that dies
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # gloo has no AVG: sum, then divide
    runtime.log(step=step, total=args.steps, loss=mean_loss.item() / ctx.world_size, attempt=attempt)
    if (step + 1) % args.ckpt_every == 0:
        save(step)

if ctx.rank == 0:  # DDP keeps the replicas identical: rank 0's copy is the model
    torch.save({k: v.cpu() for k, v in model.module.state_dict().items()}, ctx.run_dir / "final_params.pt")
runtime.teardown()
