"""Grader of ex03: predict data-parallel scaling from this machine's measurements (run it with `gpucourse grade ex03`).

One real 2-rank job (ex03_predict_scaling.py, through gpucourse.launch) measures an all-reduce sweep and a training step of
a small MLP, logs the measurements before the submission is imported, then calls the submission on them and on
a few fixed configurations and saves only what it returned. The expected values are computed here: each case's
inputs rebuilt from the job's own plan and the logged measurements, then the course's own model
(gpucourse.models.costs: fit_alpha_beta, collective_time, ddp_step_time). The timings only feed the functions: no test
depends on how fast anything ran.

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex03 (predict scaling):
measure on this machine, then call the submission on the measurements.

    ex03_predict_scaling.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it on 2 ranks. Before the submission is imported, every rank measures
(`Ex03Job.prepare`):
  - an all-reduce sweep (SIZES bytes, the median of REPEATS calls each after a barrier, the ranks' medians
    averaged), fitted with gpucourse.models.costs.fit_alpha_beta (the grader's fit: the predictions get it);
  - a training step of an MLP (the median forward and backward time of STEPS steps, the ranks' averaged);
  - the MLP's gradient bytes (its trainable parameters);
and logs them in the "plan" record, still before the import. Every rank then logs one record per case with
what the submission returned, and nothing else, e.g.

    {"case": "step-measured", "group": "step", "got": [0.021, ...], "error": None}

The rank judges nothing: the test rebuilds every case's inputs from this script's own `plan`, given the
measurements of the "plan" record, and computes the expected values with gpucourse.models.costs; nothing here is
judged by how fast it ran. The fixed cases (FIXED) are configurations where each plausible mistake changes the
answer whatever this machine measured; the measured ones are this machine's.
"""
import functools
import math
import numbers
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpucourse.models import costs
from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs

# --- what runs in each rank ----------------------------------------------------------------------------------------
SIZES = [2**k for k in range(8, 21, 2)]  # 256 B ... 1 MiB: small ones set alpha, large ones beta
REPEATS, WARMUP, STEPS = 7, 2, 5
WORLD_SIZES = [2**k for k in range(17)]  # 1 ... 65536: far enough that any alpha > 0 dominates
BUCKET = 2**20  # 1 MiB: the MLP's gradients fill several buckets and a remainder
FUNCTIONS = ("fit_all_reduce", "all_reduce_time", "gradient_bytes", "predicted_step_time", "scaling_efficiency",
             "comm_bound_from", "Measured")
MiB, GB = 2**20, 1e9
# Configurations where every plausible mistake shows (forward_s, backward_s, grad_bytes, alpha, beta, bucket_bytes):
FIXED = {
    "resnet50-ib-hdr": (0.033, 0.067, 4 * 25_557_032, 7e-6, 1 / (25 * GB), 25 * MiB),
    "1.3b-bf16-ib-ndr": (0.333, 0.667, 2 * 1_300_000_000, 6e-6, 1 / (50 * GB), 25 * MiB),
    "comm-heavy": (0.002, 0.004, 100_000_000, 5e-5, 1e-9, 4 * MiB),
    "one-bucket": (0.010, 0.020, 300_000, 2e-5, 2e-9, 25 * MiB),
    "whole-buckets": (0.004, 0.008, 16 * MiB, 1e-5, 5e-10, 4 * MiB),
    "backward-hides-all": (0.010, 0.500, 50 * MiB, 1e-6, 1e-10, 5 * MiB),
}
AR_FIXED = [(0, 4), (1000, 1), (1000, 2), (4 * MiB, 8), (123_457, 3), (10**9, 1024)]
FIT_FIXED = {"n": 4, "alpha": 2e-5, "beta": 1e-9}  # times made exactly from the ring model: the fit recovers them


class MLP(nn.Module):
    """The measured model: 4 layers of 384 (fp32), and a frozen bf16 embedding DDP would not all-reduce."""

    def __init__(self, width: int = 384, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(64, width).to(torch.bfloat16).requires_grad_(False)
        self.body = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))
        self.out = nn.Linear(width, 16).to(torch.bfloat16)  # trainable bf16: 2-byte gradients

    def forward(self, x):
        return self.out(self.body(x).to(torch.bfloat16)).float()


# --- measurements (the grader's, before the submission is imported) ---------------------------------------
def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def all_reduce_sweep() -> list[float]:
    times = []
    for size in SIZES:
        buf, seen = torch.ones(size // 4), []
        for i in range(WARMUP + REPEATS):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            if i >= WARMUP:
                seen.append(time.perf_counter() - start)
        times.append(mean_over_ranks(statistics.median(seen)))
    return times


def compute_step(model: nn.Module) -> tuple[float, float]:
    """Median forward and backward seconds of a training step on this rank, averaged over the ranks."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, 384, generator=gen), torch.randn(64, 16, generator=gen)
    forward, backward = [], []
    for i in range(WARMUP + STEPS):
        model.zero_grad()
        start = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        if i >= WARMUP:
            forward.append(mid - start)
            backward.append(end - mid)
    return mean_over_ranks(statistics.median(forward)), mean_over_ranks(statistics.median(backward))


def trainable_bytes(model: nn.Module) -> int:
    """The gradient bytes DDP would all-reduce: every parameter that requires a gradient, at its dtype's size."""
    return sum(p.nbytes for p in model.parameters() if p.requires_grad)


# --- the cases -----------------------------------------------------------------------------------------------
def plan(measured: dict, times: list[float], world: int, model: nn.Module) -> list[tuple]:
    """(case, group, what to call): the measured configuration and the fixed ones. The grader process calls it too,
    with the measurements the ranks logged before the import and a fresh MLP (its gradient bytes are the same)."""
    fit = FIT_FIXED
    exact = [costs.collective_time("all_reduce", s, fit["n"], fit["alpha"], fit["beta"]) for s in SIZES]
    cases = [("fit-measured", "fit", ("fit", SIZES, times, world)),
             ("fit-exact", "fit", ("fit", SIZES, exact, fit["n"])),
             ("bytes-measured-mlp", "bytes", ("bytes", model)),
             ("bytes-tied", "bytes", ("bytes", jobkit.TiedLM(seed=0))),
             ("ar-measured", "all_reduce", ("all_reduce", [(s, n) for s in SIZES for n in (1, 2, 8, 1024)],
                                            measured["alpha"], measured["beta"]))]
    cases += [(f"ar-fixed-{i}", "all_reduce", ("all_reduce", [(s, n)], 7e-6, 4e-11))
              for i, (s, n) in enumerate(AR_FIXED)]
    configs = {"measured": measured, **{name: dict(zip(("forward_s", "backward_s", "grad_bytes", "alpha", "beta",
                                                        "bucket_bytes"), v)) for name, v in FIXED.items()}}
    for name, inputs in configs.items():
        for group in ("step", "efficiency", "comm_bound"):
            cases.append((f"{group}-{name}", group, (group, inputs)))
    cases += [(f"invalid-{name}", "invalid", ("invalid", name)) for name in INVALID]
    return cases


INVALID = {  # name: (function, arguments after the Measured, if any)
    "step-world-0": ("predicted_step_time", (0,)), "step-world-float": ("predicted_step_time", (2.0,)),
    "step-world-bool": ("predicted_step_time", (True,)), "efficiency-empty": ("scaling_efficiency", ([],)),
    "efficiency-world-negative": ("scaling_efficiency", ([1, -2],)), "bound-empty": ("comm_bound_from", ([],)),
    "ar-size-negative": ("all_reduce_time", (-1, 2, 1e-5, 1e-9)), "ar-world-0": ("all_reduce_time", (10, 0, 1e-5, 1e-9)),
}


def number(value):
    """A returned number as a float for the record; its repr when it is not a finite real number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return repr(value)[:80]
    return float(value)


def run(module, guard, what: tuple) -> dict:
    """Call the submission on one case's inputs; what it returned (or raised) is the record."""
    with guard.watching():
        return called(module, guard, what)


def called(module, guard, what: tuple) -> dict:
    kind = what[0]
    if kind == "fit":
        _, sizes, times, n = what
        got = module.fit_all_reduce(list(sizes), list(times), n)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise TypeError(f"fit_all_reduce returned {type(got).__name__}, not (alpha, beta)")
        return {"got": [number(v) for v in got]}
    if kind == "bytes":
        return {"got": number(module.gradient_bytes(what[1]))}
    if kind == "all_reduce":
        _, pairs, alpha, beta = what
        return {"got": [number(module.all_reduce_time(s, n, alpha, beta)) for s, n in pairs]}
    if kind == "invalid":
        fn, args = INVALID[what[1]]
        m = module.Measured(**FIXED_INPUTS)
        try:
            getattr(module, fn)(*((m,) if fn != "all_reduce_time" else ()), *args)
        except ValueError as err:
            return {"raised": "ValueError", "message": str(err)[:200]}
        except Exception as err:  # noqa: BLE001 - the wrong exception is a wrong answer, not a grader crash
            return {"raised": jobkit.one_line(err, guard.submission)}
        return {"raised": None}
    m = module.Measured(**dict(what[1]))
    if kind == "step":
        got = [number(module.predicted_step_time(m, n)) for n in WORLD_SIZES]
    elif kind == "efficiency":
        out = module.scaling_efficiency(m, list(WORLD_SIZES))
        if not isinstance(out, dict):
            raise TypeError(f"scaling_efficiency returned a {type(out).__name__}, not a dict {{N: efficiency}}")
        got = [number(out.get(n)) for n in WORLD_SIZES]
    else:
        out = module.comm_bound_from(m, list(WORLD_SIZES))
        got = out if out is None or isinstance(out, int) and not isinstance(out, bool) else repr(out)[:80]
    return {"got": got}


FIXED_INPUTS = dict(zip(("forward_s", "backward_s", "grad_bytes", "alpha", "beta", "bucket_bytes"),
                        FIXED["comm-heavy"]))


class Ex03Job(jobkit.GradingJob):
    """ex03's grading job: this machine's measurements, then every case on 2 ranks."""

    name, wanted = "ex03", FUNCTIONS
    preload = jobkit.PRELOAD_BASE  # no dispatch mode, no DDP: nothing heavy to import
    case_limit = 10.0
    reason = "an endless loop, or far too slow (these are pure functions: no communication)"

    def setup(self):
        ctx = super().setup()
        torch.set_num_threads(1)
        return ctx

    def prepare(self) -> None:
        """The measurements, before the record writer and the import: the submission can change none of them."""
        self.times = all_reduce_sweep()
        fit = costs.fit_alpha_beta(SIZES, self.times, "all_reduce", n=dist.get_world_size())
        self.model = MLP()
        forward_s, backward_s = compute_step(self.model)
        self.measured = {"forward_s": forward_s, "backward_s": backward_s, "grad_bytes": trainable_bytes(self.model),
                         "alpha": fit.alpha, "beta": fit.beta, "bucket_bytes": BUCKET}

    def make_guard(self, comm) -> jobkit.Guard:
        guard = jobkit.Guard(comm)
        guard.submission = self.submission  # tracebacks are reported at the submission's own lines
        return guard

    def plan(self) -> list[tuple]:
        return [(case, group, functools.partial(run, what=what))
                for case, group, what in plan(self.measured, self.times, self.ctx.world_size, self.model)]

    def plan_fields(self) -> dict:  # the measurements: the grader rebuilds every case's inputs from them
        return {"measured": self.measured, "sizes": SIZES, "times": self.times}


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
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
    return rank_cases(job, rec["rank"])[rec["case"]]


@functools.lru_cache(maxsize=None)
def rank_cases(job: JobRecords, rank: int) -> dict:
    """{case: its inputs} of one rank of the job, rebuilt once from the measurements the rank logged (every record
    of the rank is judged on them: callers must not modify them)."""
    logged = job.records["plan"][rank]
    return {case: what for case, _, what in plan(logged["measured"], logged["times"], job.world, MLP())}


def judged(job: JobRecords, problem):
    """problem(what, rec) as check's problem(rec): each record judged on its case's inputs."""
    return lambda rec: problem(case_inputs(job, rec), rec)


# --- the reference: gpucourse.models.costs on the job's inputs -----------------------------------------------
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
    for n, got in zip(WORLD_SIZES, rec["got"]):
        want = model(inputs, n)
        if not close(got, want.step):
            return (f"predicted_step_time on {n} ranks for {described(rec['case'], inputs)} returned {got!r}; "
                    f"expected {want.step:.6g} s = compute {want.compute:.6g} + exposed {want.exposed:.6g} "
                    f"({want.num_buckets} buckets, {want.comm:.6g} s of all-reduce, hidden behind the backward "
                    f"pass only)")
    return None


def efficiency_problem(what, rec) -> str | None:
    inputs = what[1]
    for n, got in zip(WORLD_SIZES, rec["got"]):
        want = model(inputs, n).efficiency
        if not close(got, want):
            return (f"scaling_efficiency for {described(rec['case'], inputs)} gave {got!r} at N = {n}; weak "
                    f"scaling: compute / step = {want:.6g}")
    return None


def comm_bound_problem(what, rec) -> str | None:
    want = comm_bound(what[1], WORLD_SIZES)
    if rec["got"] != want:
        return (f"comm_bound_from for {described(rec['case'], what[1])} returned {rec['got']!r}; communication "
                f"dominates from N = {want} (exposed communication > compute there and at every larger N given)")
    return None


def invalid_problem(what, rec) -> str | None:
    if rec["raised"] == "ValueError":
        return None
    fn, args = INVALID[what[1]]
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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex03Job)
