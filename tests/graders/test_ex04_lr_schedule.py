"""Grader of ex04: linear scaling rule and gradual warmup (run it with `gpucourse grade ex04`).

One real job per world size (1, 2 and 4 ranks, through gpucourse.launch; ex04_job.py): each rank builds the
schedule for its own job (per-rank batch B, so base batch B and global batch world_size * B), evaluates the
edge cases, and drives a few DistributedDataParallel steps with the submission's scheduler. The tests
compare every rank's values with the reference below.
"""
import math
from pathlib import Path

import pytest

from .job_records import JobRecords, check, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex04_job.py")
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


# --- what is wrong with one rank's record (None when it is right; check() reports its error first) ---
def value_problem(rec) -> str | None:
    kwargs = rec["kwargs"]
    if rec["fn"] == "scaled_lr":
        want, got = reference_scaled(**kwargs), rec["values"][0]
        return None if close(got, want) else f"{call('scaled_lr', kwargs)} returned {got!r}, expected {want!r}"
    for step, got in zip(rec["steps"], rec["values"]):
        want = reference_warmup(step, **kwargs)
        if not close(got, want):
            return f"{call('warmup_lr', kwargs, step)} returned {got!r}, expected {want!r}"
    return None


def raises_problem(rec) -> str | None:
    if rec["value_error"]:
        return None
    args = call(rec["fn"], rec["kwargs"], rec.get("step")) if rec["fn"] != "warmup_scheduler" else \
        call("warmup_scheduler", {"optimizer": "opt", **rec["kwargs"]})
    if rec["raised"] is None:
        return f"{args} returned instead of raising ValueError"
    return f"{args} raised {rec['raised']}, not ValueError"


def scheduler_problem(group: int):
    """Parameter group `group`'s lr at every step must be its initial lr times warmup_lr(step) / base_lr."""

    def problem(rec) -> str | None:
        kwargs, ratio = rec["kwargs"], rec["group_lr_ratio"][group]
        for step, lrs in zip(rec["steps"], rec["group_lrs"]):
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
