"""Grader of ex04: linear scaling rule and gradual warmup (run it with `gpucourse grade ex04`).

One real job per world size (1, 2 and 4 ranks, through gpucourse.launch; ex04_lr_schedule.py): each rank builds the
schedule for its own job (per-rank batch B, so base batch B and global batch world_size * B), evaluates the
edge cases, and drives a few DistributedDataParallel steps with the submission's scheduler, and records what
the submission returned or raised. The tests compare that, here in the grader process, with the reference below,
evaluated on each case's arguments as the job's own plan gives them (`plan`), never as a record says.

In each rank (this file, run by torchrun through gpucourse.launch): one grading job for ex04 (learning-rate
schedule): every case for this job's world size, in one launch.

    ex04_lr_schedule.py SUBMISSION.py [--batch-per-rank B] [--case-limit SECONDS]

The checks below launch it through gpucourse.launch on 1, 2 and 4 ranks. Each rank sets up the
schedule for its own job, as a training script would: per-rank batch B, so base batch B (one rank) and
global batch world_size * B. It logs one record per case (jobkit.record_writer, in runtime.log's format) with
what the submission returned, raw; the rank judges nothing. The grader process takes each case's arguments from
this script's own `plan` (never from the record) and computes the expected values itself:

    {"case": "warmup", "group": "ramp", "values": [0.1, 0.13, ...], "error": None}
    {"case": "invalid-scaled-base_lr-0", "group": "invalid-scaled", "raised": "ValueError",
     "raised_types": ["ValueError", "Exception", ...], "message": "...", "error": None}

The "ddp" cases train a small model with DistributedDataParallel for a few steps under the submission's
scheduler and record the learning rate of every parameter group before each optimizer step. A case that
runs longer than --case-limit (an endless loop) is reported and ends the rank; what the submission
prints is capped.
"""
import functools
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse.run import runtime
from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs

# --- what runs in each rank ----------------------------------------------------------------------------------------
FUNCTIONS = ("scaled_lr", "warmup_lr", "warmup_scheduler")
DDP_STEPS, DDP_WARMUP = 12, 4


# --- cases --------------------------------------------------------------------------------------------
def plan(world: int, batch: int) -> list[dict]:
    """The cases of this job: schedules for (world_size, batch), plus fixed edge cases."""
    glob = world * batch
    ws = {"base_batch": batch, "global_batch": glob}

    def seq(case, group, steps, **kwargs):
        return {"case": case, "group": group, "fn": "warmup_lr", "kwargs": kwargs, "steps": list(steps)}

    def scaled(case, **kwargs):
        return {"case": case, "group": "scaled", "fn": "scaled_lr", "kwargs": kwargs}

    def invalid(fn, case, step=None, **kwargs):
        group = {"scaled_lr": "invalid-scaled", "warmup_lr": "invalid-warmup", "warmup_scheduler": "invalid-sched"}
        return {"case": f"{group[fn]}-{case}", "group": group[fn], "fn": fn, "kwargs": kwargs, "step": step}

    good = {"base_lr": 0.1, "base_batch": 32, "global_batch": 128, "warmup_steps": 5}
    cases = [
        scaled("scaled-this-job", base_lr=0.1, **ws),
        scaled("scaled-goyal", base_lr=0.1, base_batch=256, global_batch=8192),
        scaled("scaled-smaller-batch", base_lr=0.05, base_batch=128, global_batch=96),
        scaled("scaled-fraction", base_lr=0.2, base_batch=3, global_batch=7),
        seq("warmup-start", "start", [0], base_lr=0.1, warmup_steps=10, **ws),
        seq("warmup", "ramp", range(13), base_lr=0.1, warmup_steps=5, **ws),
        seq("warmup-1-step", "ramp", range(4), base_lr=0.02, warmup_steps=1, base_batch=16, global_batch=64),
        seq("warmup-odd", "ramp", range(9), base_lr=0.3, warmup_steps=7, base_batch=3, global_batch=7),
        seq("no-warmup", "no-warmup", range(6), base_lr=0.1, warmup_steps=0, **ws),
        seq("no-warmup-goyal", "no-warmup", range(3), base_lr=0.1, warmup_steps=0, base_batch=256,
            global_batch=8192),
        seq("k1", "k1", range(8), base_lr=0.1, warmup_steps=5, base_batch=glob, global_batch=glob),
        seq("smaller-batch", "smaller", range(7), base_lr=0.1, warmup_steps=4, base_batch=2 * glob,
            global_batch=glob),
        seq("cosine", "cosine", range(21), base_lr=0.1, warmup_steps=4, total_steps=20, **ws),
        seq("cosine-no-warmup", "cosine", range(11), base_lr=0.05, warmup_steps=0, total_steps=10, **ws),
        seq("cosine-k1", "cosine", range(9), base_lr=0.1, warmup_steps=2, total_steps=8, base_batch=glob,
            global_batch=glob),
        invalid("scaled_lr", "base_lr-0", base_lr=0.0, base_batch=32, global_batch=64),
        invalid("scaled_lr", "base_lr-negative", base_lr=-0.1, base_batch=32, global_batch=64),
        invalid("scaled_lr", "base_lr-nan", base_lr=math.nan, base_batch=32, global_batch=64),
        invalid("scaled_lr", "base_lr-inf", base_lr=math.inf, base_batch=32, global_batch=64),
        invalid("scaled_lr", "base_batch-0", base_lr=0.1, base_batch=0, global_batch=64),
        invalid("scaled_lr", "global_batch-negative", base_lr=0.1, base_batch=32, global_batch=-64),
        invalid("scaled_lr", "base_batch-float", base_lr=0.1, base_batch=32.5, global_batch=64),
        invalid("scaled_lr", "global_batch-bool", base_lr=0.1, base_batch=1, global_batch=True),
        invalid("warmup_lr", "step-negative", step=-1, **good),
        invalid("warmup_lr", "step-float", step=1.5, **good),
        invalid("warmup_lr", "warmup_steps-negative", step=0, **{**good, "warmup_steps": -1}),
        invalid("warmup_lr", "warmup_steps-float", step=0, **{**good, "warmup_steps": 2.5}),
        invalid("warmup_lr", "total_steps-equal-warmup", step=0, **good, total_steps=5),
        invalid("warmup_lr", "total_steps-below-warmup", step=0, **good, total_steps=3),
        invalid("warmup_lr", "step-past-total", step=21, **good, total_steps=20),
        invalid("warmup_lr", "base_lr-0", step=0, **{**good, "base_lr": 0.0}),
        invalid("warmup_lr", "global_batch-0", step=3, **{**good, "global_batch": 0}),
        invalid("warmup_scheduler", "base_lr-negative", **{**good, "base_lr": -1.0}),
        invalid("warmup_scheduler", "warmup_steps-negative", **{**good, "warmup_steps": -2}),
        invalid("warmup_scheduler", "total_steps-below-warmup", **good, total_steps=2),
        {"case": "ddp", "group": "ddp", "fn": "warmup_scheduler",
         "kwargs": dict(base_lr=0.05, warmup_steps=DDP_WARMUP, **ws), "steps": list(range(DDP_STEPS)),
         "group_lr_ratio": [1.0, 0.1]},
        {"case": "ddp-cosine", "group": "ddp", "fn": "warmup_scheduler",
         "kwargs": dict(base_lr=0.05, warmup_steps=DDP_WARMUP, total_steps=DDP_STEPS, **ws),
         "steps": list(range(DDP_STEPS + 1)), "group_lr_ratio": [1.0, 0.1]},
    ]
    names = [c["case"] for c in cases]
    assert len(set(names)) == len(names), "every case needs a name of its own (records and raw files are by name)"
    return cases


# --- running one case (inside the rank: what the submission returned or raised, nothing judged) -------------
def as_float(value) -> float | None:
    """A returned learning rate as a float for the record; None when it is not a real number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        return None
    return float(value)


def run_sequence(case: dict, module, guard) -> dict:
    fn = getattr(module, case["fn"])
    values = []
    with guard.watching():
        for step in case["steps"]:
            value = fn(step, **case["kwargs"])
            lr = as_float(value)
            if lr is None:
                raise TypeError(f"{case['fn']}(step={step}) returned a {type(value).__name__}, not a number")
            values.append(lr)
    return {"values": values}


def run_scaled(case: dict, module, guard) -> dict:
    with guard.watching():
        value = module.scaled_lr(**case["kwargs"])
    lr = as_float(value)
    if lr is None:
        raise TypeError(f"scaled_lr returned a {type(value).__name__}, not a number")
    return {"values": [lr]}


def run_invalid(case: dict, module, guard) -> dict:
    """What the call raised: its type's name and those it derives from (the grader decides whether that is a
    ValueError), or None when it returned."""
    fn = getattr(module, case["fn"])
    try:
        with guard.watching():
            if case["fn"] == "scaled_lr":
                fn(**case["kwargs"])
            elif case["fn"] == "warmup_lr":
                fn(case["step"], **case["kwargs"])
            else:
                fn(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), **case["kwargs"])
    except Exception as err:  # noqa: BLE001 - the wrong exception is a wrong answer, not a grader crash
        return {"raised": type(err).__name__, "raised_types": [c.__name__ for c in type(err).__mro__],
                "message": jobkit.one_line(err, guard.submission)}
    return {"raised": None, "raised_types": []}


def run_ddp(case: dict, module, guard) -> dict:
    """Real DDP steps under the submission's scheduler: every group's lr at each step in case["steps"]
    (len(steps) - 1 optimizer steps; the last value is what a next step would use)."""
    ctx = runtime.context()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(ctx.device)
    model = DDP(net)
    base_lr = case["kwargs"]["base_lr"]
    groups = [{"params": net[0].parameters(), "lr": base_lr * case["group_lr_ratio"][0]},
              {"params": net[2].parameters(), "lr": base_lr * case["group_lr_ratio"][1]}]
    opt = torch.optim.SGD(groups, lr=base_lr, momentum=0.9)
    with guard.watching():
        sched = module.warmup_scheduler(opt, **case["kwargs"])
    if not hasattr(sched, "step"):
        raise TypeError(f"warmup_scheduler returned a {type(sched).__name__}, not an LR scheduler")
    gen = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own batch, as in data parallelism
    lrs = [[float(g["lr"]) for g in opt.param_groups]]  # step 0's, set when the scheduler was created
    for _ in case["steps"][1:]:
        x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)).backward()
        opt.step()
        with guard.watching():
            sched.step()
        lrs.append([float(g["lr"]) for g in opt.param_groups])  # the next step's
    return {"group_lrs": lrs}


def runner(case: dict):
    """The function that runs `case`, chosen when the plan is made (before the submission is imported)."""
    if case["group"].startswith("invalid"):
        return run_invalid
    return {"scaled": run_scaled, "ddp": run_ddp}.get(case["group"], run_sequence)


class Ex04Job(jobkit.GradingJob):
    """ex04's grading job: the schedule's values, its refusals and a few DDP steps, for this world size."""

    name, wanted = "ex04", FUNCTIONS
    case_limit = 10.0

    def options(self, parser) -> None:
        parser.add_argument("--batch-per-rank", type=int, default=32)

    def prepare(self) -> None:
        # The first optimizer a process creates imports torch's compiler stack (5 s or more on a busy machine):
        # pay for it here, not inside a case's time limit.
        torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), lambda _: 1.0)

    def make_guard(self, comm) -> jobkit.Guard:
        guard = jobkit.Guard(comm)
        guard.submission = self.submission  # tracebacks are reported at the submission's own lines
        return guard

    def plan(self) -> list[tuple]:
        # Each case's runner is bound now, before the import: a submission that rebinds this module's functions
        # changes nothing that runs.
        return [(case["case"], case["group"], functools.partial(runner(case), case))
                for case in plan(self.ctx.world_size, self.args.batch_per_rank)]

    def plan_fields(self) -> dict:
        return {"batch_per_rank": self.args.batch_per_rank}


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
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
    for case in plan(world, BATCH_PER_RANK):
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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex04Job)
