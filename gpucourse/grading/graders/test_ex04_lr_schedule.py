"""Grader of ex04: linear scaling rule and gradual warmup (run it with `gpucourse grade ex04`).

One real job per world size (1, 2 and 4 ranks, through gpucourse.launch; ex04_job.py): each rank builds the
schedule for its own job (per-rank batch B, so base batch B and global batch world_size * B), evaluates the
edge cases, and drives a few DistributedDataParallel steps with the submission's scheduler, and records what
the submission returned or raised. The tests compare that, here in the grader process, with the reference below,
evaluated on each case's arguments as the job's own plan gives them (`CASES.plan`), never as a record says.
"""
import math
from pathlib import Path

import pytest

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex04_job.py")
CASES = job_module(JOB)  # its plan: each case's arguments, from which the expected values are computed here
WORLD_SIZES = (1, 2, 4)
BATCH_PER_RANK = 32
CASE_LIMIT_S = 10
JOB_TIMEOUT_S = 120


# --- the reference --------------------------------------------------------------------------------
def reference_scaled(base_lr, base_batch, global_batch):
    return base_lr * global_batch / base_batch


def reference_warmup(step, *, base_lr, base_batch, global_batch, warmup_steps, total_steps=None):
    target = reference_scaled(base_lr, base_batch, global_batch)
    if step < warmup_steps:
        start = min(base_lr, target)
        return start + (target - start) * step / warmup_steps
    if total_steps is None:
        return target
    return target * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps))) / 2


def close(got, want) -> bool:
    return got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


def call(fn, kwargs, step=None) -> str:
    args = ([] if step is None else [str(step)]) + [f"{k}={v}" for k, v in kwargs.items()]
    return f"{fn}({', '.join(args)})"


# --- the jobs -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: JobRecords}: the three jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex04-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=4 * CASE_LIMIT_S,
                       extra_args=["--batch-per-rank", str(BATCH_PER_RANK)])


def planned(rec) -> dict:
    """The case `rec` reports on, as the job planned it for that job's world size (arguments, steps)."""
    world = rec["world"]
    for case in CASES.plan(world, BATCH_PER_RANK):
        if case["case"] == rec["case"]:
            return case
    raise KeyError(f"ex04 plans no case {rec['case']!r} on {world} rank(s)")


# --- what is wrong with one rank's record (None when it is right; check() reports its error first) ---
def value_problem(rec) -> str | None:
    case = planned(rec)
    kwargs, got = case["kwargs"], rec["values"]
    if case["fn"] == "scaled_lr":
        want = reference_scaled(**kwargs)
        return None if close(got[0], want) else f"{call('scaled_lr', kwargs)} returned {got[0]!r}, expected {want!r}"
    if len(got) != len(case["steps"]):
        return f"{len(got)} values recorded for {len(case['steps'])} steps"
    for step, value in zip(case["steps"], got):
        want = reference_warmup(step, **kwargs)
        if not close(value, want):
            return f"{call('warmup_lr', kwargs, step)} returned {value!r}, expected {want!r}"
    return None


def raises_problem(rec) -> str | None:
    case = planned(rec)
    if "ValueError" in rec["raised_types"]:  # ValueError or a subclass of it
        return None
    args = call(case["fn"], case["kwargs"], case.get("step")) if case["fn"] != "warmup_scheduler" else \
        call("warmup_scheduler", {"optimizer": "opt", **case["kwargs"]})
    if rec["raised"] is None:
        return f"{args} returned instead of raising ValueError"
    return f"{args} raised {rec.get('message') or rec['raised']}, not ValueError"


def scheduler_problem(group: int):
    """Parameter group `group`'s lr at every step must be its initial lr times warmup_lr(step) / base_lr."""

    def problem(rec) -> str | None:
        case = planned(rec)
        kwargs, ratio = case["kwargs"], case["group_lr_ratio"][group]
        if len(rec["group_lrs"]) != len(case["steps"]):
            return f"{len(rec['group_lrs'])} learning rates recorded for {len(case['steps'])} steps"
        for step, lrs in zip(case["steps"], rec["group_lrs"]):
            want = ratio * reference_warmup(step, **kwargs)
            if not close(lrs[group], want):
                which = "" if group == 0 else f" of the parameter group created with lr=base_lr*{ratio:g}"
                return (f"step {step}: the optimizer's lr{which} was {lrs[group]!r}, expected {want!r} "
                        f"(warmup_scheduler(opt, {', '.join(f'{k}={v}' for k, v in kwargs.items())}))")
        return None

    return problem


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
def test_scaled_lr(jobs):
    """k = global_batch / base_batch times base_lr: this job's k, Goyal et al.'s 8192/256, k < 1, k = 7/3."""
    check(jobs, "scaled", value_problem)


@pytest.mark.points(1)
def test_warmup_starts_at_base_lr(jobs):
    """Step 0 of the warmup uses base_lr (Goyal et al. warm up from η, not from 0)."""
    check(jobs, "start", value_problem)


@pytest.mark.points(2)
def test_linear_ramp_reaches_the_scaled_lr_at_warmup_steps(jobs):
    """Linear in the step during warmup, exactly the scaled rate at step == warmup_steps, constant after."""
    check(jobs, "ramp", value_problem)


@pytest.mark.points(1)
def test_no_warmup(jobs):
    """warmup_steps=0: the scaled rate from step 0."""
    check(jobs, "no-warmup", value_problem)


@pytest.mark.points(1)
def test_same_batch_is_constant(jobs):
    """k = 1 (global batch = base batch): base_lr at every step, warmup or not."""
    check(jobs, "k1", value_problem)


@pytest.mark.points(1)
def test_smaller_global_batch_never_warms_up_above_target(jobs):
    """k < 1: the scaled (smaller) rate from step 0; warmup never exceeds the target."""
    check(jobs, "smaller", value_problem)


@pytest.mark.points(2)
def test_cosine_decay_after_warmup(jobs):
    """With total_steps: the scaled rate at the end of warmup, half of it midway, 0 at total_steps."""
    check(jobs, "cosine", value_problem)


@pytest.mark.points(1)
def test_scaled_lr_rejects_invalid_arguments(jobs):
    """base_lr 0, negative, nan or inf; batches 0, negative, float or bool: ValueError."""
    check(jobs, "invalid-scaled", raises_problem)


@pytest.mark.points(1)
def test_warmup_lr_rejects_invalid_arguments(jobs):
    """Negative or fractional step and warmup_steps, total_steps <= warmup_steps, step > total_steps: ValueError."""
    check(jobs, "invalid-warmup", raises_problem)


@pytest.mark.points(1)
def test_warmup_scheduler_rejects_invalid_arguments_when_created(jobs):
    """warmup_scheduler(optimizer, ...) with invalid arguments raises ValueError right away."""
    check(jobs, "invalid-sched", raises_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_scheduler_drives_ddp_training(jobs, world):
    """A real DDP job on `world` ranks: the optimizer's lr at every step is warmup_lr(step), on every rank."""
    check(jobs, "ddp", scheduler_problem(0), [world])


@pytest.mark.points(1)
def test_scheduler_scales_each_param_group(jobs):
    """A parameter group created with lr=base_lr/10 gets a tenth of warmup_lr(step) (LambdaLR's factor)."""
    check(jobs, "ddp", scheduler_problem(1))
