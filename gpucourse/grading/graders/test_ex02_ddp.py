"""Grader of ex02: DDP and BucketedDDP, data parallelism written by hand (run it with `gpucourse grade ex02`).

One real 2-rank job (ex02_job.py, through gpucourse.launch) runs every case on the submission and saves what it
produced; the tests below compare it, here in the grader process, with references computed here from the job's
own model and data functions. What is checked, for both classes:
- the parameters match one process on the full batch, step by step (SGD and AdamW; a frozen parameter,
  tied weights), and every gradient byte is all-reduced exactly once (frozen: never);
- the same with zero_grad(set_to_none=False) and two backward + finish rounds accumulated per step (gradients
  kept between steps: a BucketedDDP whose .grad are views of its buckets must divide them there too);
- rank 0's parameters and buffers win over rank 1's at construction;
- all_reduces start before backward reaches the first layer, asynchronously, and are not waited for until
  backward has ended (measured, not assumed);
- `.module`, and calling the wrapper runs the forward;
- BucketedDDP: every all_reduce fits in bucket_size_mb (unless one parameter alone is larger), and large
  buckets mean fewer all_reduces than parameters;
- torch's own DistributedDataParallel is not used (in the code, or at run time).
"""
import ast
import functools
from pathlib import Path

import pytest
import torch

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex02_job.py")
CASES = job_module(JOB)  # its models and data: the references are computed here
WORLD = 2
IMPLS = ("DDP", "BucketedDDP")
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
    out, want = raw(rec)["out"], CASES.module_reference()
    if out is None or out.shape != want.shape or not torch.allclose(out, want):
        return "calling the wrapper with (x, scale=2.0) did not return the module's forward(x, scale=2.0)"
    return None


@functools.cache
def rank0_reference() -> tuple[torch.Tensor, list[str], list[int]]:
    net = CASES.rank0_model(0)
    return (CASES.flat_state(net), *CASES.state_names(net))


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
    return CASES.equiv_reference(model, optim, world) if kind == "equiv" else CASES.keep_reference(world)


def equiv_problem(rec) -> str | None:
    want = reference(rec["reference"], rec["model"], rec.get("optim"), rec["world"])
    got = raw(rec)["params"]
    if got.shape != (len(want), want[0].numel()):
        return f"the parameters after each step have shape {tuple(got.shape)}, not {(len(want), want[0].numel())}"
    for step, (mine, ref) in enumerate(zip(got, want), 1):
        diff = (mine - ref).abs().max().item()
        if not diff <= CASES.TOLERANCE:  # NaN is wrong too
            return (f"after step {step}, parameters differ from one process on the full batch by {diff:.2g} "
                    f"(tolerance {CASES.TOLERANCE:g}): average (sum / world size) the gradients, once each")
    net = CASES.equiv_setup(rec["model"], rec["world"])[0]
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
