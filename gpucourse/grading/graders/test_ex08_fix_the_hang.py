"""Grader of ex08: fix a training loop that hangs (run it with `gpucourse grade ex08`).

One real 3-rank job (ex08_job.py, through gpucourse.launch) with uneven shards: 7, 4 and 5 training
batches, 2, 3 and 0 evaluation batches. The tests read its records and the parameters it saved, and compare them
with what the grader process computes itself from the job's data and model (`CASES.reference`):
- common_steps: every rank gets the smallest count (one rank with 0; all equal);
- evaluate: the mean squared error over every rank's data, the same on every rank; eval mode while
  evaluating, the previous mode afterwards, no gradients;
- train: completes (no hang) on every rank, with 4 steps, the evaluations after steps 1 and 3, and the
  parameters of one process that averages every rank's gradient for those 4 steps.
A hang is reported in one line: which rank was last doing what (each rank follows its collectives, the
model's forwards and the start of each backward).
"""
import functools
import math
from pathlib import Path

import pytest

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex08_job.py")
CASES = job_module(JOB)  # its data, model and optimizer: the single-process reference is computed here
WORLD = 3
CASE_LIMIT_S = 15
JOB_TIMEOUT_S = 150
TOLERANCE = 1e-5  # float32, 4 steps; the reference solution reaches ~1e-7


@pytest.fixture(scope="module")
def job(submission) -> JobRecords:
    return launch_jobs(JOB, submission, [WORLD], name="grade-ex08", case_limit=CASE_LIMIT_S, timeout=JOB_TIMEOUT_S,
                       stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})[WORLD]


WAITING = CASES.WAITING  # what a rank that finished the case says while it waits for the others
SIGNALS = {-6: "SIGABRT: gloo aborts when the ranks' collectives do not match in size", -9: "SIGKILL",
           -15: "SIGTERM: stopped when another rank failed", 3: "its time limit"}


def last_doing(job: JobRecords, rank: int) -> str:
    """The last thing `rank` said it was doing (its stdout), for a rank that ended without a record."""
    lines = [ln for ln in job.result.log(rank).splitlines() if ln.startswith(f"[grader] rank {rank}: ")]
    return lines[-1].split(": ", 1)[1] if lines else "(nothing recorded)"


def rank_story(job: JobRecords, rec: dict) -> str:
    """What one rank of a case that did not finish everywhere was doing."""
    rank = rec.get("rank", 0)
    if rec.get("timed_out"):
        doing = rec["error"].split(" was last doing ", 1)[-1]
        return f"rank {rank} had returned" if WAITING in doing else f"rank {rank} was last doing {doing}"
    if rec.get("ended") or rec.get("peer_lost"):
        code = job.result.returncodes.get(rank)
        how = f"exit code {code}" + (f", {SIGNALS[code]}" if code in SIGNALS else "")
        doing = last_doing(job, rank)
        if WAITING in doing:
            return f"rank {rank} had returned"
        return f"rank {rank} ended ({how}) while doing {doing}"
    return f"rank {rank} had returned" if not rec.get("error") else f"rank {rank} failed: {rec['error']}"


def hang_report(job: JobRecords, case: str, records: list[dict]) -> str | None:
    """One line when the case hung or a rank vanished during it: which rank was last doing what."""
    if not any(rec.get("timed_out") or rec.get("ended") or rec.get("peer_lost") for rec in records):
        return None
    hung = any(rec.get("timed_out") and WAITING not in rec["error"] for rec in records)
    return f"{case} {'hung' if hung else 'crashed'}: " + "; ".join(rank_story(job, rec) for rec in records)


def judge(job: JobRecords, case: str, problem) -> None:
    """Fail with the case's hang report, else job_records.check's (problem(rec) -> None when right)."""
    report = hang_report(job, case, job.ranks(case))
    if report:
        pytest.fail(report, pytrace=False)
    check(job, [case], problem)


def same_on_every_rank(job: JobRecords, case: str, key: str) -> None:
    values = [rec.get(key) for rec in job.ranks(case)]
    if any(v != values[0] for v in values):
        pytest.fail(f"{case}: ranks returned different {key}: {values}", pytrace=False)


# --- the references, computed here -----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """One process taking the job's steps on every rank's batch (steps, evaluations, parameters), and the
    evaluation of the untrained model."""
    return {**CASES.reference(WORLD), "eval0": CASES.reference_eval(CASES.make_net(), WORLD)}


# --- what makes one rank's record wrong ------------------------------------------------------------
def steps_problem(rec) -> str | None:
    counts = CASES.STEP_COUNTS[rec["case"]]
    want = min(counts[r % 3] for r in range(WORLD))
    if rec["got"] != want:
        return f"common_steps returned {rec['got']!r}; the smallest count of all ranks is {want}"
    return None


def eval_value_problem(rec) -> str | None:
    want = reference()["eval0"]
    if rec["value"] is None:
        return f"evaluate returned a {rec['type']}, not a Python float"
    if not math.isclose(rec["value"], want, rel_tol=1e-6):
        return (f"evaluate returned {rec['value']:.6g}; the mean squared error over every rank's elements is "
                f"{want:.6g} (sum squared errors and counts on each rank, all_reduce both, divide)")
    return None


def eval_mode_problem(rec) -> str | None:
    if rec["modes"] not in ([], ["eval"]):
        return f"the model ran forward in {' and '.join(rec['modes'])} mode during evaluate: call model.eval()"
    if rec["mode_after"] != rec["mode_before"]:
        before = "train" if rec["mode_before"] else "eval"
        return f"the model was in {before} mode before evaluate and is not afterwards: restore its mode"
    if rec.get("autograd"):
        return ("evaluate ran the model with autograd on (it records a graph for a backward that never comes): "
                "run the forwards under torch.no_grad()")
    if rec["grads"]:
        return "evaluate created gradients: run the forwards under torch.no_grad()"
    return None


def train_problem(rec) -> str | None:
    ref = reference()
    if rec["steps"] != ref["steps"]:
        return f"train ran {rec['steps']!r} steps; every rank can run {ref['steps']} (the smallest shard)"
    params = raw(rec)["params"]
    if len(params) != len(ref["params"]) or any(p.shape != q.shape for p, q in zip(params, ref["params"])):
        return "after train, the model's parameters changed in number or shape"
    diff = max((p.double() - q.double()).abs().max().item() for p, q in zip(params, ref["params"]))
    if not diff <= TOLERANCE:  # NaN is wrong too
        return (f"after train, the parameters differ from one process running the same {ref['steps']} "
                f"steps by {diff:.2g} (tolerance {TOLERANCE:g})")
    return None


def train_evals_problem(rec) -> str | None:
    got, want = rec["evals"], reference()["evals"]
    if not isinstance(got, list) or [s for s, _ in got] != [s for s, _ in want]:
        return f"train returned evals at steps {[s for s, _ in got] if got else got}; expected {[s for s, _ in want]}"
    for (step, value), (_, expected) in zip(got, want):
        if not math.isclose(value, expected, rel_tol=1e-4):
            return f"the evaluation after step {step} is {value:.6g}, expected {expected:.6g}"
    return None


# --- the tests -------------------------------------------------------------------------------------
@pytest.mark.points(1)
@pytest.mark.parametrize("case", ["steps-uneven", "steps-zero", "steps-equal"])
def test_common_steps(job, case):
    """Counts (5, 7, 3), (4, 0, 2) and (6, 6, 6): every rank gets the smallest."""
    judge(job, case, steps_problem)


@pytest.mark.points(2)
def test_evaluate_over_every_ranks_data(job):
    """Evaluation shards of 2x4, 3x3 and no elements: the mean over all of them, the same on every rank."""
    judge(job, "evaluate-uneven", eval_value_problem)
    same_on_every_rank(job, "evaluate-uneven", "value")


@pytest.mark.points(1)
@pytest.mark.parametrize("case", ["evaluate-uneven", "evaluate-eval-mode"])
def test_evaluate_mode_and_no_grad(job, case):
    """Eval mode during evaluation; the model left in train (or eval) mode as it was; no gradients."""
    judge(job, case, eval_mode_problem)


@pytest.mark.points(2)
def test_train_finishes_on_uneven_shards(job):
    """7, 4 and 5 batches: train returns on every rank, within the time limit, after the same 4 steps."""
    steps = reference()["steps"]
    judge(job, "train-uneven", lambda rec: None if rec["steps"] == steps else
          f"train returned steps={rec['steps']!r}; every rank can run {steps}")


@pytest.mark.points(3)
def test_train_matches_single_process(job):
    """The parameters after train equal one process averaging every rank's gradient, step for step."""
    judge(job, "train-uneven", train_problem)


@pytest.mark.points(2)
def test_train_evaluates_on_every_rank(job):
    """Evaluations after steps 1 and 3, equal to the reference, identical on every rank."""
    judge(job, "train-uneven", train_evals_problem)
    same_on_every_rank(job, "train-uneven", "evals")
