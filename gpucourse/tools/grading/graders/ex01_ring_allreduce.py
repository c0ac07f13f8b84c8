"""Grader of ex01: ring all-reduce from point-to-point messages (run it with `gpucourse grade ex01`).

One real job per world size (1, 2, 3, 4 ranks, through gpucourse.launch) runs every case on the submission
(ex01_ring_allreduce.py) and saves what it returned; the tests below compare that, here in the grader process, with the
sum of the ranks' inputs, recomputed from the job's own plan. Every test also requires point-to-point only: a
collective anywhere scores zero.

In each rank (this file, run by torchrun through gpucourse.launch): one grading job for ex01 (ring all-reduce):
every check of one world size, in one launch.

    ex01_ring_allreduce.py SUBMISSION.py [--case-limit SECONDS] [--bandwidth]

The checks below launch it through gpucourse.launch, once per world size. Each rank
logs one record per case through jobkit.record_writer, in runtime.log's format (the tests read them from
RunResult.metrics), and saves the case's tensors raw: what the submission returned and the caller's tensor
afterwards. The rank judges nothing; the grader process recomputes every sum from the same inputs (`plan`,
`make_input`, `expected`) and compares (`compare`):

    {"case": "awkward-n5", "group": "awkward", "error": None, "raw": ["after", "out"], "returned": "Tensor",
     "returned_self": True, "same_storage": True, "collectives": [], "sent_bytes": 40, "nbytes": 20, ...}

The submission runs under guard: every collective it calls is recorded while it runs, through whichever layer
(comm_recorder: dist, c10d, the functional collectives, ProcessGroup/Backend), the bytes it sends are
counted, what it prints is capped, and a watchdog
ends the rank (after logging why) when a case takes longer than --case-limit: a deadlock, an endless
loop or an early exit costs the cases it breaks, not the grading run.
"""
import functools
import math
import re
import statistics
import time
from pathlib import Path

import pytest
import torch

from gpucourse.models import costs
from gpucourse.run import runtime
from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
FUNCTION = "ring_all_reduce"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
BANDWIDTH_BYTES = 4 * 2**20
BANDWIDTH_REPEATS = 9  # paired samples (ours, then gloo's): the grader takes the median of their ratios
BANDWIDTH_CALLS = 3  # back-to-back calls per sample: one call (~15 ms) is shorter than a busy machine's hiccups
PEER_LOST = re.compile(r"Connection closed by peer|Read error|Connection reset|Broken pipe")  # another rank died


# --- the guard: what the submission calls, sends and prints ---------------------------------------
class Guard(jobkit.Guard):
    """While the submission runs, comm_recorder notes every collective it calls, through any layer, and the
    bytes it sends. The calls still work (so correctness is still checked); the tests score zero when a
    collective was used. The grader's own dist.all_reduce and barrier run outside watching(): unrecorded."""

    @property
    def collectives(self) -> list[str]:
        return self.comm.collectives()

    @property
    def sent_bytes(self) -> int:
        return self.comm.sent_bytes

    def one_line(self, err: BaseException) -> str:
        return jobkit.one_line(err, self.submission)


# --- the cases --------------------------------------------------------------------------------------
def plan(world: int) -> list[tuple[str, str, tuple, torch.dtype, str]]:
    """(case, group, shape, dtype, values) for this world size; values 'ints' compare exactly, 'randn' closely."""
    cases = [(f"basic-n{n}", "basic", (n,), torch.float32, "ints") for n in (world, 256 * world, 16384 * world)]
    cases.append((f"basic-randn-n{4096 * world}", "basic", (4096 * world,), torch.float32, "randn"))
    for n in sorted({0, 1, max(world - 1, 1), world + 1, 2 * world + 1, 1000003}):
        cases.append((f"awkward-n{n}", "awkward", (n,), torch.float32, "ints"))
    for dname, dtype in DTYPES.items():
        cases.append((f"dtype-{dname}", "dtype", (10 * world + 3,), dtype, "ints"))
    for shape in ((3, 5, 7), (), (2, 1, 4, 3), (4, world + 1), (0, 5)):
        cases.append((f"shape-{'x'.join(map(str, shape)) or 'scalar'}", "shape", shape, torch.float32, "ints"))
    return cases


def make_input(index: int, rank: int, shape, dtype, values) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * index + rank)
    if values == "randn":
        return torch.randn(shape, generator=gen, dtype=dtype)
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)  # sums of small integers are exact in every dtype


def compare(value, expected: torch.Tensor, values: str) -> dict:
    if not isinstance(value, torch.Tensor):
        return {"matches": False, "detail": f"returned {type(value).__name__}, not a tensor"}
    if value.shape != expected.shape or value.dtype != expected.dtype:
        return {"matches": False, "detail": f"returned shape {tuple(value.shape)} {value.dtype}, "
                                            f"expected {tuple(expected.shape)} {expected.dtype}"}
    got, want = value.detach().double().reshape(-1), expected.double().reshape(-1)
    tol = 1e-5 * (1 + want.abs()) if values == "randn" else torch.zeros_like(want)
    bad = ~((got - want).abs() <= tol)  # NaN counts as wrong
    if not bad.any():
        return {"matches": True, "detail": ""}
    i = int(bad.nonzero()[0])
    first = f"first at flat index {i}: got {got[i].item():g}, expected {want[i].item():g}"
    return {"matches": False, "detail": f"{int(bad.sum())} of {want.numel()} elements differ from dist.all_reduce "
                                        f"({first})"}


@functools.lru_cache(maxsize=None)
def expected(world: int, case: str) -> tuple[torch.Tensor, str]:
    """(the sum every rank must hold after `case` on `world` ranks, its values kind): computed from the ranks'
    inputs in float64 (exact for the integer cases), in the grader process, once per case (every rank's record and
    every submission of a batch is compared with it: callers must not modify it)."""
    for index, (name, _, shape, dtype, values) in enumerate(plan(world)):
        if name == case:
            total = sum(make_input(index, rank, shape, dtype, values).double() for rank in range(world))
            return total.to(dtype), values
    raise KeyError(f"ex01 plans no case {case!r} on {world} rank(s)")


def run_case(index, shape, dtype, values, module, guard) -> dict:
    """Call the submission on this rank's input; keep what it returned and what the caller's tensor holds."""
    tensor = make_input(index, runtime.context().rank, shape, dtype, values)
    ptr, record = tensor.data_ptr(), {"numel": tensor.numel(), "nbytes": tensor.numel() * tensor.element_size(),
                                      "elem": tensor.element_size()}
    try:
        with guard.watching():
            out = getattr(module, FUNCTION)(tensor)
        record["error"] = None
    except BaseException as err:  # noqa: BLE001 - SystemExit and friends are the submission's bugs too
        out, record["error"], record["peer_lost"] = None, guard.one_line(err), bool(PEER_LOST.search(str(err)))
    record.update(collectives=guard.collectives, sent_bytes=guard.sent_bytes, returned_self=out is tensor,
                  same_storage=tensor.data_ptr() == ptr, returned=type(out).__name__)
    if record["error"] is None:
        record["raw"] = {"out": out if isinstance(out, torch.Tensor) else None, "after": tensor}
    return record


def measure_bandwidth(module, guard) -> dict:
    """Seconds per call on this rank of the submission and of gloo's all_reduce, same buffer size, in pairs.

    Each repeat times BANDWIDTH_CALLS calls of ours, then as many of gloo's, each after a barrier: the two
    halves of a pair see the same machine, so the grader can compare them pair by pair (median of ratios)
    and a burst of load from elsewhere spoils one pair, not the verdict.
    """
    n, fn, world = BANDWIDTH_BYTES // 4, getattr(module, FUNCTION), runtime.context().world_size
    ours, gloo, used = [], [], set()
    buf = torch.randn(n)
    for repeat in range(BANDWIDTH_REPEATS + 1):  # the first round warms up both
        for name, call, times in (("ours", fn, ours), ("gloo", guard.dist.all_reduce, gloo)):
            works = [buf.clone() for _ in range(BANDWIDTH_CALLS)]
            guard.dist.barrier()
            start = time.perf_counter()
            for work in works:
                if name == "ours":
                    with guard.watching():
                        call(work)
                    used.update(guard.collectives)
                else:
                    call(work)
            elapsed = (time.perf_counter() - start) / BANDWIDTH_CALLS
            if repeat:
                times.append(elapsed)
    return {"nbytes": BANDWIDTH_BYTES, "ours_s": ours, "gloo_s": gloo, "world": world, "collectives": sorted(used)}


class Ex01Job(jobkit.GradingJob):
    """ex01's grading job: every case of one world size, then (--bandwidth) the timing against gloo."""

    name, wanted = "ex01", (FUNCTION,)
    preload = jobkit.PRELOAD_BASE  # no dispatch mode, no DDP: nothing heavy to import
    barrier_between_cases = True  # a rank that failed before a send must not meet its peers' next case
    reason = "a deadlock (a rank waiting for a message never sent), an endless loop, or far too slow"

    def options(self, parser) -> None:
        parser.add_argument("--bandwidth", action="store_true", help="also time the submission against gloo")

    def make_guard(self, comm) -> Guard:
        guard = Guard(comm)
        guard.submission = self.submission  # tracebacks are reported at the submission's own lines
        return guard

    def plan(self) -> list[tuple]:
        cases = [(case, group, functools.partial(run_case, index, shape, dtype, values))
                 for index, (case, group, shape, dtype, values) in enumerate(plan(self.ctx.world_size))]
        if self.args.bandwidth and self.ctx.world_size > 1:
            cases.append(("bandwidth", "bandwidth", measure_bandwidth, 4 * self.args.case_limit))
        return cases

    def fields(self) -> dict:  # a case that raised still reports the collectives it had called
        return {"collectives": self.guard.collectives}


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
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
    """compare() of the rank's raw `which` ("out": what it returned, "after": the caller's tensor) with the
    sum recomputed here."""
    want, values = expected(world, rec["case"])
    got = raw(rec)[which]
    if got is None:
        return {"matches": False, "detail": f"returned {rec.get('returned')}, not a tensor"}
    return compare(got, want, values)


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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex01Job)
