"""The grading job of ex02 (DDP and BucketedDDP): every check, on 2 ranks, in one launch.

    ex02_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex02_ddp.py launches it through gpucourse.launch. Each rank logs one record per case through
jobkit.record_writer (runtime.log's format; the tests read them from RunResult.metrics) and saves the case's
tensors raw; the rank judges nothing: the grader process recomputes every reference (one process on the full
batch, rank 0's initial state, the module's own forward) from the functions below and compares. For example

    {"case": "DDP-tied-adamw", "group": "equiv", "error": None, "raw": ["params"], "names": [...],
     "comm_bytes": [...], "trainable_bytes": 2112}

Cases, for each of DDP and BucketedDDP:
  module      `.module` is the wrapped module; calling the wrapper runs its forward (with a keyword)
  rank0       rank 1's parameters and buffers are perturbed before wrapping: afterwards every rank holds rank 0's
  equiv       the parameters after each step of N ranks on batch B, against (in the grader) one process on the
              full batch N*B (mean loss), with SGD and AdamW, for a model with a frozen parameter and one with tied
              weights
  keep        zero_grad(set_to_none=False) (the .grad tensors kept and zeroed) and two backward + finish rounds
              (half the local batch each) accumulated before every optimizer step: again against one process
  overlap     when every all_reduce started and every handle was waited for, against when backward reached
              the first layer and when it ended
  buckets     (BucketedDDP only) the bytes of every all_reduce, for a small and a large bucket_size_mb

The submission runs under guard: every all_reduce it starts is recorded through any layer (comm_recorder: when,
how many bytes, whether asynchronous), torch's own DistributedDataParallel is replaced by a class that refuses
to run, what it prints is capped, and a watchdog ends the rank (after logging why) when a case takes longer
than --case-limit: a deadlock or an endless loop costs the cases it breaks, not the grading run.
"""
import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from gpucourse.grading import comm_recorder  # what a submission communicates
from gpucourse.grading import jobkit  # what every grading job shares
from gpucourse import runtime

IMPLS = ("DDP", "BucketedDDP")
MODELS = ("frozen", "tied")
OPTIMIZERS = ("sgd", "adamw")
STEPS = 3
LOCAL_BATCH = 4
EQUIV_BUCKET_MB = 0.001  # ~1 KiB: the small equivalence models still get several buckets
OVERLAP_BUCKET_MB = 0.3  # one 256x256 layer (257 KiB) per bucket
SMALL_BUCKET_MB, LARGE_BUCKET_MB = 0.05, 100.0
TOLERANCE = 1e-5  # float32, a few steps; the reference reaches ~1e-7


# --- the guard: which all_reduces the submission starts, and whether it reaches for torch's DDP ----------
# torch's own data parallelism, replaced by refusals (jobkit.ban checks that each name exists in this torch).
BANNED = {f"{module}:DistributedDataParallel": "not allowed in ex02: synchronise the gradients yourself"
          for module in ("torch.nn.parallel", "torch.nn.parallel.distributed")}


class Guard(jobkit.Guard):
    """The all_reduces the submission starts (when, how many bytes, whether asynchronous), through any layer, and
    when it waits on a handle: comm_recorder's events of the last watch."""

    def __init__(self, comm):
        super().__init__(comm)
        self.banned_used: list[str] = []
        jobkit.ban(BANNED, self.banned_used)

    @property
    def ddp_used(self) -> bool:
        return bool(self.banned_used)

    @property
    def calls(self) -> list[dict]:
        """{"t": perf_counter at the call, "bytes": ..., "async": ...} of each all_reduce."""
        return [{"t": e["t"], "bytes": e["bytes"], "async": e["async"]} for e in self.comm.events
                if e["op"] in ("all_reduce", "all_reduce_coalesced")]

    @property
    def waits(self) -> list[float]:
        """perf_counter at each Work.wait() the submission calls."""
        return [e["t"] for e in self.comm.events if e["kind"] == "wait"]


# --- the models ----------------------------------------------------------------------------------
class Scaled(nn.Module):
    """A forward with a keyword argument: the wrapper must pass it on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, scale=1.0):
        return self.lin(x) * scale


TiedLM = jobkit.TiedLM


class WithBuffers(nn.Module):
    """BatchNorm running statistics, a registered buffer and a frozen parameter: all are model state."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        self.net[0].bias.requires_grad_(False)
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x):
        return self.net(x) + self.offset


def frozen_mlp() -> nn.Module:
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    net[0].weight.requires_grad_(False)  # frozen: never updated, never communicated
    return net


def equiv_setup(model: str, world: int):
    """(a fresh model, the full batch, the loss function), identical on every rank (and in the grader)."""
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    n = LOCAL_BATCH * world
    if model == "frozen":
        return frozen_mlp(), (torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)), nn.MSELoss()
    return TiedLM(), (torch.randint(0, 32, (n,), generator=gen), torch.randint(0, 32, (n,), generator=gen)), \
        nn.CrossEntropyLoss()


def make_optimizer(name: str, params):
    return torch.optim.SGD(params, lr=0.1) if name == "sgd" else torch.optim.AdamW(params, lr=0.01)


def wrap(impls, impl: str, net: nn.Module, bucket_mb: float):
    return impls[impl](net) if impl == "DDP" else impls[impl](net, bucket_size_mb=bucket_mb)


def unique_params(net: nn.Module) -> list[nn.Parameter]:
    return list(net.parameters())  # parameters() yields a tied parameter once


def trainable_bytes(net: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in unique_params(net) if p.requires_grad)


def flat_state(net: nn.Module) -> torch.Tensor:
    """Every parameter and buffer, flattened to float64 (num_batches_tracked included)."""
    tensors = [*net.parameters(), *net.buffers()]
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def flat_params(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in net.parameters()])


# --- the references, computed in the grader process (no process group) ------------------------------
def module_case_inputs():
    """(the module, its input) of the "module" case, as the rank builds them."""
    torch.manual_seed(3)
    return Scaled(), torch.randn(2, 8)


def module_reference() -> torch.Tensor:
    net, x = module_case_inputs()
    with torch.no_grad():
        return net(x, scale=2.0)


def rank0_model(rank: int) -> nn.Module:
    """The "rank0" case's model on `rank`: rank 0's initialisation, shifted on every other rank."""
    torch.manual_seed(4)
    net = WithBuffers()
    if rank != 0:  # another initialisation on the other ranks: rank 0's must win
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
            net.net[1].running_mean.add_(1.0)
            net.net[1].running_var.mul_(2.0)
            net.net[1].num_batches_tracked.fill_(7)
            net.offset.add_(3.0)
    return net


def state_names(net: nn.Module) -> tuple[list[str], list[int]]:
    """The names and sizes of flat_state's pieces, in its order."""
    pairs = [*net.named_parameters(), *net.named_buffers()]
    return [n for n, _ in pairs], [t.numel() for _, t in pairs]


def equiv_reference(model: str, optim: str, world: int) -> list[torch.Tensor]:
    """flat_params after each of STEPS steps of one process on the whole batch: what every rank must reach."""
    net, (x, y), loss_fn = equiv_setup(model, world)
    opt, out = make_optimizer(optim, net.parameters()), []
    for _ in range(STEPS):
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        out.append(flat_params(net))
    return out


# --- the cases -----------------------------------------------------------------------------------
def case_module(impls, guard, impl):
    net, x = module_case_inputs()
    with guard.watching():
        model = wrap(impls, impl, net, LARGE_BUCKET_MB)
        out = model(x, scale=2.0)
    return {"module_is_net": getattr(model, "module", None) is net, "is_module": isinstance(model, nn.Module),
            "returned": type(out).__name__,
            "raw": {"out": out.detach() if isinstance(out, torch.Tensor) else None}}


def case_rank0(impls, guard, impl):
    net = rank0_model(dist.get_rank())
    with guard.watching():
        wrap(impls, impl, net, LARGE_BUCKET_MB)
    return {"raw": {"state": flat_state(net)}}


def case_equiv(impls, guard, impl, model, optim):
    net, (x, y), loss_fn = equiv_setup(model, dist.get_world_size())
    rank = dist.get_rank()
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    with guard.watching():
        ddp = wrap(impls, impl, net, EQUIV_BUCKET_MB)
    opt = make_optimizer(optim, ddp.parameters())
    params, comm_bytes = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        with guard.watching():
            loss_fn(ddp(x[mine]), y[mine]).backward()  # this rank's slice of the batch
            ddp.finish_gradient_synchronization()
        comm_bytes.append(sum(c["bytes"] for c in guard.calls))
        opt.step()
        params.append(flat_params(net))
    names = [n for n, _ in net.named_parameters()]
    return {"comm_bytes": comm_bytes, "trainable_bytes": trainable_bytes(net), "names": names,
            "sizes": [p.numel() for p in net.parameters()], "model": model, "optim": optim, "reference": "equiv",
            "world": dist.get_world_size(), "raw": {"params": torch.stack(params)}}


def keep_micro_batches(world: int, rank: int | None = None) -> list:
    """The two micro-batches of a "keep" step: every rank's half slices (rank None: the whole batch's indices,
    as one process sees them), or this rank's own."""
    half = LOCAL_BATCH // 2
    if rank is None:
        return [[r * LOCAL_BATCH + m * half + i for r in range(world) for i in range(half)] for m in range(2)]
    return [slice(rank * LOCAL_BATCH + m * half, rank * LOCAL_BATCH + (m + 1) * half) for m in range(2)]


def keep_reference(world: int) -> list[torch.Tensor]:
    """flat_params after each step of one process that accumulates the two micro-batches' mean losses (SGD)."""
    net, (x, y), loss_fn = equiv_setup("frozen", world)
    opt, out = torch.optim.SGD(net.parameters(), lr=0.1), []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for every in keep_micro_batches(world):
            loss_fn(net(x[every]), y[every]).backward()
        opt.step()
        out.append(flat_params(net))
    return out


def case_keep(impls, guard, impl):
    """zero_grad(set_to_none=False), two micro-batches accumulated per step, each synchronised: the gradient the
    optimizer sees is the sum of the two micro-batches' averages. A BucketedDDP whose .grad tensors are views
    of its buckets sees them accumulated into in place here, never the new tensors of zero_grad's default."""
    world = dist.get_world_size()
    net, (x, y), loss_fn = equiv_setup("frozen", world)
    with guard.watching():
        ddp = wrap(impls, impl, net, EQUIV_BUCKET_MB)
    opt, params = torch.optim.SGD(ddp.parameters(), lr=0.1), []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for mine in keep_micro_batches(world, dist.get_rank()):
            with guard.watching():
                loss_fn(ddp(x[mine]), y[mine]).backward()
                ddp.finish_gradient_synchronization()
        opt.step()
        params.append(flat_params(net))
    return {"names": [n for n, _ in net.named_parameters()], "sizes": [p.numel() for p in net.parameters()],
            "model": "frozen", "reference": "keep", "world": world, "raw": {"params": torch.stack(params)}}


def case_overlap(impls, guard, impl):
    torch.manual_seed(5)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())])
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    reached_first = []

    def watch_first_layer(module, inputs, output):
        # The gradient of the first layer's output exists just before backward computes that layer's gradients.
        output.register_hook(lambda grad: reached_first.append(time.perf_counter()))

    net[0].register_forward_hook(watch_first_layer)
    with guard.watching():
        ddp = wrap(impls, impl, net, OVERLAP_BUCKET_MB)
    with guard.watching():
        start = time.perf_counter()
        nn.functional.mse_loss(ddp(x), y).backward()
        backward_end = time.perf_counter()
        ddp.finish_gradient_synchronization()
    calls = [{"t": c["t"] - start, "bytes": c["bytes"], "async": c["async"]} for c in guard.calls]
    return {"calls": calls, "waits": [t - start for t in guard.waits],
            "first_layer_t": reached_first[0] - start if reached_first else None,
            "backward_end_t": backward_end - start, "params": len(unique_params(net))}


def bucket_model() -> nn.Module:
    """Parameters on both sides of SMALL_BUCKET_MB (52 KiB): 16 KiB, 64 KiB, 32 KiB, small biases, one frozen."""
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32), nn.ReLU(),
                        nn.Linear(32, 8))
    net[4].bias.requires_grad_(False)
    return net


def case_buckets(impls, guard, bucket_mb):
    net = bucket_model()
    x, y = torch.randn(4, 64), torch.randn(4, 8)
    with guard.watching():
        ddp = impls["BucketedDDP"](net, bucket_size_mb=bucket_mb)
    with guard.watching():
        nn.functional.mse_loss(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
    trainable = [p for p in unique_params(net) if p.requires_grad]
    buckets = getattr(ddp, "buckets", None)
    index = {id(p): i for i, p in enumerate(unique_params(net))}
    listed = ([[index.get(id(p), -1) for p in b] for b in buckets] if isinstance(buckets, (list, tuple))
              else None)  # each bucket's parameters as positions in net.parameters(); -1: not one of them
    return {"bucket_mb": bucket_mb, "limit_bytes": bucket_mb * 2**20, "call_bytes": [c["bytes"] for c in guard.calls],
            "param_bytes": [p.numel() * p.element_size() for p in trainable], "params": len(trainable),
            "trainable": [i for i, p in enumerate(unique_params(net)) if p.requires_grad],
            "trainable_bytes": trainable_bytes(net), "bucket_params": listed,
            "bucket_bytes": None if listed is None else [sum(p.numel() * p.element_size() for p in b)
                                                           for b in buckets]}


def plan() -> list[tuple[str, str, object]]:
    """(case, group, function of (impls, guard)) in the order they run: cheap and basic first."""
    cases = []
    for impl in IMPLS:
        cases.append((f"{impl}-module", "module", functools.partial(case_module, impl=impl)))
    for impl in IMPLS:
        cases.append((f"{impl}-rank0", "rank0", functools.partial(case_rank0, impl=impl)))
    for impl in IMPLS:
        for model in MODELS:
            for optim in OPTIMIZERS:
                cases.append((f"{impl}-{model}-{optim}", "equiv",
                              functools.partial(case_equiv, impl=impl, model=model, optim=optim)))
    for impl in IMPLS:
        cases.append((f"{impl}-keep", "keep", functools.partial(case_keep, impl=impl)))
    for impl in IMPLS:
        cases.append((f"{impl}-overlap", "overlap", functools.partial(case_overlap, impl=impl)))
    cases.append(("BucketedDDP-buckets-small", "buckets", functools.partial(case_buckets, bucket_mb=SMALL_BUCKET_MB)))
    cases.append(("BucketedDDP-buckets-large", "buckets", functools.partial(case_buckets, bucket_mb=LARGE_BUCKET_MB)))
    return cases


class Ex02Job(jobkit.GradingJob):
    """ex02's grading job: DDP and BucketedDDP on 2 ranks, torch's DDP refused."""

    name, wanted, case_limit = "ex02", IMPLS, 20.0
    reason = "a deadlock (a handle waited on that the other rank never matched), an endless loop, or far too slow"

    def make_guard(self, comm) -> Guard:
        return Guard(comm)

    def plan(self) -> list[tuple]:
        return plan()

    def case_args(self, module) -> tuple:
        return {name: getattr(module, name) for name in IMPLS}, self.guard

    def fields(self) -> dict:  # every record, the import's too, says whether torch's DDP was reached for
        return {"ddp_used": self.guard.ddp_used}


if __name__ == "__main__":
    jobkit.main(Ex02Job)
