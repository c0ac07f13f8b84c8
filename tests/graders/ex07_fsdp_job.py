"""The grading job of ex07 part 2 (FSDP): every case for this job's world size, in one launch.

    ex07_fsdp_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex07_fsdp.py launches it on 1, 2 and 4 ranks. Each rank logs one record per case, e.g.

    {"case": "mlp", "group": "equiv", "max_diff": [3e-8, ...], "ops": {"all_gather_into_tensor": [12, 4096], ...}}

Cases:
  mlp, tied    N ranks on their slices of a batch of 8 (mean loss) vs one process training the unwrapped model
               with AdamW (mlp-sgd: SGD, which, unlike Adam, notices unaveraged gradients) on all 8, compared
               through gather_full_params() after each of 3 steps; the layer
               sizes are not multiples of 4 (padding); tied: an embedding shared with the output layer.
               The collectives of forward + backward + finish_gradient_synchronization are recorded.
  memory       4 layers of 128x128: the bytes of the wrapper's parameters (the shards) against the full model,
               tensors the wrapper holds besides them, and every tensor of at least one full weight's size
               created from forward to the end of finish_gradient_synchronization (a TorchDispatchMode keeps
               weak references): how many bytes of them are still alive after forward, and after finishing.
  bf16         compute_dtype=torch.bfloat16, SGD: the dtype a layer sees, the shards' and gradients' dtype, and the
               distance from the fp32 single-process reference after 3 steps.
"""
import argparse
import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

import comm_recorder  # beside this script: what a submission communicates
import jobkit  # beside this script: what every grading job shares
from ex07_job_guard import CollectiveGuard, held_tensor_bytes
from gpucourse import runtime

STEPS = 3
GLOBAL_BATCH = 8
TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2  # bf16 keeps ~3 significant digits: SGD steps from weights ~0.3 stay well within this
WHY = "write the sharding yourself"
FORBID = {"torch.distributed.fsdp:fully_shard": WHY, "torch.distributed.fsdp:FullyShardedDataParallel": WHY,
          "torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel": WHY,
          "torch.distributed._composable.fsdp:fully_shard": WHY}


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


# --- the cases ----------------------------------------------------------------------------------------
def make_optimizer(name: str, params):
    # SGD as well as AdamW: Adam divides by the gradient's size, so it hides a gradient not averaged over ranks
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def train(FSDP, guard, model: str, optim: str = "adamw", compute_dtype=None):
    """STEPS steps of FSDP on this rank's slice vs the optimizer on the unwrapped model on the whole batch."""
    net = build(model)
    ref = copy.deepcopy(net)
    names = [n for n, _ in ref.named_parameters()]
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
    opt, ref_opt = make_optimizer(optim, shards), make_optimizer(optim, ref.parameters())
    max_diff, ops, missing = [], [], []
    for _ in range(STEPS):
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        with guard.watching():
            loss_fn(fsdp(x[mine]), y[mine]).backward()
            fsdp.finish_gradient_synchronization()
        ops.append(guard.summary())
        opt.step()
        with guard.watching():
            full = fsdp.gather_full_params()
        missing = [n for n in names if n not in full]
        if missing:
            break
        with torch.no_grad():
            max_diff.append(max((full[n].float() - p).abs().max().item() for n, p in ref.named_parameters()))
    return {"max_diff": max_diff, "missing": missing, "ops": ops, "world": world, "seen": seen,
            "shard_dtypes": sorted({str(p.dtype) for p in shards}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in shards if p.grad is not None}),
            "tolerance": TOLERANCE if compute_dtype is None else BF16_TOLERANCE,
            "full_bytes": sum(p.numel() * 4 for p in ref.parameters())}


def case_memory(FSDP, guard):
    net = build("memory")
    full_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
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
    return {"shard_bytes": sum(p.numel() * p.element_size() for p in shards), "full_bytes": full_bytes,
            "world": world, "params": len(shards), "after_forward": [r[0] for r in records.values()],
            "after_finish": [r[1] for r in records.values()], "held_besides_shards": extra,
            "weight_bytes": 128 * 128 * 4}


def plan() -> list[tuple[str, str, object]]:
    return [("mlp", "equiv", functools.partial(train, model="mlp")),
            ("mlp-sgd", "equiv", functools.partial(train, model="mlp", optim="sgd")),
            ("tied", "tied", functools.partial(train, model="tied")),
            ("memory", "memory", case_memory),
            ("bf16", "bf16", functools.partial(train, model="mlp", optim="sgd", compute_dtype=torch.bfloat16))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--case-limit", type=float, default=20.0)
    args = parser.parse_args()
    runtime.setup(seed=0)
    log = jobkit.record_writer()  # before the submission is imported: see record_writer
    guard = CollectiveGuard(comm_recorder.install(), FORBID)
    watchdog = jobkit.Watchdog("a deadlock (a collective some ranks call and others do not, e.g. a gather in "
                               "backward on one rank only), an endless loop, or far too slow", log)
    cases = plan()
    log(case="plan", cases={case: group for case, group, _ in cases})
    module = jobkit.import_or_exit(args.submission, "ex07_fsdp", ["FSDP"], guard.watching, watchdog, args.case_limit,
                                   log)
    jobkit.run_cases(cases, (module.FSDP, guard), watchdog, args.case_limit, args.submission, log,
                     fields=lambda: {"forbidden_used": guard.forbidden_used})
    runtime.teardown()


if __name__ == "__main__":
    main()
