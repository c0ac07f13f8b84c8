"""Grader of ex02: DDP and BucketedDDP, data parallelism written by hand (run it with `gpucourse grade ex02`).

One real 2-rank job runs every case on the submission: this file, run in each rank by torchrun through
gpucourse.launch,

    ex02_ddp.py SUBMISSION.py [--case-limit SECONDS]

Each rank logs one record per case through jobkit.record_writer (runtime.log's format; the tests read them from
RunResult.metrics) and saves the case's tensors raw; the rank judges nothing: the tests below recompute every
reference here, in the grader process (one process on the full batch, rank 0's initial state, the module's own
forward), from the job's own model and data functions, and compare. For example

    {"case": "DDP-tied-adamw", "group": "equiv", "error": None, "raw": ["params"], "names": [...],
     "comm_bytes": [...], "trainable_bytes": 2112}

Cases, for each of DDP and BucketedDDP, and what is checked of each:
  module      `.module` is the wrapped module; calling the wrapper runs its forward (with a keyword)
  rank0       rank 1's parameters and buffers are perturbed before wrapping: afterwards every rank holds rank 0's
  equiv       the parameters after each step of N ranks on batch B match one process on the full batch N*B (mean
              loss), with SGD and AdamW, for a model with a frozen parameter and one with tied weights; every
              gradient byte is all-reduced exactly once (frozen: never)
  keep        the same with zero_grad(set_to_none=False) (the .grad tensors kept and zeroed) and two backward +
              finish rounds (half the local batch each) accumulated before every optimizer step (gradients kept
              between steps: a BucketedDDP whose .grad are views of its buckets must divide them there too)
  overlap     all_reduces start before backward reaches the first layer, asynchronously, and are not waited for
              until backward has ended (measured, not assumed)
  buckets     (BucketedDDP only) every all_reduce fits in bucket_size_mb (unless one parameter alone is larger),
              and large buckets mean fewer all_reduces than parameters: a small and a large bucket_size_mb
and in every case torch's own DistributedDataParallel is not used (in the code, or at run time).

The submission runs under guard: every all_reduce it starts is recorded through any layer (comm_recorder: when,
how many bytes, whether asynchronous), torch's own DistributedDataParallel is replaced by a class that refuses
to run, what it prints is capped, and a watchdog ends the rank (after logging why) when a case takes longer
than --case-limit: a deadlock or an endless loop costs the cases it breaks, not the grading run.
"""
import ast
import functools
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
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
    def each_impl(group, case):
        return [(f"{impl}-{group}", group, functools.partial(case, impl=impl)) for impl in IMPLS]

    cases = each_impl("module", case_module) + each_impl("rank0", case_rank0)
    cases += [(f"{impl}-{model}-{optim}", "equiv", functools.partial(case_equiv, impl=impl, model=model, optim=optim))
              for impl in IMPLS for model in MODELS for optim in OPTIMIZERS]
    cases += each_impl("keep", case_keep) + each_impl("overlap", case_overlap)
    return cases + [(f"BucketedDDP-buckets-{size}", "buckets", functools.partial(case_buckets, bucket_mb=mb))
                    for size, mb in (("small", SMALL_BUCKET_MB), ("large", LARGE_BUCKET_MB))]


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


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
WORLD = 2
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 150
FORBIDDEN_NAMES = {"DistributedDataParallel", "FullyShardedDataParallel", "fully_shard"}
FORBIDDEN_MODULES = ("torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed._composable")


@pytest.fixture(scope="module")
def job(submission) -> JobRecords:
    return launch_jobs(JOB, submission, [WORLD], name="grade-ex02", case_limit=CASE_LIMIT_S, timeout=JOB_TIMEOUT_S,
                       stall_timeout=3 * CASE_LIMIT_S)[WORLD]


# --- what makes one rank's record of a case wrong (None when it is right) ---------------------------
def module_problem(rec) -> str | None:
    if not rec["is_module"]:
        return "the wrapper is not an nn.Module"
    if not rec["module_is_net"]:
        return "`.module` is not the module that was wrapped"
    out, want = raw(rec)["out"], module_reference()
    if out is None or out.shape != want.shape or not torch.allclose(out, want):
        return "calling the wrapper with (x, scale=2.0) did not return the module's forward(x, scale=2.0)"
    return None


@functools.cache
def rank0_reference() -> tuple[torch.Tensor, list[str], list[int]]:
    net = rank0_model(0)
    return (flat_state(net), *state_names(net))


def rank0_problem(rec) -> str | None:
    want, names, sizes = rank0_reference()
    got = raw(rec)["state"]
    if got.shape != want.shape:
        return "after wrapping, the model's parameters and buffers changed size"
    wrong = [name for name, a, b in zip(names, got.split(sizes), want.split(sizes)) if not torch.equal(a, b)]
    if wrong:
        return (f"after wrapping, {', '.join(wrong)} still differ(s) from rank 0's initial values: broadcast every "
                f"parameter and buffer from rank 0 at construction")
    return None


@functools.cache
def reference(kind: str, model: str, optim: str | None, world: int) -> list[torch.Tensor]:
    """One process's parameters after each step: the "equiv" cases' or the "keep" cases' (accumulation)."""
    return equiv_reference(model, optim, world) if kind == "equiv" else keep_reference(world)


def equiv_problem(rec) -> str | None:
    want = reference(rec["reference"], rec["model"], rec.get("optim"), rec["world"])
    got = raw(rec)["params"]
    if got.shape != (len(want), want[0].numel()):
        return f"the parameters after each step have shape {tuple(got.shape)}, not {(len(want), want[0].numel())}"
    for step, (mine, ref) in enumerate(zip(got, want), 1):
        diff = (mine - ref).abs().max().item()
        if not diff <= TOLERANCE:  # NaN is wrong too
            return (f"after step {step}, parameters differ from one process on the full batch by {diff:.2g} "
                    f"(tolerance {TOLERANCE:g}): average (sum / world size) the gradients, once each")
    net = equiv_setup(rec["model"], rec["world"])[0]
    frozen = {name for name, p in net.named_parameters() if not p.requires_grad}
    moved = {name for mine in got for name, a, b in zip(rec["names"], mine.split(rec["sizes"]),
                                                         want[0].split(rec["sizes"]))
             if name in frozen and not torch.equal(a, b)}  # a frozen parameter never moves from its start
    if moved:
        return f"the frozen parameter(s) {', '.join(sorted(moved))} changed"
    return None


def keep_problem(rec) -> str | None:
    why = equiv_problem(rec)
    return why and (f"with zero_grad(set_to_none=False) and two backward + finish rounds per step, {why}; a .grad "
                    f"that is still the tensor you set (a view of your bucket) must be averaged too")


def comm_problem(rec) -> str | None:
    want = rec["trainable_bytes"]
    for step, got in enumerate(rec["comm_bytes"], 1):
        if got != want:
            return (f"step {step} all-reduced {got} bytes of gradients; the trainable parameters hold {want} "
                    f"(each counted once, tied ones once, frozen ones not at all)")
    return None


def overlap_problem(rec) -> str | None:
    calls, first = rec["calls"], rec["first_layer_t"]
    if not calls:
        return "no all_reduce was recorded during the step (the grader records dist.all_reduce)"
    if first is None:
        return "backward never reached the first layer"
    early = [c for c in calls if c["t"] < first]
    if not early:
        return (f"the first all_reduce started {1e3 * (calls[0]['t'] - first):.1f} ms after backward reached the "
                f"first layer: start each one from a gradient hook, during backward, not afterwards")
    if not all(c["async"] for c in early):
        return ("an all_reduce during backward was blocking (backward waited for it): pass async_op=True, keep "
                "the handle, and wait in finish_gradient_synchronization()")
    if any(t < rec["backward_end_t"] for t in rec.get("waits", [])):
        return ("an all_reduce's handle was waited for during backward (backward stopped until it was done): "
                "keep the handles and wait in finish_gradient_synchronization()")
    return None


def bucket_problem(rec) -> str | None:
    limit, sizes = rec["limit_bytes"], rec["call_bytes"]
    if not sizes:
        return "no all_reduce was recorded during the step"
    alone = {b for b in rec["param_bytes"] if b > limit}  # parameters too large for any bucket: one each
    too_big = [b for b in sizes if b > limit and b not in alone]
    if too_big:
        return (f"an all_reduce of {too_big[0]} bytes with bucket_size_mb={rec['bucket_mb']:g} "
                f"({limit:.0f} bytes): close a bucket before it would exceed the limit")
    if sum(sizes) != rec["trainable_bytes"]:
        return (f"{sum(sizes)} bytes all-reduced in one step; the trainable parameters hold {rec['trainable_bytes']}"
                f" (each once, frozen ones not at all)")
    if len(sizes) >= rec["params"]:
        return (f"{len(sizes)} all_reduce calls for {rec['params']} trainable parameters: a bucket is one "
                f"flattened tensor holding several parameters' gradients")
    listed = rec["bucket_params"]
    if listed is None or sorted(i for b in listed for i in b) != rec["trainable"]:
        return "self.buckets must list every trainable parameter exactly once (and no frozen one)"
    if any(b > limit and b not in alone for b in rec["bucket_bytes"]):
        return f"a bucket in self.buckets holds more than bucket_size_mb={rec['bucket_mb']:g}"
    return None


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.points(1)
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("model", ["frozen", "tied"])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_single_process(job, impl, model, optim):
    """2 ranks x 4 samples reach, after each of 3 steps, the parameters of one process on all 8 (mean loss)."""
    check(job, [f"{impl}-{model}-{optim}"], equiv_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_kept_and_accumulated(job, impl):
    """zero_grad(set_to_none=False) keeps each .grad tensor (zeroed), and two backward + finish rounds on half
    the local batch each accumulate into it before the step: the parameters still match one process, step by
    step (SGD; the frozen model)."""
    check(job, [f"{impl}-keep"], keep_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("impl", IMPLS)
def test_each_gradient_reduced_once_frozen_never(job, impl):
    """Bytes all-reduced per step = the trainable parameters' bytes: tied weights once, frozen ones never."""
    check(job, [f"{impl}-{model}-sgd" for model in ("frozen", "tied")], comm_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("impl", IMPLS)
def test_rank0_initial_state_wins(job, impl):
    """Rank 1 starts from other parameters and buffers (BatchNorm statistics, a registered buffer, a frozen
    parameter); after wrapping, every rank holds rank 0's."""
    check(job, [f"{impl}-rank0"], rank0_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("impl", IMPLS)
def test_communication_overlaps_backward(job, impl):
    """In a 6-layer MLP, all_reduces start before backward reaches the first layer, and none of them blocks
    (none is blocking, nor waited for before backward ends)."""
    check(job, [f"{impl}-overlap"], overlap_problem)


@pytest.mark.points(2)
def test_buckets_respect_the_size_limit(job):
    """bucket_size_mb=0.05: every all_reduce <= 52 KiB unless one parameter alone is larger; self.buckets agrees."""
    check(job, ["BucketedDDP-buckets-small"], bucket_problem)


@pytest.mark.points(1)
def test_large_buckets_mean_few_all_reduces(job):
    """bucket_size_mb=100: fewer all_reduce calls than parameters, the same bytes."""
    check(job, ["BucketedDDP-buckets-large"], bucket_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("impl", IMPLS)
def test_module_attribute_and_forward(job, impl):
    """`.module` is the wrapped module; wrapper(x, scale=2.0) returns module(x, scale=2.0)."""
    check(job, [f"{impl}-module"], module_problem)


def forbidden_uses(path: Path) -> list[str]:
    """Names and imports of PyTorch's own data-parallel wrappers in the submission's source."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(errors="replace"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(FORBIDDEN_MODULES):
            found.append(f"from {node.module} import ... (line {node.lineno})")
        elif isinstance(node, ast.Import):
            found += [f"import {alias.name} (line {node.lineno})" for alias in node.names
                      if alias.name.startswith(FORBIDDEN_MODULES)]
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"{node.id} (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(f".{node.attr} (line {node.lineno})")
    return found


@pytest.mark.points(2)
def test_no_torch_ddp(job, submission):
    """Neither the source nor the running code uses torch's DistributedDataParallel (or FSDP, or the composable
    `replicate`, imported from torch.distributed._composable);
    and at least the basic cases run (an empty submission earns nothing here)."""
    found = forbidden_uses(submission)
    assert not found, f"the submission uses PyTorch's own data parallelism: {found[0]}"
    cases = [c for group in ("module", "rank0", "equiv", "keep", "overlap", "buckets") for c in job.cases(group)]
    used = [c for c in cases if any(rec.get("ddp_used") for rec in job.ranks(c))]
    assert not used, f"case {used[0]} called torch.nn.parallel.DistributedDataParallel"
    check(job, [f"{impl}-module" for impl in IMPLS], lambda rec: None)  # something must run


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex02Job)
