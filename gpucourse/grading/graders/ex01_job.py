"""One grading job for ex01 (ring all-reduce): every check of one world size, in one launch.

    ex01_job.py SUBMISSION.py [--case-limit SECONDS] [--bandwidth]

test_ex01_ring_allreduce.py launches it through gpucourse.launch, once per world size. Each rank
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
import re
import time

import torch

from gpucourse.grading import comm_recorder  # what a submission communicates
from gpucourse.grading import jobkit  # what every grading job shares
from gpucourse import runtime

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


def expected(world: int, case: str) -> tuple[torch.Tensor, str]:
    """(the sum every rank must hold after `case` on `world` ranks, its values kind): computed from the ranks'
    inputs in float64 (exact for the integer cases), in the grader process."""
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


if __name__ == "__main__":
    jobkit.main(Ex01Job)
