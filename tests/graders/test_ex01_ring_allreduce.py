"""Grader of ex01: ring all-reduce from point-to-point messages (run it with `gpucourse grade ex01`).

One real job per world size (1, 2, 3, 4 ranks, through gpucourse.launch) runs every case against
the submission and PyTorch's own dist.all_reduce (ex01_job.py); the tests below read its records.
Every test also requires point-to-point only: a collective anywhere scores zero.
"""
import math
import statistics
from pathlib import Path

import pytest

from gpucourse import costs
from .job_records import JobRecords, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex01_job.py")
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
    if rec.get("error"):
        return rec["error"]
    if rec.get("collectives"):
        return f"called {', '.join(rec['collectives'])}: only send/recv/isend/irecv/batch_isend_irecv are allowed"
    return None


def value_problem(rec, world) -> str | None:
    return p2p_problem(rec, world) or (None if rec.get("matches") else rec.get("detail") or "wrong result")


def in_place_problem(rec, world) -> str | None:
    problem = p2p_problem(rec, world)
    if problem or rec.get("in_place"):
        return problem
    if not rec.get("same_storage"):
        return "the caller's tensor now points to other memory: write the result into its own storage"
    if not rec.get("returned_self"):
        return "returned a different tensor object: return the tensor you were given"
    return "the caller's tensor does not hold the sum afterwards (did you reduce a copy?)"


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


def telling(rec) -> int:
    """How much a failing rank's record says about the cause (lower: more). A rank that ended mid-case
    beats one that raised or got a wrong sum, then one that waited and timed out, then one whose peer died."""
    return 3 if rec.get("peer_lost") else 2 if rec.get("timed_out") else 0 if rec.get("ended") else 1


def most_telling(records, problem, world) -> tuple[int, str] | None:
    """(rank, reason) of the failing rank whose record says most about the cause, or None if none fails."""
    found = [(telling(rec), rec.get("rank", i), why) for i, rec in enumerate(records) if (why := problem(rec, world))]
    return min(found)[1:] if found else None


def check(jobs, cases_of, problem, *, only_cases_that_ran=False) -> None:
    """Fail with the first failing case (one line, its most telling rank), counting the others.

    only_cases_that_ran: judge a property (in place, traffic, ...) on the cases that did not raise; the
    cases that did are already lost in the correctness tests. A job in which no case ran still fails.
    """
    failures = []
    for job in jobs:
        ran, errors = 0, []
        for case in cases_of(job):
            records = job.ranks(case)
            crashed = only_cases_that_ran and most_telling(records, lambda rec, _: rec.get("error"), job.world)
            if crashed:
                errors.append(f"{job.world} rank(s), case {case}, rank {crashed[0]}: {crashed[1]}")
                continue
            ran += 1
            failed = most_telling(records, problem, job.world)
            if failed:
                failures.append(f"{job.world} rank(s), case {case}, rank {failed[0]}: {failed[1]}")
        if errors and not ran:
            failures.append(f"no case ran to the end; {errors[0]}")
    if failures:
        more = f" (and {len(failures) - 1} more failing case(s))" if len(failures) > 1 else ""
        pytest.fail(failures[0] + more, pytrace=False)


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_all_reduce(jobs, world):
    """Float32 tensors whose length divides evenly, and random values, equal dist.all_reduce's sum."""
    check([jobs[world]], lambda j: j.cases("basic"), value_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_awkward_lengths(jobs, world):
    """Lengths 0, 1, N-1, N+1, 2N+1 and 1000003: chunks of unequal (or zero) size."""
    check([jobs[world]], lambda j: j.cases("awkward"), value_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_dtype(jobs, dtype):
    """Half, bfloat16, single and double precision: the sum comes back in the same dtype."""
    check(jobs.values(), lambda j: [c for c in j.cases("dtype") if c == f"dtype-{dtype}"], value_problem)


@pytest.mark.points(2)
def test_shapes(jobs):
    """3-d, 4-d, 0-d (scalar) and empty 2-d tensors keep their shape and get the sum."""
    check(jobs.values(), lambda j: j.cases("shape"), value_problem)


@pytest.mark.points(2)
def test_in_place(jobs):
    """The caller's tensor object, at its own memory, holds the sum, and is what is returned."""
    check(jobs.values(), lambda j: j.cases(), in_place_problem, only_cases_that_ran=True)


@pytest.mark.points(2)
def test_only_point_to_point(jobs):
    """No collective anywhere in the submission (the job records every call while it runs)."""
    check(jobs.values(), lambda j: j.cases(), p2p_problem, only_cases_that_ran=True)


@pytest.mark.points(2)
def test_traffic_is_bandwidth_optimal(jobs):
    """Each rank sends at most 2(N-1)/N of the tensor's bytes (plus rounding), counted at the process group."""
    check([jobs[w] for w in WORLD_SIZES if w > 1], lambda j: j.cases("basic") + j.cases("awkward"), traffic_problem,
          only_cases_that_ran=True)


@pytest.mark.points(2)
def test_bus_bandwidth_vs_gloo(jobs, timing):
    """At 4 MiB on 4 ranks, the ring reaches at least a quarter of gloo's own all_reduce bus bandwidth (timed)."""
    j = jobs[BANDWIDTH_WORLD]
    check([j], lambda _: ["bandwidth"], p2p_problem)
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
