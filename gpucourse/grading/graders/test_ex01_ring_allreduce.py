"""Grader of ex01: ring all-reduce from point-to-point messages (run it with `gpucourse grade ex01`).

One real job per world size (1, 2, 3, 4 ranks, through gpucourse.launch) runs every case on the submission
(ex01_job.py) and saves what it returned; the tests below compare that, here in the grader process, with the
sum of the ranks' inputs, recomputed from the job's own plan. Every test also requires point-to-point only: a
collective anywhere scores zero.
"""
import math
import statistics
from pathlib import Path

import pytest

from gpucourse import costs
from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex01_job.py")
CASES = job_module(JOB)  # its plan, inputs and comparison: the expected sums are computed here
WORLD_SIZES = (1, 2, 3, 4)
BANDWIDTH_WORLD = 4
MIN_BUSBW_RATIO = 0.25  # of gloo's, same job; a correct ring measured 0.5-0.9x with the machine overloaded
CASE_LIMIT_S = 15
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: Job}, launched once for the module. The 1-3 rank jobs run side by side (their start-up
    waits overlap on two cores); the 4-rank job runs alone afterwards, because it times bandwidth."""

    def run(worlds, extra_args=()) -> dict[int, JobRecords]:
        return launch_jobs(JOB, submission, worlds, name="grade-ex01-w{world}", case_limit=CASE_LIMIT_S,
                           timeout=JOB_TIMEOUT_S, stall_timeout=6 * CASE_LIMIT_S, extra_args=extra_args)

    out = run([w for w in WORLD_SIZES if w != BANDWIDTH_WORLD])
    return out | run([BANDWIDTH_WORLD], ["--bandwidth"])


# --- what makes one rank's record of one case wrong (None when it is right) ------------------------
def p2p_problem(rec, world) -> str | None:
    if rec.get("collectives"):
        return f"called {', '.join(rec['collectives'])}: only send/recv/isend/irecv/batch_isend_irecv are allowed"
    return None


def compared(rec, world, which: str) -> dict:
    """CASES.compare of the rank's raw `which` ("out": what it returned, "after": the caller's tensor) with the
    sum recomputed here."""
    want, values = CASES.expected(world, rec["case"])
    got = raw(rec)[which]
    if got is None:
        return {"matches": False, "detail": f"returned {rec.get('returned')}, not a tensor"}
    return CASES.compare(got, want, values)


def value_problem(rec, world) -> str | None:
    if problem := p2p_problem(rec, world):
        return problem
    result = compared(rec, world, "out")
    return None if result["matches"] else result["detail"] or "wrong result"


def in_place_problem(rec, world) -> str | None:
    if problem := p2p_problem(rec, world):
        return problem
    if not rec.get("same_storage"):
        return "the caller's tensor now points to other memory: write the result into its own storage"
    if not rec.get("returned_self"):
        return "returned a different tensor object: return the tensor you were given"
    if not compared(rec, world, "after")["matches"]:
        return "the caller's tensor does not hold the sum afterwards (did you reduce a copy?)"
    return None


def traffic_problem(rec, world) -> str | None:
    problem = p2p_problem(rec, world)
    if problem:
        return problem
    # A ring sends 2(N-1) chunks of at most ceil(n/N) elements; 1 KiB of slack for small headers.
    limit = 2 * (world - 1) * math.ceil(rec["numel"] / world) * rec["elem"] + 1024
    if rec["sent_bytes"] > limit:
        return (f"sent {rec['sent_bytes']} bytes for a {rec['nbytes']}-byte tensor on {world} ranks; a ring "
                f"sends 2(N-1)/N of it, at most {limit} (gathering everything on one rank sends (N-1)x)")
    return None


def judge(jobs, worlds, cases, problem, **kwargs) -> None:
    """job_records.check over these world sizes' jobs, each record judged by problem(rec, its world size)."""
    for world in worlds:
        job = jobs[world]
        every = [case for case, group in job.plan.items() if group != "bandwidth"]  # the timed case is judged apart
        check(job, every if cases is None else cases, lambda rec, w=world: problem(rec, w), **kwargs)


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_all_reduce(jobs, world):
    """Float32 tensors whose length divides evenly, and random values, equal dist.all_reduce's sum."""
    judge(jobs, [world], "basic", value_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_awkward_lengths(jobs, world):
    """Lengths 0, 1, N-1, N+1, 2N+1 and 1000003: chunks of unequal (or zero) size."""
    judge(jobs, [world], "awkward", value_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_dtype(jobs, dtype):
    """Half, bfloat16, single and double precision: the sum comes back in the same dtype."""
    judge(jobs, WORLD_SIZES, [f"dtype-{dtype}"], value_problem)


@pytest.mark.points(2)
def test_shapes(jobs):
    """3-d, 4-d, 0-d (scalar) and empty 2-d tensors keep their shape and get the sum."""
    judge(jobs, WORLD_SIZES, "shape", value_problem)


@pytest.mark.points(2)
def test_in_place(jobs):
    """The caller's tensor object, at its own memory, holds the sum, and is what is returned."""
    judge(jobs, WORLD_SIZES, None, in_place_problem, only_cases_that_ran=True)


@pytest.mark.points(2)
def test_only_point_to_point(jobs):
    """No collective anywhere in the submission (the job records every call while it runs)."""
    judge(jobs, WORLD_SIZES, None, p2p_problem, only_cases_that_ran=True)


@pytest.mark.points(2)
def test_traffic_is_bandwidth_optimal(jobs):
    """Each rank sends at most 2(N-1)/N of the tensor's bytes (plus rounding), counted at the process group."""
    for world in WORLD_SIZES[1:]:
        check(jobs[world], jobs[world].cases("basic") + jobs[world].cases("awkward"),
              lambda rec, w=world: traffic_problem(rec, w), only_cases_that_ran=True)


@pytest.mark.points(2)
def test_bus_bandwidth_vs_gloo(jobs, timing):
    """At 4 MiB on 4 ranks, the ring reaches at least a quarter of gloo's own all_reduce bus bandwidth (timed)."""
    j = jobs[BANDWIDTH_WORLD]
    check(j, ["bandwidth"], lambda rec: p2p_problem(rec, BANDWIDTH_WORLD))
    recs = j.ranks("bandwidth")
    # Per sample the slowest rank sets the time. Ours and gloo's were timed in pairs, back to back: the median
    # of the pairs' ratios shrugs off the bursts of load (other jobs, other tests) that spoil a few pairs.
    ours = [max(times) for times in zip(*(r["ours_s"] for r in recs))]
    gloo = [max(times) for times in zip(*(r["gloo_s"] for r in recs))]
    ratio = statistics.median(g / o for g, o in zip(gloo, ours))  # = busbw ratio: same bytes, same world
    nbytes, world = recs[0]["nbytes"], BANDWIDTH_WORLD
    ours_bw, gloo_bw = (costs.busbw("all_reduce", nbytes, statistics.median(t), world) for t in (ours, gloo))
    timing.check(ratio >= MIN_BUSBW_RATIO,
                 f"busbw {ratio:.2f}x gloo's (median of {len(ours)} paired samples; {ours_bw / 1e9:.3f} vs "
                 f"{gloo_bw / 1e9:.3f} GB/s at {nbytes >> 20} MiB on {world} ranks), needs >= {MIN_BUSBW_RATIO}x",
                 "whole-chunk tensor ops, no Python loops")
