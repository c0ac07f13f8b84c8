"""Chapter 08: a checkpoint written under one parallel layout, resumed under another.

A small float64 MLP trains with AdamW under one of three layouts (--layout):
  fsdp      FSDP2 fully_shard over a 1-D mesh of every rank
  fsdp-tp   a (dp, tp) mesh: tensor parallel over "tp" (parallelize_module), FSDP2 over "dp"
  hsdp      a (replicate, shard) mesh: FSDP2 shards over "shard" and replicates over "replicate"
The world size is the number of ranks the job was launched with; --tp and --replicate set the second dimension.

The data come from a loader whose GLOBAL batch order does not depend on the world size: a seeded permutation of
the sample ids, cut into global batches of --batch ids; each data-parallel rank takes its slice of the batch. Its
whole state is how many samples it has consumed. At --save-at S (after step S) every rank saves the model, the
optimizer (get_state_dict: sharded, keyed by parameter name) and the loader's state with
torch.distributed.checkpoint (DCP); --resume-from DIR loads them under any layout and world size (DCP reshards on
load) and continues at step S + 1. Every step logs the float64 loss of the global batch and the sample ids the data-
parallel ranks used, gathered.

The two mistakes:
  --drop-loader-state  resume the model and optimizer but not the loader: it starts again at sample 0
  --torch-save         also save each rank's sharded state dict with a plain torch.save (rankN.pt); with
                       --resume-from, load that instead of DCP's checkpoint

    gpucourse dryrun scripts/08_reshard.py --world 1024 -- --layout fsdp-tp --steps 2 --batch 1024 --samples 2048
runs it as ranks 0 and 1023 of 1,024 (FSDP over 512 x TP 2) with a fake process group; no checkpoint is written
at that size unless --save-at asks (DCP then writes each rank's shards for real).
"""
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--layout", choices=["fsdp", "fsdp-tp", "hsdp"], default="fsdp")
parser.add_argument("--tp", type=int, default=2, help="fsdp-tp: ranks per tensor-parallel group")
parser.add_argument("--replicate", type=int, default=2, help="hsdp: replicas (each shards over world/replicate)")
parser.add_argument("--steps", type=int, default=31, help="train steps 0 .. steps-1")
parser.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
parser.add_argument("--samples", type=int, default=512, help="samples in the synthetic data set")
parser.add_argument("--hidden", type=int, default=32)
parser.add_argument("--save-at", type=int, default=-1, help="save a checkpoint after this step")
parser.add_argument("--ckpt-dir", default=None, help="where --save-at writes (default: <run dir>/checkpoint)")
parser.add_argument("--resume-from", default=None, help="a checkpoint folder to continue from")
parser.add_argument("--drop-loader-state", action="store_true", help="mistake: resume without the loader's state")
parser.add_argument("--torch-save", action="store_true", help="mistake: plain torch.save of each rank's shards")
args = parser.parse_args()

torch.use_deterministic_algorithms(True)
torch.set_default_dtype(torch.float64)  # float64: two runs that agree to 1e-10 agree, not merely look alike
ctx = runtime.setup(seed=0, seed_per_rank=False, cuda_with_gloo=False)  # the same initial model on every rank
world = ctx.world_size
second = {"fsdp": 1, "fsdp-tp": args.tp, "hsdp": args.replicate}[args.layout]
if second < 1 or world % second:
    parser.error(f"--layout {args.layout} needs a world size divisible by {second}; this job has {world} ranks")
dp = world // second if args.layout == "fsdp-tp" else world  # data-parallel ranks: each takes a slice
if args.batch % dp:
    parser.error(f"--batch {args.batch} does not split evenly over {dp} data-parallel ranks")
if args.save_at >= args.steps:
    parser.error(f"--save-at {args.save_at} is never reached: the run ends after step {args.steps - 1}")
if args.drop_loader_state and not args.resume_from:
    parser.error("--drop-loader-state only changes how a run resumes: give --resume-from too")
if args.resume_from and not Path(args.resume_from, ".metadata").is_file():
    parser.error(f"--resume-from {args.resume_from}: not a DCP checkpoint (no .metadata file in it)")
if args.resume_from and args.torch_save and not Path(args.resume_from, f"rank{ctx.rank}.pt").is_file():
    parser.error(f"--resume-from {args.resume_from} --torch-save: no rank{ctx.rank}.pt (saved without --torch-save?)")


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)  # column-parallel under TP: each tp rank computes half the features
        self.fc2 = nn.Linear(hidden, hidden)  # row-parallel: partial sums, all-reduced over tp
        self.head = nn.Linear(hidden, 1)  # whole on every tp rank

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def build():
    """(model, data-parallel group, this rank's index among the data-parallel ranks) for --layout."""
    model = MLP(8, args.hidden).to(ctx.device)
    if args.layout == "fsdp":  # a 1-D mesh: a (1, N) one would add 1-rank all-reduces
        mesh = init_device_mesh(ctx.device.type, (world,), mesh_dim_names=("dp",))
        shard_mesh, dp_group, dp_rank = mesh, mesh.get_group(), mesh.get_local_rank()
    elif args.layout == "fsdp-tp":
        mesh = init_device_mesh(ctx.device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        shard_mesh, dp_group, dp_rank = mesh["dp"], mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    else:  # HSDP: fully_shard reads a 2-D mesh as (replicate, shard)
        shard_mesh = init_device_mesh(ctx.device.type, (args.replicate, world // args.replicate),
                                      mesh_dim_names=("replicate", "shard"))
        dp_group, dp_rank = dist.group.WORLD, ctx.rank
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer, mesh=shard_mesh)
    return fully_shard(model, mesh=shard_mesh), dp_group, dp_rank


class GlobalOrderLoader:
    """Global batches of sample ids in an order fixed by the seed alone: epoch e is a permutation drawn from
    seed + e, and each step takes the next `batch` ids of that endless stream. The world size only decides how a
    global batch is cut into slices. Its state is one number, the samples consumed so far."""

    def __init__(self, samples: int, batch: int, seed: int = 0):
        self.samples, self.batch, self.seed, self.consumed = samples, batch, seed, 0
        self._perms = {}  # epoch -> its permutation, drawn once

    def next_batch(self) -> torch.Tensor:
        ids = [self._id(i) for i in range(self.consumed, self.consumed + self.batch)]
        self.consumed += self.batch
        return torch.tensor(ids, dtype=torch.int64)

    def _id(self, position: int) -> int:
        epoch, index = divmod(position, self.samples)
        if epoch not in self._perms:
            seeded = torch.Generator().manual_seed(self.seed + epoch)
            self._perms[epoch] = torch.randperm(self.samples, generator=seeded)
        return int(self._perms[epoch][index])

    def state_dict(self) -> dict:
        return {"consumed": torch.tensor(self.consumed)}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


model, dp_group, dp_rank = build()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
loader = GlobalOrderLoader(args.samples, args.batch)
data = torch.Generator().manual_seed(1234)
X = torch.randn(args.samples, 8, generator=data)
Y = torch.sin(X @ torch.linspace(-1, 1, 8)).unsqueeze(1)
per = args.batch // dp


def save(step: int) -> None:
    msd, osd = get_state_dict(model, opt)
    path = Path(args.ckpt_dir or ctx.run_dir / "checkpoint")
    dcp.save({"model": msd, "optim": osd, "loader": loader.state_dict(), "step": torch.tensor(step)},
             checkpoint_id=str(path))
    if args.torch_save:  # the mistake: each rank pickles its own shards, laid out for this world size
        torch.save({"model": msd, "optim": osd, "loader": loader.state_dict(), "step": step},
                   path / f"rank{ctx.rank}.pt")
    dist.barrier()
    print(f"rank {ctx.rank}: saved step {step} under {args.layout} at world {world} to {path}", flush=True)


def resume(path: Path) -> int:
    """Load the checkpoint at `path` into this layout; return the first step to run."""
    msd, osd = get_state_dict(model, opt)  # the structure to load into: this layout's shards
    if args.torch_save:
        state = torch.load(path / f"rank{ctx.rank}.pt", weights_only=False)
        step = int(state["step"])
    else:
        state = {"model": msd, "optim": osd, "step": torch.tensor(-1)}
        if not args.drop_loader_state:
            state["loader"] = loader.state_dict()
        dcp.load(state, checkpoint_id=str(path))  # DCP reads the parts of the saved tensors this rank holds
        step = int(state["step"])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "loader" in state:
        loader.load_state_dict(state["loader"])
    print(f"rank {ctx.rank}: resumed step {step} under {args.layout} at world {world}; loader at sample "
          f"{loader.consumed}", flush=True)
    return step + 1


start = resume(Path(args.resume_from)) if args.resume_from else 0
for step in range(start, args.steps):
    ids = loader.next_batch()
    mine = ids[dp_rank * per:(dp_rank + 1) * per]
    loss = nn.functional.mse_loss(model(X[mine].to(ctx.device)), Y[mine].to(ctx.device))
    opt.zero_grad()
    loss.backward()  # FSDP averages the gradients over the data-parallel ranks
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=dp_group)  # every slice is the same size: the global batch's loss
    seen = torch.empty(args.batch, dtype=torch.int64)
    runtime.all_gather_single(seen, mine, group=dp_group)  # the ids the data-parallel ranks actually used
    runtime.log(step=step, total=args.steps, loss=runtime.value(mean / dp), ids=seen.tolist(),
                layout=args.layout, world=world)
    if step == args.save_at:
        save(step)

runtime.teardown()
