"""The grading job of ex07 part 2 (FSDP): every case for this job's world size, in one launch.

    ex07_fsdp_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex07_fsdp.py launches it on 1, 2 and 4 ranks. Each rank logs one record per case and saves what the
submission produced raw; the rank judges nothing. The grader process trains the unwrapped model in one process
itself (`reference`) and compares, e.g.

    {"case": "mlp", "group": "equiv", "raw": ["full"], "ops": [{"all_gather_into_tensor": [12, 4096], ...}, ...]}

Cases:
  mlp, tied    N ranks on their slices of a batch of 8 (mean loss); gather_full_params() after each of 3 steps is
               saved raw, for the grader to compare with one process training the unwrapped model with AdamW
               (mlp-sgd: SGD, which, unlike Adam, notices unaveraged gradients) on all 8; the layer
               sizes are not multiples of 4 (padding); tied: an embedding shared with the output layer.
               The collectives of forward + backward + finish_gradient_synchronization are recorded.
  memory       4 layers of 128x128: the bytes of the wrapper's parameters (the shards), tensors the wrapper holds
               besides them, and every tensor of at least one full weight's size created from forward to the end
               of finish_gradient_synchronization (a TorchDispatchMode keeps weak references): how many bytes of
               them are still alive after forward, and after finishing.
  bf16         compute_dtype=torch.bfloat16, SGD: the dtype a layer sees, the shards' and gradients' dtype, and the
               full parameters after each of 3 steps (the grader compares them with the fp32 one-process run).
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

from gpucourse.grading import jobkit  # what every grading job shares
from gpucourse.grading.graders.ex07_job_guard import CollectiveGuard, held_tensor_bytes

STEPS = 3
GLOBAL_BATCH = 8
WHY = "write the sharding yourself"
FORBID = {"torch.distributed.fsdp:fully_shard": WHY, "torch.distributed.fsdp:FullyShardedDataParallel": WHY,
          "torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel": WHY,
          "torch.distributed._composable.fsdp:fully_shard": WHY}
WEIGHT_BYTES = 128 * 128 * 4  # one full weight of the memory case's model


# --- models -----------------------------------------------------------------------------------------
def mlp() -> nn.Module:
    torch.manual_seed(1)  # sizes not divisible by 4: the shards need padding
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3))


TiedLM = functools.partial(jobkit.TiedLM, vocab=30, dim=10, seed=2)


def data(model: str):
    gen = torch.Generator().manual_seed(3)
    if model == "tied":
        return torch.randint(0, 30, (GLOBAL_BATCH,), generator=gen), \
            torch.randint(0, 30, (GLOBAL_BATCH,), generator=gen), nn.CrossEntropyLoss()
    if model == "memory":
        return torch.randn(GLOBAL_BATCH, 128, generator=gen), torch.randn(GLOBAL_BATCH, 128, generator=gen), \
            nn.MSELoss()
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen), nn.MSELoss()


def build(model: str) -> nn.Module:
    if model == "tied":
        return TiedLM()
    if model == "memory":
        torch.manual_seed(4)
        return nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    return mlp()


# --- the reference (in the grader process) and the cases (in the rank) ---------------------------------------
def make_optimizer(name: str, params):
    # SGD as well as AdamW: Adam divides by the gradient's size, so it hides a gradient not averaged over ranks
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def reference(model: str, optim: str = "adamw") -> list[dict]:
    """One process, the unwrapped model on the whole batch: {name: parameter} after each of STEPS steps."""
    net = build(model)
    x, y, loss_fn = data(model)
    opt = make_optimizer(optim, net.parameters())
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return out


def train(FSDP, guard, model: str, optim: str = "adamw", compute_dtype=None):
    """STEPS steps of FSDP on this rank's slice; gather_full_params() after each, saved raw."""
    net = build(model)
    x, y, loss_fn = data(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // world
    mine = slice(rank * local, (rank + 1) * local)
    seen = {}
    first = next(m for m in net.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    first.register_forward_hook(lambda m, args, out: seen.update(
        input=str(args[0].dtype), weight=str(getattr(m, "weight", torch.empty(0)).dtype), output=str(out.dtype)))
    with guard.watching():
        fsdp = FSDP(net) if compute_dtype is None else FSDP(net, compute_dtype=compute_dtype)
    shards = list(fsdp.parameters())
    opt = make_optimizer(optim, shards)
    gathered, ops = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        with guard.watching():
            loss_fn(fsdp(x[mine]), y[mine]).backward()
            fsdp.finish_gradient_synchronization()
        ops.append(guard.summary())
        opt.step()
        with guard.watching():
            full = fsdp.gather_full_params()
        if not isinstance(full, dict):
            raise TypeError(f"gather_full_params() returned a {type(full).__name__}, not a dict of name: tensor")
        gathered.append({str(n): t.detach().clone() if isinstance(t, torch.Tensor) else torch.full((0,), torch.nan)
                         for n, t in full.items()})
    return {"raw": {"full": gathered}, "ops": ops, "seen": seen,
            "shard_dtypes": sorted({str(p.dtype) for p in shards}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in shards if p.grad is not None})}


def case_memory(FSDP, guard):
    net = build("memory")
    x, y, loss_fn = data("memory")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // world
    with guard.watching():
        fsdp = FSDP(net)
    shards = list(fsdp.parameters())
    opt = torch.optim.AdamW(shards, lr=1e-2)
    records = {}
    for step in range(2):
        allocs = jobkit.Allocations(min_numel=128 * 128)  # one full weight
        opt.zero_grad()
        with guard.watching(), allocs:
            loss = loss_fn(fsdp(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local])
            after_forward = allocs.alive_bytes(exclude=shards)
            loss.backward()
            fsdp.finish_gradient_synchronization()
        del loss
        after_finish = allocs.alive_bytes(exclude=shards + [p.grad for p in shards])
        opt.step()
        records[step] = (after_forward, after_finish)
    state = [{k: v for k, v in vars(m).items() if k != "_modules"} for m in fsdp.modules()]
    extra = held_tensor_bytes(state, exclude=shards + [p.grad for p in shards])
    return {"shard_bytes": sum(p.numel() * p.element_size() for p in shards), "params": len(shards),
            "after_forward": [r[0] for r in records.values()], "after_finish": [r[1] for r in records.values()],
            "held_besides_shards": extra}


PLAN = [("mlp", "equiv", dict(model="mlp")),
        ("mlp-sgd", "equiv", dict(model="mlp", optim="sgd")),
        ("tied", "tied", dict(model="tied")),
        ("memory", "memory", None),
        ("bf16", "bf16", dict(model="mlp", optim="sgd", compute_dtype=torch.bfloat16))]  # (case, group, train's)


class Ex07FsdpJob(jobkit.GradingJob):
    """ex07 part 2's grading job: training, memory and bf16 cases with the submission's FSDP."""

    name, wanted = "ex07_fsdp", ("FSDP",)
    case_limit = 20.0
    reason = ("a deadlock (a collective some ranks call and others do not, e.g. a gather in backward on one rank "
              "only), an endless loop, or far too slow")

    def make_guard(self, comm) -> CollectiveGuard:
        return CollectiveGuard(comm, FORBID)

    def plan(self) -> list[tuple]:
        return [(case, group, case_memory if how is None else functools.partial(train, **how))
                for case, group, how in PLAN]

    def case_args(self, module) -> tuple:
        return module.FSDP, self.guard

    def fields(self) -> dict:
        return {"forbidden_used": self.guard.forbidden_used}


if __name__ == "__main__":
    jobkit.main(Ex07FsdpJob)
