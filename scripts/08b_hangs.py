"""Four classic ways to break a collective, one per --mode, for the chapter's debugging section, and a crash.

  mismatch   at step 1, rank 0 calls all_reduce, the others broadcast: different operations
  skip       at step 2, rank 1 skips the all_reduce every other rank calls ("if nothing to sync: continue")
  shape      at step 1, rank 0 all-reduces 4 numbers, the others 8: same operation, different sizes
  straggler  at step 1, rank 1 never arrives at the barrier (stuck in its own code); --monitored uses
             dist.monitored_barrier, which names the rank that did not arrive
  crash      at step 1, rank 1 kills itself (SIGKILL) once the others are in that step's all_reduce: no
             exception and no dump, as an out-of-memory kill or a lost node

--rank and --step choose another rank at fault and another step (exercise ex08_read_the_dumps's grader draws them).
--group tp or dp breaks a subgroup instead: the ranks form a 2 x N/2 mesh ("dp", "tp"), each step all-reduces
over its TP group then over its DP group, and the fault strikes the chosen group's collective of that step.

Every rank prints what it is about to do before each collective, so the last line of each rank's log
says where it stopped. Run with TORCH_DISTRIBUTED_DEBUG=DETAIL to have torch check every collective's
operation and shapes across ranks before running it.
"""
import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["mismatch", "skip", "shape", "straggler", "crash"], required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--rank", type=int, default=None, help="the rank at fault (default: 0 for mismatch and "
                    "shape, else 1)")
parser.add_argument("--step", type=int, default=None, help="the step it strikes at (default: 2 for skip, else 1)")
parser.add_argument("--monitored", action="store_true", help="straggler: use dist.monitored_barrier")
parser.add_argument("--group", choices=["world", "tp", "dp"], default="world", help="the process group at fault")
parser.add_argument("--collective-timeout", type=float, default=None, help="seconds (runtime.setup(timeout_s=))")
args = parser.parse_args()

ctx = runtime.setup(timeout_s=args.collective_timeout)
rank = ctx.rank
culprit = args.rank if args.rank is not None else 0 if args.mode in ("mismatch", "shape") else 1
at = args.step if args.step is not None else 2 if args.mode == "skip" else 1
if args.group == "world":
    mesh, groups = None, {"world": None}  # None: the default process group
else:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("dp", "tp"))
    groups = {"tp": mesh.get_group("tp"), "dp": mesh.get_group("dp")}


def say(text: str) -> None:
    print(f"rank {rank}: {text}", flush=True)


def collective(step: int, name: str, group) -> bool:
    """This step's collective over `group`, broken the --mode way if it is the step and group at fault. False
    when this rank skipped it."""
    where = "" if group is None else f" over {name} {dist.get_process_group_ranks(group)}"
    t = torch.full((4,), float(step + 1))
    fault = step == at and name == args.group
    if args.mode == "mismatch" and fault:
        op = "all_reduce" if rank == culprit else "broadcast"
        say(f"step {step}: {op}{where}")
        if rank == culprit:
            dist.all_reduce(t, group=group)
        else:  # from the culprit, or in a subgroup from its first rank
            dist.broadcast(t, src=culprit) if group is None else dist.broadcast(t, group=group, group_src=0)
    elif args.mode == "skip" and fault and rank == culprit:
        say(f"step {step}: skipping the all_reduce{where}")
        return False
    elif args.mode == "shape" and fault:
        t = torch.ones(4 if rank == culprit else 8)
        say(f"step {step}: all_reduce of {t.numel()} numbers{where}")
        dist.all_reduce(t, group=group)
    elif args.mode == "straggler" and fault:
        if rank == culprit:
            say(f"step {step}: busy in my own code (no collective)")
            time.sleep(3600)  # a deadlock, an endless loop, a dead disk: the rank never comes back
        say(f"step {step}: {'monitored_barrier' if args.monitored else 'barrier'}{where}")
        if args.monitored:
            dist.monitored_barrier(timeout=timedelta(seconds=5))  # rank 0 checks in every rank, one by one
        else:
            dist.barrier(group=group)
    elif args.mode == "crash" and fault:
        store = dist.distributed_c10d._get_default_store()
        if rank == culprit:  # once every other rank is inside this step's all_reduce
            say(f"step {step}: about to be killed")
            while store.add(f"entered{where}", 0) < dist.get_world_size(group) - 1:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        say(f"step {step}: all_reduce{where}")
        work = dist.all_reduce(t, group=group, async_op=True)
        store.add(f"entered{where}", 1)
        work.wait()
    else:
        say(f"step {step}: all_reduce{where}")
        dist.all_reduce(t, group=group)
        # Every rank put step + 1 in: the sum is the group's size * (step + 1) on every rank, unless desynchronised.
        say(f"step {step}: got {t[0].item():g} (expected {dist.get_world_size(group) * (step + 1)})")
    return True


for step in range(args.steps):
    if all([collective(step, name, group) for name, group in groups.items()]):  # a skip skips the log too
        runtime.log(step=step, total=args.steps)
say("done")
if args.mode == "skip" and rank == culprit:
    os._exit(0)  # gone without a goodbye: destroy_process_group could wait on peers stuck in the skipped collective
runtime.teardown()
