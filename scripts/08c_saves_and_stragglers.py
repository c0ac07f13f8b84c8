"""Chapter 08c: what a checkpoint costs the training loop, blocking or asynchronous, and what one slow rank costs.

One DDP job, in phases (the batch of step s is a function of s alone, whatever the phase):
  healthy   --steps steps, nothing else
  slow      --steps steps in which rank --slow-rank sleeps --slow-s seconds before its forward (a slow disk, a
            throttled GPU, a noisy neighbour: slowed, not stuck)
  blocking  --steps steps; every --save-every steps, dcp.save: the loop waits until every rank's file is written
  async     --steps steps; every --save-every steps, dcp.async_save: the loop waits only while the state is copied
            (staged); a thread writes the copy while the next steps run. Before the next save, the loop waits for
            the previous one to finish (a second upload never overlaps the first).
  resume    a fresh DDP model and optimizer load the last asynchronous checkpoint and replay the steps after it;
            their parameters and AdamW state are compared, bit for bit, with the ones that never stopped.

async_save runs its own collectives (it gathers the ranks' save plans) from its thread while the main thread
all-reduces gradients: both on one process group, the two streams of collectives interleave differently on each
rank and the job hangs. So the saves get a process group of their own (dist.new_group).

Each rank logs every step's wall time (step_s) and, per save, how long the loop was blocked (blocked_s) and when the
write finished (upload_s, from the start of the save). After the slow phase each rank dumps its Flight Recorder:
when it called every collective (time_created_ns), which is how the chapter finds the slow rank.
"""
import argparse
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # under plain torchrun too: the slow rank is read from it

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime
from gpucourse.run import forensics


class Unstaged(AsyncStager):
    """--unstaged: a stager that copies nothing; the writer thread reads the live parameters and optimizer state."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

parser = argparse.ArgumentParser()
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
parser.add_argument("--warmup", type=int, default=2, help="steps before the healthy phase (first steps are slow)")
parser.add_argument("--steps", type=int, default=9, help="steps of each phase")
parser.add_argument("--save-every", type=int, default=3)
parser.add_argument("--slow-rank", type=int, default=1)
parser.add_argument("--slow-s", type=float, default=0.4, help="seconds the slow rank sleeps each step")
parser.add_argument("--ckpt-dir", default=None, help="default: <run dir>/checkpoints")
parser.add_argument("--keep-checkpoints", action="store_true", help="else removed at the end (they are large)")
parser.add_argument("--unstaged", action="store_true", help="the mistake: async_save hands the live tensors to its "
                    "writer thread, no copy (the steps that follow change them while it writes)")
args = parser.parse_args()

torch.set_num_threads(1)  # two ranks on two cores: one thread each
torch.use_deterministic_algorithms(True)
ctx = runtime.setup(seed=0, seed_per_rank=False)
if not 0 <= args.slow_rank < ctx.world_size or args.save_every > args.steps:
    parser.error(f"--slow-rank must be a rank (0..{ctx.world_size - 1}); --save-every at most --steps")
ckpt_dir = Path(args.ckpt_dir or ctx.run_dir / "checkpoints")
save_group = dist.new_group(backend="gloo")  # async_save's collectives: never on the training's group


def make_model():
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.Tanh())]
    model = DDP(nn.Sequential(*layers, nn.Linear(args.hidden, 1)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + ctx.rank)
    x = torch.randn(args.batch, args.hidden, generator=g)
    return x, x[:, :1].sin()


def train_step(model, opt, step: int, slow: bool = False) -> None:
    if slow and ctx.rank == args.slow_rank:
        time.sleep(args.slow_s)
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # DDP all-reduces the gradients here: every rank waits for the last one to arrive
    opt.step()


def state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


model, opt = make_model()
step, total = 0, args.warmup + 4 * args.steps
pending = None  # the asynchronous save still being written: (its step, future, start time, [finish time])
async_saves = []  # the steps after which an asynchronous save started


def run(phase: str, steps: int) -> None:
    global step, pending
    for i in range(steps):
        t0, start, saved = time.perf_counter(), time.time(), None
        train_step(model, opt, step, slow=phase == "slow")
        if phase in ("blocking", "async") and (i + 1) % args.save_every == 0:  # after each save_every steps
            saved, b0 = step, time.perf_counter()
            path = str(ckpt_dir / f"{phase}{step:05d}")
            if phase == "blocking":
                dcp.save(state(model, opt), checkpoint_id=path)  # complete when it returns
            else:
                finish_previous()  # the previous write must be done before a new one starts
                done = []
                future = dcp.async_save(state(model, opt), checkpoint_id=path, process_group=save_group,
                                        async_stager=Unstaged() if args.unstaged else None)
                future.add_done_callback(lambda _, done=done: done.append(time.perf_counter()))
                pending = (step, future, b0, done)
                async_saves.append(step)
            blocked = time.perf_counter() - b0
            written = {"upload_s": blocked} if phase == "blocking" else {}  # async: logged when its write ends
            runtime.log(save=phase, at=step, blocked_s=blocked, **written)
        runtime.log(step=step, total=total, phase=phase, step_s=time.perf_counter() - t0, start=start,
                    end=time.time(), saved=saved, writing=pending is not None and not pending[1].done())
        step += 1


def finish_previous() -> None:
    """Wait for the asynchronous save in flight (if any); log when its files were complete."""
    global pending
    if pending is not None:
        at, future, b0, done = pending
        future.result()
        while not done:  # the callback runs right after result() returns
            time.sleep(0.001)
        runtime.log(save="async-done", at=at, upload_s=done[0] - b0)
        pending = None


run("warmup", args.warmup)
run("healthy", args.steps)
run("slow", args.steps)
forensics.dump(ctx.run_dir, ctx.rank, "after the slow phase")  # every collective's arrival time, per rank
run("blocking", args.steps)
run("async", args.steps)
drain = time.perf_counter()
finish_previous()  # the last write: it would have run beside the next steps; the loop waits for it here
runtime.log(save="async-drain", wait_s=time.perf_counter() - drain)
first_async = async_saves[0]  # the next steps ran while it was written: they must not leak into it

# Resume: a fresh model and optimizer load the last asynchronous checkpoint and replay the steps after it.
fresh, fresh_opt = make_model()
loaded = state(fresh, fresh_opt)
dcp.load(loaded, checkpoint_id=str(ckpt_dir / f"async{first_async:05d}"))
set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
for s in range(first_async + 1, step):
    train_step(fresh, fresh_opt, s)
same, worst = True, 0.0
for a, b in zip(state(model, opt)["model"].values(), state(fresh, fresh_opt)["model"].values()):
    same &= torch.equal(a, b)
    worst = max(worst, (a - b).abs().max().item())
for mine, theirs in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values()):
    same &= all(torch.equal(mine[n], theirs[n]) for n in mine)  # AdamW's step, exp_avg, exp_avg_sq
size = sum(p.stat().st_size for p in (ckpt_dir / f"async{first_async:05d}").iterdir())
runtime.log(resumed_from=first_async, replayed=step - 1 - first_async, bitwise_equal=bool(same), max_abs_diff=worst,
            checkpoint_bytes=size, params=sum(p.numel() for p in model.parameters()))
dist.barrier()
if ctx.rank == 0 and not args.keep_checkpoints:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
del model, fresh  # before the process group goes (chapter 08's exit-time abort)
runtime.teardown()
