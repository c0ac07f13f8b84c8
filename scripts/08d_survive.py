"""Chapter 08d: one replica group of a fault-tolerant HSDP job: FSDP2 inside the group, torchft across groups (gloo).

Every replica group is its own torchrun job of N ranks (its launch's --nproc; N = 1 is plain replication); the groups
find each other through torchft's Lighthouse ($TORCHFT_LIGHTHOUSE), which forms a quorum of the live groups before
every step. Inside a group, FSDP2 shards the model over the group's N ranks (fully_shard on a 1-D mesh of them): rank
r holds shard r of every parameter, of its gradient and of the optimizer state, and takes 1/N of the group's batch.
Across groups, each rank's torchft Manager reconfigures a ProcessGroupGloo over the same rank of every group in the
quorum (the replicate dimension of a groups x N mesh, rebuilt when the quorum changes), and FSDP2's all-reduce hook
averages each gradient shard over it through torchft's ManagedProcessGroup (torchft's HSDP, wired as torchtitan
does). The optimizer steps only when every rank of every group in the quorum says the step succeeded (should_commit).

On its first attempt, rank --kill-rank of group --kill-replica SIGKILLs itself in step --kill-at, after its forward
pass and before its backward (as chapter 08's rank kills itself). Its group's other ranks fail in FSDP2's
reduce-scatter and torchrun restarts the whole group (--max-restarts 1). The other groups' all-reduce with it fails,
every one of them drops that step (should_commit says no), and they carry on alone: no job restarts. The restarted
group waits until the others have committed --down-steps steps past the one it died in (a replacement machine takes
a while; on an idle machine the restart alone can be quick enough to rejoin the very step that failed), joins the
next quorum, and each of its ranks receives its own shards of the model and of the optimizer state, and the step
count, from the same rank of a peer group over torchft's checkpoint transport (HTTP), then trains on in step with the
others.

Before each step every rank compares its shards with the same rank's in the other groups bit for bit (an all-reduce
of their int32 bit patterns, max and -min): a shard that differs stops the run. Each step logs the step, the groups
in the quorum, the loss of the rank's part of the batch and a digest of its shards.
"""
import argparse
import hashlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from torchft import Manager, Optimizer, ProcessGroupGloo
from torchft.process_group import ManagedProcessGroup

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--replica", type=int, required=True, help="this replica group's index")
parser.add_argument("--replicas", type=int, default=2, help="replica groups in the job")
parser.add_argument("--steps", type=int, default=60, help="train at least until this step is committed")
parser.add_argument("--together", type=int, default=10, help="... and until this many steps ran with every replica")
parser.add_argument("--max-steps", type=int, default=2000, help="give up (fail) at this step")
parser.add_argument("--kill-at", type=int, default=-1, help="--kill-replica dies in this step (attempt 0)")
parser.add_argument("--kill-replica", type=int, default=1)
parser.add_argument("--kill-rank", type=int, default=-1, help="the rank of --kill-replica that dies (default: its "
                    "last; rank 0 also hosts the group's Manager server)")
parser.add_argument("--down-steps", type=int, default=3, help="the killed replica comes back once the others have "
                    "committed this many steps past --kill-at (a replacement takes a while to come up)")
parser.add_argument("--step-s", type=float, default=0.05, help="seconds each step lasts at least (pacing)")
parser.add_argument("--batch", type=int, default=16, help="samples per replica group per step (split over its ranks)")
parser.add_argument("--start-dir", required=True, help="a folder the replicas meet in before the first step")
args = parser.parse_args()

torch.use_deterministic_algorithms(True)
ctx = runtime.setup(seed=0, seed_per_rank=False, cuda_with_gloo=False)  # this group's ranks; same model everywhere
if args.batch % ctx.world_size:
    parser.error(f"--batch {args.batch} must split evenly over the group's {ctx.world_size} ranks")
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
start = Path(args.start_dir)  # where the replicas meet before step 0 and say how far they got
if attempt > 0:  # back from the dead, like a replacement machine: not before the others went on without us
    deadline = time.monotonic() + 120
    while max((int(f.read_text() or 0) for f in start.glob("progress*")), default=0) < args.kill_at + args.down_steps:
        if time.monotonic() > deadline:
            raise TimeoutError("the other replicas never got past the step this one died in")
        time.sleep(0.05)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))  # inside the group: rank r keeps shard r
inner = torch.optim.AdamW(model.parameters(), lr=1e-2)  # on the shards: its state is sharded the same way
true_w = torch.linspace(-1, 1, 8)


def state_dict():
    """What this rank sends the same rank of a returning group: its shards (plain tensors) of the model and the
    optimizer state."""
    return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t,
                    {"model": model.state_dict(), "optim": inner.state_dict()})


def load_state_dict(state):
    """A peer's shards into this rank's: copied into the parameters' shards; the optimizer's tensors shaped like a
    shard become DTensors sharded like their parameter (a restarted optimizer has no state of its own yet)."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, shard in state["model"].items():
            named[name].to_local().copy_(shard)
    params = list(model.parameters())  # the optimizer's state is keyed by the parameters' order
    for i, s in state["optim"]["state"].items():
        p = params[i]
        s.update({k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                  for k, v in s.items() if torch.is_tensor(v) and v.shape == p.to_local().shape})
    inner.load_state_dict(state["optim"])


manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                  load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica{args.replica}",
                  use_async_quorum=False, timeout=timedelta(seconds=20), quorum_timeout=timedelta(seconds=60),
                  rank=ctx.rank, world_size=ctx.world_size, hostname="127.0.0.1")
across = ManagedProcessGroup(manager)  # this rank and the same rank of every group in the quorum; errors recorded


def average_across_groups(shard_grad):
    """FSDP2's all-reduce hook: runs on each gradient shard after the group's reduce-scatter. If a peer died, the
    Manager records the error (should_commit will say no) and the shard is garbage, never applied."""
    dist.all_reduce(shard_grad, group=across, op=ReduceOp.AVG)


model.set_all_reduce_hook(average_across_groups)
opt = Optimizer(manager, inner)


def batch(step: int):
    """This rank's part of its group's batch of `step`: the group's batch is a function of (step, replica) alone."""
    g = torch.Generator().manual_seed(1000 * args.replica + step)
    x = torch.randn(args.batch, 8, generator=g)
    y = torch.tanh(x @ true_w).unsqueeze(1)
    return x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]


@torch.no_grad()
def shards() -> list[torch.Tensor]:
    """This rank's shard of every parameter (empty where a parameter has fewer rows than the group has ranks)."""
    return [p.to_local().detach() for p in model.parameters()]


def same_everywhere() -> bool:
    """True when this rank's shards equal, bit for bit, the same rank's in every group of the quorum (False if the
    check itself failed)."""
    bits = torch.cat([s.reshape(-1).view(torch.int32) for s in shards()]).to(torch.int64)
    both = torch.cat([bits, -bits])
    manager.allreduce(both, reduce_op=ReduceOp.MAX).wait()
    if manager.errored():
        return False
    n = bits.numel()
    return bool(torch.equal(both[:n], -both[n:]))


def digest() -> str:
    return hashlib.sha256(b"".join(s.numpy().tobytes() for s in shards())).hexdigest()[:12]


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
    opt.zero_grad()  # torchft: the quorum for this step (and, for a returning replica, its shards from a peer)
    healed = step != manager.current_step()
    step, members = manager.current_step(), manager.num_participants()
    if healed:
        print(f"replica {args.replica} rank {ctx.rank}: recovered its shards from a peer at step {step}", flush=True)
    checked = same_everywhere()
    if not checked and not manager.errored():
        raise AssertionError(f"replica {args.replica} rank {ctx.rank}: shards differ from a peer's at step {step}")
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y)  # FSDP2: all-gathers the parameters from the group's shards
    if attempt == 0 and args.replica == args.kill_replica and ctx.rank == args.kill_rank % ctx.world_size \
            and step == args.kill_at:
        print(f"replica {args.replica} rank {ctx.rank}: SIGKILL in step {step}, before its backward", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no clean-up: a machine that dies mid-step
    loss.backward()  # reduce-scatter inside the group, then the hook's all-reduce across groups
    opt.step()  # torchft: steps the optimizer only if every rank of every group in the quorum succeeded
    committed = manager.current_step() == step + 1
    if members != last_members:
        print(f"replica {args.replica} rank {ctx.rank}: step {step}, {members} replica(s) in the quorum", flush=True)
        last_members = members
    together = together + 1 if committed and members == args.replicas else 0 if members < args.replicas else together
    # no total: the run ends once --steps are committed AND --together steps ran with every replica (a bar would
    # read 206/60 after a long recovery); the live view counts the steps instead
    runtime.log(step=step, loss=loss.item(), replicas=members, committed=committed,
                same=checked, healed=healed, attempt=attempt, replica=args.replica, digest=digest(),
                batches=manager.batches_committed(), t=time.time())
    if committed and ctx.rank == 0:  # how far this group got, for a returning one (written whole, renamed: read whole)
        (start / f".progress{args.replica}").write_text(str(manager.current_step()))
        (start / f".progress{args.replica}").replace(start / f"progress{args.replica}")
    if committed and manager.current_step() >= args.steps and together >= args.together:
        break
    time.sleep(max(0.0, args.step_s - (time.monotonic() - t0)))

print(f"replica {args.replica} rank {ctx.rank}: done at step {manager.current_step()}, {manager.batches_committed()} "
      f"batches committed", flush=True)
manager.shutdown(wait=False)
del opt, across, manager  # before the process group goes (PITFALLS: gloo can abort at exit otherwise)
runtime.teardown()
