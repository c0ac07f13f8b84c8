"""One grading job for ex01 (ring all-reduce): every check of one world size, in one launch.

    ex01_job.py SUBMISSION.py [--case-limit SECONDS] [--bandwidth]

test_ex01_ring_allreduce.py launches it through gpucourse.launch, once per world size. Each rank
logs one record per case with runtime.log (the tests read them from RunResult.metrics):

    {"case": "awkward-n5", "group": "awkward", "error": None, "matches": True, "in_place": True,
     "collectives": [], "sent_bytes": 40, "nbytes": 20, ...}

The submission runs under guard: every collective of torch.distributed (and of ProcessGroup) is
recorded while it runs, the bytes it sends are counted, what it prints is capped, and a watchdog
ends the rank (after logging why) when a case takes longer than --case-limit: a deadlock, an endless
loop or an early exit costs the cases it breaks, not the grading run.
"""
import argparse
import contextlib
import os
import re
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend, ProcessGroup

import jobkit  # beside this script: what every grading job shares
from gpucourse import runtime

FUNCTION = "ring_all_reduce"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
BANDWIDTH_BYTES = 4 * 2**20
BANDWIDTH_REPEATS = 9  # paired samples (ours, then gloo's): the grader takes the median of their ratios
BANDWIDTH_CALLS = 3  # back-to-back calls per sample: one call (~15 ms) is shorter than a busy machine's hiccups
# Collective method names of ProcessGroup, Backend and the functional collectives (not send/recv, not allocate_*).
COLLECTIVE_RE = re.compile(r"^_?(all_?(reduce|gather|to_?all)|reduce|gather|scatter|broadcast|(monitored_)?barrier)")
DIST_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list", "_broadcast_coalesced",
    "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather_coalesced",
    "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier")
PEER_LOST = re.compile(r"Connection closed by peer|Read error|Connection reset|Broken pipe")  # another rank died
SUBMISSION = [""]  # its path, set by main(): tracebacks are reported at the submission's own lines
REAL_ALL_REDUCE, REAL_BARRIER = dist.all_reduce, dist.barrier  # the job's own, kept before the guard wraps them


# --- the guard: what the submission calls, sends and prints ---------------------------------------
class Guard(jobkit.Guard):
    """Wraps torch.distributed while the submission runs. The wrapped calls still work (so correctness is
    still checked); the tests score zero when a collective was used."""

    def __init__(self):
        super().__init__()
        self.collectives: list[str] = []
        self.sent_bytes = 0

    def reset(self) -> None:
        self.collectives, self.sent_bytes = [], 0

    def install(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        for module in (dist, c10d):
            for name in DIST_COLLECTIVES:
                if callable(getattr(module, name, None)):
                    setattr(module, name, self._recorder(f"dist.{name}", getattr(module, name)))
        with contextlib.suppress(ImportError):
            import torch.distributed._functional_collectives as funcol

            for name, fn in list(vars(funcol).items()):
                if callable(fn) and not isinstance(fn, type) and COLLECTIVE_RE.search(name):
                    setattr(funcol, name, self._recorder(f"functional_collectives.{name}", fn))
        for cls in (ProcessGroup, Backend):  # the process group and its gloo backend, called directly
            for name, fn in list(vars(cls).items()):
                if COLLECTIVE_RE.search(name) and callable(fn):
                    setattr(cls, name, self._recorder(f"{cls.__name__}.{name}", fn))
            cls.send = self._counter(cls.send)  # every send, isend and batch_isend_irecv ends in one of these

    def _counter(self, real_send):
        def send(pg, tensors, *args, **kwargs):
            if self.active:
                self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)
            return real_send(pg, tensors, *args, **kwargs)

        return send

    def _recorder(self, name, fn):
        def note(*args, **kwargs):
            if name not in self.collectives:
                self.collectives.append(name)

        return self.wrap(fn, note)


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


def one_line(err: BaseException) -> str:
    return jobkit.one_line(err, SUBMISSION[0])


def reference(tensor: torch.Tensor, values: str) -> torch.Tensor:
    """PyTorch's own all_reduce (called outside the guard); integer data is summed in float64, exactly."""
    expected = tensor.to(torch.float64 if values == "ints" else tensor.dtype, copy=True)  # never the input itself
    REAL_ALL_REDUCE(expected)
    return expected.to(tensor.dtype)


def run_case(fn, guard, index, case, group, shape, dtype, values) -> dict:
    ctx = runtime.context()
    tensor = make_input(index, ctx.rank, shape, dtype, values)
    expected = reference(tensor, values)
    ptr, record = tensor.data_ptr(), {"case": case, "group": group, "numel": tensor.numel(),
                                      "nbytes": tensor.numel() * tensor.element_size(), "elem": tensor.element_size()}
    try:
        with guard.watching():
            out = fn(tensor)
        record["error"] = None
    except BaseException as err:  # noqa: BLE001 - SystemExit and friends are the submission's bugs too
        out, record["error"], record["peer_lost"] = None, one_line(err), bool(PEER_LOST.search(str(err)))
    record.update(collectives=guard.collectives, sent_bytes=guard.sent_bytes, returned_self=out is tensor,
                  same_storage=tensor.data_ptr() == ptr)
    if record["error"] is None:
        record.update(compare(out, expected, values))
        record["in_place"] = compare(tensor, expected, values)["matches"] and out is tensor and record["same_storage"]
    return record


def measure_bandwidth(fn, guard, world) -> dict:
    """Seconds per call on this rank of the submission and of gloo's all_reduce, same buffer size, in pairs.

    Each repeat times BANDWIDTH_CALLS calls of ours, then as many of gloo's, each after a barrier: the two
    halves of a pair see the same machine, so the grader can compare them pair by pair (median of ratios)
    and a burst of load from elsewhere spoils one pair, not the verdict.
    """
    n = BANDWIDTH_BYTES // 4
    ours, gloo, used = [], [], set()
    buf = torch.randn(n)
    for repeat in range(BANDWIDTH_REPEATS + 1):  # the first round warms up both
        for name, call, times in (("ours", fn, ours), ("gloo", REAL_ALL_REDUCE, gloo)):
            works = [buf.clone() for _ in range(BANDWIDTH_CALLS)]
            REAL_BARRIER()
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--case-limit", type=float, default=15.0)
    parser.add_argument("--bandwidth", action="store_true", help="also time the submission against gloo")
    args = parser.parse_args()
    SUBMISSION[0] = os.path.abspath(args.submission)
    ctx = runtime.setup(seed=0)
    guard, watchdog = Guard(), jobkit.Watchdog(
        "a deadlock (a rank waiting for a message never sent), an endless loop, or far too slow")
    guard.install()
    cases = plan(ctx.world_size)
    runtime.log(case="plan", cases={case: group for case, group, *_ in cases})

    module = jobkit.import_or_exit(args.submission, "ex01", [FUNCTION], guard.watching, watchdog, args.case_limit)
    fn = getattr(module, FUNCTION)

    for index, (case, group, shape, dtype, values) in enumerate(cases):
        with watchdog.case_limit(case, group, args.case_limit):
            runtime.log(**run_case(fn, guard, index, case, group, shape, dtype, values))
    if args.bandwidth and ctx.world_size > 1:
        with watchdog.case_limit("bandwidth", "bandwidth", 4 * args.case_limit):
            try:
                record = {"error": None, **measure_bandwidth(fn, guard, ctx.world_size)}
            except BaseException as err:  # noqa: BLE001
                record = {"error": one_line(err), "collectives": guard.collectives}
            runtime.log(case="bandwidth", group="bandwidth", **record)
    runtime.log(case="done")
    runtime.teardown()


if __name__ == "__main__":
    main()
