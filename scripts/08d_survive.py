"""Chapter 08d: one replica group of a fault-tolerant data-parallel job (torchft on gloo).

Every replica group is its own torchrun job; the groups find each other through torchft's Lighthouse
($TORCHFT_LIGHTHOUSE), which forms a quorum before every step. torchft's Manager reconfigures a ProcessGroupGloo
across the replicas in the quorum, torchft's DistributedDataParallel (with a gradient hook of ours: FaultTolerantDDP) averages
the gradients over it, and the optimizer steps only when every replica in the quorum says the step succeeded (should_commit).

On its first attempt, replica --kill-replica SIGKILLs itself in step --kill-at, after its forward pass and before the
gradients' all-reduce (as chapter 08's rank kills itself). The others' all-reduce fails, every one of them drops that
step (should_commit says no), and they carry on alone: no job restarts. torchrun restarts the dead
replica's worker (--max-restarts 1), which waits until the others have committed --down-steps steps past the one
it died in (a replacement machine takes a while; on an idle machine the restart alone can be quick enough to rejoin
the very step that failed): its new Manager joins the next quorum and receives the model, the optimizer and the
step count from a peer over torchft's checkpoint transport (HTTP), then trains on in step with the others.

Before each step every replica compares its parameters with the others' bit for bit (an all-reduce of their int32
bit patterns, max and -min): a replica that differs stops the run. Each step logs the step, the replicas in the
quorum, the loss and a digest of the parameters.
"""
import argparse
import hashlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributed import ReduceOp
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--replica", type=int, required=True, help="this replica group's index")
parser.add_argument("--replicas", type=int, default=2, help="replica groups in the job")
parser.add_argument("--steps", type=int, default=60, help="train at least until this step is committed")
parser.add_argument("--together", type=int, default=10, help="... and until this many steps ran with every replica")
parser.add_argument("--max-steps", type=int, default=2000, help="give up (fail) at this step")
parser.add_argument("--kill-at", type=int, default=-1, help="--kill-replica dies in this step (attempt 0)")
parser.add_argument("--kill-replica", type=int, default=1)
parser.add_argument("--down-steps", type=int, default=3, help="the killed replica comes back once the others have "
                    "committed this many steps past --kill-at (a replacement takes a while to come up)")
parser.add_argument("--step-s", type=float, default=0.05, help="seconds each step lasts at least (pacing)")
parser.add_argument("--batch", type=int, default=16, help="samples per replica per step")
parser.add_argument("--start-dir", required=True, help="a folder the replicas meet in before the first step")
args = parser.parse_args()

torch.use_deterministic_algorithms(True)
ctx = runtime.setup(seed=0, seed_per_rank=False)  # the replica group's own ranks (here: one)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
start = Path(args.start_dir)  # where the replicas meet before step 0 and say how far they got
if attempt > 0:  # back from the dead, like a replacement machine: not before the others went on without us
    deadline = time.monotonic() + 120
    while max((int(f.read_text() or 0) for f in start.glob("progress*")), default=0) < args.kill_at + args.down_steps:
        if time.monotonic() > deadline:
            raise TimeoutError("the other replicas never got past the step this one died in")
        time.sleep(0.05)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
true_w = torch.linspace(-1, 1, 8)


def state_dict():
    return {"model": model.state_dict(), "optim": inner.state_dict()}


def load_state_dict(state):
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])


manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                  load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica{args.replica}",
                  use_async_quorum=False, timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=60),
                  rank=ctx.rank, world_size=ctx.world_size, hostname="127.0.0.1")


class FaultTolerantDDP(DistributedDataParallel):
    """torchft's DistributedDataParallel with a gradient hook that survives a peer dying mid-all-reduce on gloo.

    torchft 0.2.0's hook calls work.wait(), then asserts that the work's future was set up; on gloo the wait raises
    "Connection closed by peer", torchft records the error for should_commit, and the future is never set up: the
    assert kills the survivor too (the chapter shows the smallest reproduction). This hook waits the same way and
    hands DDP the bucket whatever happened: after an error its contents are garbage, but should_commit says no and
    the optimizer never sees them.
    """

    @staticmethod
    def _comm_hook(manager, bucket):
        manager.allreduce(bucket.buffer()).wait()  # the average over the quorum; False (error recorded) if a peer died
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


ddp = FaultTolerantDDP(manager, model)
opt = Optimizer(manager, inner)


def batch(step: int):
    """This replica's batch of `step`: a function of (step, replica) alone."""
    g = torch.Generator().manual_seed(1000 * args.replica + step)
    x = torch.randn(args.batch, 8, generator=g)
    return x, torch.tanh(x @ true_w).unsqueeze(1)


def same_everywhere() -> bool:
    """True when every replica in the quorum holds bit-identical parameters (False if the check itself failed)."""
    bits = torch.cat([p.detach().reshape(-1).view(torch.int32) for p in model.parameters()]).to(torch.int64)
    both = torch.cat([bits, -bits])
    manager.allreduce(both, reduce_op=ReduceOp.MAX).wait()
    if manager.errored():
        return False
    n = bits.numel()
    return bool(torch.equal(both[:n], -both[n:]))


def digest() -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:12]


if attempt == 0:  # meet the other replicas before the first quorum, so that all start at step 0
    (start / f"replica{args.replica}").touch()
    deadline = time.monotonic() + 120
    while len(list(start.glob("replica*"))) < args.replicas:
        if time.monotonic() > deadline:
            raise TimeoutError("the other replicas never started")
        time.sleep(0.05)

together, last_members = 0, None
while True:
    step = manager.current_step()
    if step >= args.max_steps:
        raise RuntimeError(f"gave up at step {step}: the replicas never trained {args.together} steps together")
    t0 = time.monotonic()
    opt.zero_grad()  # torchft: the quorum for this step (and, for a returning replica, its state from a peer)
    healed = step != manager.current_step()
    step, members = manager.current_step(), manager.num_participants()
    if healed:
        print(f"replica {args.replica}: recovered from a peer at step {step}", flush=True)
    checked = same_everywhere()
    if not checked and not manager.errored():
        raise AssertionError(f"replica {args.replica}: parameters differ from a peer's at step {step}")
    x, y = batch(step)
    loss = nn.functional.mse_loss(ddp(x), y)
    if attempt == 0 and args.replica == args.kill_replica and step == args.kill_at:
        print(f"replica {args.replica}: SIGKILL in step {step}, before its all-reduce", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no clean-up: a machine that dies mid-step
    loss.backward()  # torchft's DDP: the gradients' all-reduce over the quorum
    opt.step()  # torchft: steps the optimizer only if every replica in the quorum succeeded
    committed = manager.current_step() == step + 1
    if members != last_members:
        print(f"replica {args.replica}: step {step}, {members} replica(s) in the quorum", flush=True)
        last_members = members
    together = together + 1 if committed and members == args.replicas else 0 if members < args.replicas else together
    runtime.log(step=step, total=args.steps, loss=loss.item(), replicas=members, committed=committed,
                same=checked, healed=healed, attempt=attempt, replica=args.replica, digest=digest(),
                batches=manager.batches_committed(), t=time.time())
    if committed:  # how far this replica got, for a returning one (written whole, then renamed: read whole)
        (start / f".progress{args.replica}").write_text(str(manager.current_step()))
        (start / f".progress{args.replica}").replace(start / f"progress{args.replica}")
    if committed and manager.current_step() >= args.steps and together >= args.together:
        break
    time.sleep(max(0.0, args.step_s - (time.monotonic() - t0)))

print(f"replica {args.replica}: done at step {manager.current_step()}, {manager.batches_committed()} batches "
      f"committed", flush=True)
manager.shutdown(wait=False)
del ddp, opt, manager  # before the process group goes: gloo can abort at exit otherwise (PITFALLS)
runtime.teardown()
