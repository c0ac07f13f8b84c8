"""The grading job of ex03 (predict scaling): measure on this machine, then call the submission on the measurements.

    ex03_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex03_predict_scaling.py launches it on 2 ranks. Before the submission is imported, every rank measures
(`Ex03Job.prepare`):
  - an all-reduce sweep (SIZES bytes, the median of REPEATS calls each after a barrier, the ranks' medians
    averaged), fitted with gpucourse.costs.fit_alpha_beta (the grader's fit: the predictions get it);
  - a training step of an MLP (the median forward and backward time of STEPS steps, the ranks' averaged);
  - the MLP's gradient bytes (its trainable parameters);
and logs them in the "plan" record, still before the import. Every rank then logs one record per case with
what the submission returned, and nothing else, e.g.

    {"case": "step-measured", "group": "step", "got": [0.021, ...], "error": None}

The rank judges nothing: the test rebuilds every case's inputs from this script's own `plan`, given the
measurements of the "plan" record, and computes the expected values with gpucourse.costs; nothing here is
judged by how fast it ran. The fixed cases (FIXED) are configurations where each plausible mistake changes the
answer whatever this machine measured; the measured ones are this machine's.
"""
import functools
import math
import numbers
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from gpucourse.grading import jobkit  # what every grading job shares
from gpucourse import costs

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


if __name__ == "__main__":
    jobkit.main(Ex03Job)
