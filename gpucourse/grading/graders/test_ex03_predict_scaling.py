"""Grader of ex03: predict data-parallel scaling from this machine's measurements (run it with `gpucourse grade ex03`).

One real 2-rank job (ex03_job.py, through gpucourse.launch) measures an all-reduce sweep and a training step of
a small MLP, logs the measurements before the submission is imported, then calls the submission on them and on
a few fixed configurations and saves only what it returned. The expected values are computed here: each case's
inputs rebuilt from the job's own plan and the logged measurements, then the course's own model
(gpucourse.costs: fit_alpha_beta, collective_time, ddp_step_time). The timings only feed the functions: no test
depends on how fast anything ran.
"""
import math
from pathlib import Path

import pytest

from gpucourse import costs

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex03_job.py")
CASES = job_module(JOB)  # its plan and models: every case's inputs are rebuilt here
WORLD = 2
CASE_LIMIT_S = 10
JOB_TIMEOUT_S = 120
REL = 1e-9  # the same formula in another order: rounding only


@pytest.fixture(scope="module")
def job(submission) -> JobRecords:
    return launch_jobs(JOB, submission, [WORLD], name="grade-ex03", case_limit=CASE_LIMIT_S, timeout=JOB_TIMEOUT_S,
                       stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})[WORLD]


# --- every case's inputs, rebuilt from the job's plan and the measurements it logged before the import ------------
def case_inputs(job: JobRecords, rec) -> tuple:
    """What the job gave the submission in `rec`'s case: ("fit", sizes, times, n), ("bytes", model),
    ("all_reduce", pairs, alpha, beta), (group, inputs) or ("invalid", name)."""
    plan = job.records["plan"][rec["rank"]]
    cases = {case: what for case, _, what in CASES.plan(plan["measured"], plan["times"], job.world, CASES.MLP())}
    return cases[rec["case"]]


def judged(job: JobRecords, problem):
    """problem(what, rec) as check's problem(rec): each record judged on its case's inputs."""
    return lambda rec: problem(case_inputs(job, rec), rec)


# --- the reference: gpucourse.costs on the job's inputs ----------------------------------------------------------
def model(inputs: dict, n: int) -> costs.DDPStep:
    compute = inputs["forward_s"] + inputs["backward_s"]
    return costs.ddp_step_time(compute, inputs["grad_bytes"], n, inputs["alpha"], inputs["beta"],
                               bucket_bytes=inputs["bucket_bytes"], backward_fraction=inputs["backward_s"] / compute,
                               overlap_cost=0.0)  # the exercise's model: overlap is free (as expected on a GPU)


def comm_bound(inputs: dict, sizes: list[int]) -> int | None:
    since = None
    for n in sorted(sizes):
        step = model(inputs, n)
        since = (since or n) if step.exposed > step.compute else None
    return since


def close(got, want) -> bool:
    return isinstance(got, float) and math.isclose(got, want, rel_tol=REL, abs_tol=1e-15)


def described(case: str, i: dict) -> str:
    """Which configuration a case is about, in a few words."""
    which = "this machine's measurements" if case.endswith("-measured") else case.split("-", 1)[1]
    return (f"{which} (forward {i['forward_s'] * 1e3:.3g} ms, backward {i['backward_s'] * 1e3:.3g} ms, "
            f"{i['grad_bytes']:,} gradient bytes in {i['bucket_bytes']:,}-byte buckets, alpha {i['alpha']:.3g} s, "
            f"beta {i['beta']:.3g} s/B)")


# --- what makes one rank's record wrong (None when right), given its case's inputs -------------------------------
def fit_problem(what, rec) -> str | None:
    _, sizes, times, n = what
    want = costs.fit_alpha_beta(sizes, times, "all_reduce", n=n)
    got = rec["got"]
    if not (close(got[0], want.alpha) or got[0] == want.alpha) or not close(got[1], want.beta):
        return (f"fit_all_reduce on {len(sizes)} sizes measured on {n} ranks returned (alpha, beta) = "
                f"{tuple(got)}; fitted to the ring all-reduce they are ({want.alpha:.6g}, {want.beta:.6g}): "
                f"costs.fit_alpha_beta(sizes, times, 'all_reduce', n=world_size)")
    return None


def bytes_problem(what, rec) -> str | None:
    params = list(what[1].parameters())
    expected = sum(p.nbytes for p in params if p.requires_grad)
    if rec["got"] == expected:
        return None
    hint = (" (that is the number of elements: multiply each by its element_size())"
            if rec["got"] == sum(p.numel() for p in params if p.requires_grad)
            else " (that counts the frozen parameters too: DDP sends only what requires a gradient)"
            if rec["got"] == sum(p.nbytes for p in params) else "")
    return f"gradient_bytes returned {rec['got']!r}; the trainable parameters hold {expected:,} bytes{hint}"


def all_reduce_problem(what, rec) -> str | None:
    _, pairs, alpha, beta = what
    for (size, n), got in zip(pairs, rec["got"]):
        want = costs.collective_time("all_reduce", size, n, alpha, beta)
        if not close(got, want):
            return (f"all_reduce_time({size}, {n}, alpha={alpha:.3g}, beta={beta:.3g}) returned {got!r}; "
                    f"the ring takes 2(N-1)·alpha + 2(N-1)/N·size·beta = {want:.6g} s")
    return None


def step_problem(what, rec) -> str | None:
    inputs = what[1]
    for n, got in zip(CASES.WORLD_SIZES, rec["got"]):
        want = model(inputs, n)
        if not close(got, want.step):
            return (f"predicted_step_time on {n} ranks for {described(rec['case'], inputs)} returned {got!r}; "
                    f"expected {want.step:.6g} s = compute {want.compute:.6g} + exposed {want.exposed:.6g} "
                    f"({want.num_buckets} buckets, {want.comm:.6g} s of all-reduce, hidden behind the backward "
                    f"pass only)")
    return None


def efficiency_problem(what, rec) -> str | None:
    inputs = what[1]
    for n, got in zip(CASES.WORLD_SIZES, rec["got"]):
        want = model(inputs, n).efficiency
        if not close(got, want):
            return (f"scaling_efficiency for {described(rec['case'], inputs)} gave {got!r} at N = {n}; weak "
                    f"scaling: compute / step = {want:.6g}")
    return None


def comm_bound_problem(what, rec) -> str | None:
    want = comm_bound(what[1], CASES.WORLD_SIZES)
    if rec["got"] != want:
        return (f"comm_bound_from for {described(rec['case'], what[1])} returned {rec['got']!r}; communication "
                f"dominates from N = {want} (exposed communication > compute there and at every larger N given)")
    return None


def invalid_problem(what, rec) -> str | None:
    if rec["raised"] == "ValueError":
        return None
    fn, args = CASES.INVALID[what[1]]
    call = f"{fn}({'m, ' if fn != 'all_reduce_time' else ''}{repr(args).strip('(),')})"
    return f"{call} {'returned' if rec['raised'] is None else 'raised ' + rec['raised']} instead of raising ValueError"


# --- the tests ------------------------------------------------------------------------------------------------------
@pytest.mark.points(2)
def test_fit_all_reduce(job):
    """The α–β fit of this machine's all-reduce sweep, and of times made exactly from the ring model."""
    check(job, "fit", judged(job, fit_problem))


@pytest.mark.points(2)
def test_gradient_bytes(job):
    """Bytes, not elements; trainable parameters only; a bf16 parameter's 2 bytes; a tied weight once."""
    check(job, "bytes", judged(job, bytes_problem))


@pytest.mark.points(2)
def test_all_reduce_time(job):
    """2(N−1)·α + 2(N−1)/N·S·β with this machine's fit and fixed values; 0 on one rank."""
    check(job, "all_reduce", judged(job, all_reduce_problem))


@pytest.mark.points(3)
def test_predicted_step_time(job):
    """compute + max(last bucket, comm − backward) at 1 … 65536 ranks, measured here and in fixed configurations."""
    check(job, "step", judged(job, step_problem))


@pytest.mark.points(2)
def test_scaling_efficiency(job):
    """compute / step(N) at every world size: weak scaling's efficiency, not a speedup."""
    check(job, "efficiency", judged(job, efficiency_problem))


@pytest.mark.points(2)
def test_comm_bound_from(job):
    """The smallest N from which exposed communication exceeds compute, or None."""
    check(job, "comm_bound", judged(job, comm_bound_problem))


@pytest.mark.points(1)
def test_rejects_invalid_arguments(job):
    """World sizes 0, 2.0, True, negative or none at all, a negative size: ValueError."""
    check(job, "invalid", judged(job, invalid_problem))
