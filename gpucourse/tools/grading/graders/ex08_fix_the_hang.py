"""Grader of ex08: fix a training loop that hangs (run it with `gpucourse grade ex08_fix_the_hang`).

One real 3-rank job (ex08_fix_the_hang.py, through gpucourse.launch) with uneven shards: 7, 4 and 5 training
batches, 2, 3 and 0 evaluation batches. The tests read its records and the parameters it saved, and compare them
with what the grader process computes itself from the job's data and model (`reference`):
- common_steps: every rank gets the smallest count (one rank with 0; all equal);
- evaluate: the mean squared error over every rank's data, the same on every rank; eval mode while
  evaluating, the previous mode afterwards, no gradients;
- train: completes (no hang) on every rank, with 4 steps, the evaluations after steps 1 and 3, and the
  parameters of one process that averages every rank's gradient for those 4 steps.
A hang is reported in one line: which rank was last doing what (each rank follows its collectives, the
model's forwards and the start of each backward).

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex08 (fix the hang): every
check, on 3 ranks with uneven shards, in one launch.

    ex08_fix_the_hang.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it through gpucourse.launch. Each rank logs one record per case
(jobkit.record_writer, in runtime.log's format) with what the submission returned, and saves the trained
parameters raw; the rank judges nothing. The grader process computes the references itself from this script's
data and model (`reference`, `reference_eval`), for example

    {"case": "train-uneven", "group": "train", "error": None, "steps": 4, "evals": [[1, 0.93], [3, 0.88]],
     "raw": ["params"]}

Cases:
  steps-*      common_steps(n) with a different n on each rank (one rank with 0; all equal)
  evaluate-*   evaluate() on uneven eval shards (one rank holds none); the model's mode during and after,
               whether autograd was on in its forwards, and whether gradients were created
  train-uneven train() on uneven shards: its steps, evaluations and the parameters afterwards (the grader runs
               one process that takes the same steps on every rank's batch)

What the submission does is followed: every collective and point-to-point call it makes (comm_recorder: any
layer), every forward of the model and the start of every backward (where DDP all-reduces the gradients). When
a case runs past --case-limit (a hang), the rank logs "hung: rank r was last doing ..." and ends; ranks that
finished the case log their result first, and each rank prints what it is doing to its stdout, so a rank that
crashes (gloo aborts on a size mismatch) can be read from its log.
"""
import functools
import math
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse.run import runtime
from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
TRAIN_COUNTS = (7, 4, 5)  # batches per rank (rank r % 3): uneven shards
EVAL_COUNTS, EVAL_SIZES = (2, 3, 0), (4, 3, 5)  # rank 2 holds no evaluation data
STEP_COUNTS = {"steps-uneven": (5, 7, 3), "steps-zero": (4, 0, 2), "steps-equal": (6, 6, 6)}
EVAL_EVERY, BATCH, LR = 2, 4, 0.1
WAITING = "returned from the submission"  # what a rank that finished a case says while it waits for the others


# --- data, model and the single-process reference (computed in the grader process) -------------------------------------------------
def batches(seed: int, count: int, size: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randn(size, 1, generator=g)) for _ in range(count)]


def train_data(rank: int) -> list:
    return batches(100 + rank, TRAIN_COUNTS[rank % 3], BATCH)


def eval_data(rank: int) -> list:
    return batches(200 + rank, EVAL_COUNTS[rank % 3], EVAL_SIZES[rank % 3])


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def make_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)


def reference_eval(net: nn.Module, world: int) -> float:
    sse, count = 0.0, 0
    with torch.no_grad():
        for rank in range(world):
            for x, y in eval_data(rank):
                sse += mse_loss(net(x), y, reduction="sum").double().item()
                count += y.numel()
    return sse / count


def reference(world: int) -> dict:
    """One process: step s averages the gradients of every rank's batch s, for min(counts) steps."""
    net = make_net()
    opt = make_optimizer(net)
    data = [train_data(rank) for rank in range(world)]
    steps = min(len(d) for d in data)
    evals = []
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            x, y = data[rank][step]
            (mse_loss(net(x), y) / world).backward()
        opt.step()
        if (step + 1) % EVAL_EVERY == 0:
            evals.append([step, reference_eval(net, world)])
    return {"steps": steps, "evals": evals, "params": [p.detach().clone() for p in net.parameters()],
            "eval0": reference_eval(make_net(), world)}


# --- following what the submission does -------------------------------------------------------------
class Tracker:
    """What this rank was last doing, for the hang report: collectives, forwards, backwards."""

    def __init__(self, rank: int, submission: str):
        self.rank, self.submission, self.last, self.forwards = rank, submission, "starting", 0
        self.case = "no case"  # the case being run, for the line a rank that returned says while it waits

    def doing(self, what: str) -> None:
        self.last = what
        print(f"[grader] rank {self.rank}: {what}", file=sys.__stdout__, flush=True)

    def where(self) -> str:
        frames = [f for f in traceback.extract_stack() if f.filename == self.submission]
        return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""

    def follow(self, comm) -> None:
        """Note each collective and point-to-point call the submission starts (comm_recorder: any layer)."""
        def noted(event: dict) -> None:
            if event["kind"] != "wait":
                self.doing(f"{event['via']}{self.where()}")

        comm.on_event = noted

    def watch(self, model: nn.Module) -> None:
        """Forward pre-hook and a hook on the output's gradient: the start of each backward."""

        def before_forward(module, inputs):
            self.forwards += 1
            mode = "train" if module.training else "eval"
            self.doing(f"the model's forward #{self.forwards} ({mode} mode){self.where()}")
            self.modes.append(mode)
            self.autograd.append(torch.is_grad_enabled())

        def after_forward(module, inputs, output):
            n = self.forwards
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self.doing(
                    f"backward of forward #{n}, where DDP all-reduces the gradients{self.where()}"))

        self.modes, self.autograd, self.forwards = [], [], 0  # counted per case
        model.register_forward_pre_hook(before_forward)
        model.register_forward_hook(after_forward)


class HangWatchdog(jobkit.Watchdog):
    """jobkit's watchdog, whose reason is what this rank was last doing when the time ran out."""

    def __init__(self, tracker: Tracker, log):
        self.tracker = tracker
        super().__init__("", log)

    @property
    def reason(self) -> str:
        return f"hung: rank {self.tracker.rank} was last doing {self.tracker.last}"

    @reason.setter
    def reason(self, value) -> None:
        pass


# --- the cases (inside the rank: what the submission returned and did, nothing judged) -------------------
def run_steps(case: str, module, guard) -> dict:
    counts = STEP_COUNTS[case]
    with guard.watching():
        got = module.common_steps(counts[dist.get_rank() % 3])
    return {"got": got if isinstance(got, int) and not isinstance(got, bool) else repr(got)}


def run_evaluate(case: str, tracker: Tracker, module, guard) -> dict:
    model = DDP(make_net())
    tracker.watch(model)
    model.train(case == "evaluate-uneven")  # evaluate-eval-mode: an already evaluating model stays in eval mode
    before = model.training
    with guard.watching():
        value = module.evaluate(model, eval_data(dist.get_rank()))
    return {"value": float(value) if isinstance(value, (float, int)) and not isinstance(value, bool) else None,
            "type": type(value).__name__, "modes": sorted(set(tracker.modes)),
            "mode_before": before, "mode_after": model.training, "autograd": any(tracker.autograd),
            "grads": any(p.grad is not None for p in model.parameters())}


def run_train(tracker: Tracker, module, guard) -> dict:
    rank = dist.get_rank()
    model = DDP(make_net())
    tracker.watch(model)
    with guard.watching():
        out = module.train(model, make_optimizer(model), train_data(rank), eval_data(rank), eval_every=EVAL_EVERY)
    if not isinstance(out, dict):
        raise TypeError(f"train returned a {type(out).__name__}, not a dict with 'steps' and 'evals'")
    evals = out.get("evals")
    return {"steps": out.get("steps"), "evals": [[int(s), float(v)] for s, v in evals] if evals else evals,
            "raw": {"params": [p.detach().clone() for p in model.module.parameters()]}}


class HangGuard(jobkit.Guard):
    """jobkit's guard, whose barrier between cases (the grader's, run by run_cases after each record) first says
    that this rank returned and waits, and ends the rank when a peer has ended (its own watchdog, a crash): the
    peer's record says why, and this rank must not meet the next case alone."""

    def __init__(self, comm, tracker: Tracker):
        super().__init__(comm)
        barrier = self.dist.barrier  # the grader's own, taken before the submission is imported

        def wait_for_the_others() -> None:
            tracker.doing(f"{tracker.case}: {WAITING}; waiting for the other ranks")
            try:
                barrier()
            except RuntimeError:
                sys.__stdout__.flush()
                os._exit(3)

        self.dist.barrier = wait_for_the_others


CASES = {**{c: "steps" for c in STEP_COUNTS}, "evaluate-uneven": "evaluate", "evaluate-eval-mode": "evaluate",
         "train-uneven": "train"}


class Ex08Job(jobkit.GradingJob):
    """ex08's grading job: one rank of the 3-rank job; a hang is reported as what each rank was last doing."""

    name, wanted = "ex08", ("common_steps", "evaluate", "train")
    case_limit = 15.0
    barrier_between_cases = True  # HangGuard's barrier: says the rank is waiting, ends it when a peer has ended

    def setup(self):
        # A collective that never completes raises after this long, should the watchdog not end the rank first.
        return runtime.setup(seed=0, timeout_s=3 * self.args.case_limit)

    def prepare(self) -> None:
        # The first optimizer a process creates imports torch's compiler stack (5 s or more on a busy machine), and
        # the first forward and backward warm up autograd: pay for them here, not inside a case's time limit.
        net = make_net()
        opt = make_optimizer(net)
        mse_loss(net(torch.zeros(1, 6)), torch.zeros(1, 1)).backward()
        opt.step()

    def make_guard(self, comm) -> "HangGuard":
        self.tracker = Tracker(self.ctx.rank, self.submission)
        self.tracker.follow(comm)
        return HangGuard(comm, self.tracker)

    def make_watchdog(self, log) -> HangWatchdog:
        return HangWatchdog(self.tracker, log)

    def plan(self) -> list[tuple]:
        def announced(case: str, group: str, run):
            def case_run(module, guard) -> dict:
                what = "common_steps" if group == "steps" else group
                self.tracker.case = f"case {case}"
                self.tracker.doing(f"case {case}: in the submission's {what}()")
                return run(module, guard)
            return case_run

        runs = {"steps": lambda case: functools.partial(run_steps, case),
                "evaluate": lambda case: functools.partial(run_evaluate, case, self.tracker),
                "train": lambda case: functools.partial(run_train, self.tracker)}
        return [(case, group, announced(case, group, runs[group](case))) for case, group in CASES.items()]


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
WORLD = 3
CASE_LIMIT_S = 15
JOB_TIMEOUT_S = 150
TOLERANCE = 1e-5  # float32, 4 steps; the reference solution reaches ~1e-7


@pytest.fixture(scope="module")
def job(submission) -> JobRecords:
    return launch_jobs(JOB, submission, [WORLD], name="grade-ex08", case_limit=CASE_LIMIT_S, timeout=JOB_TIMEOUT_S,
                       stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})[WORLD]


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
def cached_reference() -> dict:
    """One process taking the job's steps on every rank's batch (steps, evaluations, parameters), and the
    evaluation of the untrained model."""
    return {**reference(WORLD), "eval0": reference_eval(make_net(), WORLD)}


# --- what makes one rank's record wrong ------------------------------------------------------------
def steps_problem(rec) -> str | None:
    counts = STEP_COUNTS[rec["case"]]
    want = min(counts[r % 3] for r in range(WORLD))
    if rec["got"] != want:
        return f"common_steps returned {rec['got']!r}; the smallest count of all ranks is {want}"
    return None


def eval_value_problem(rec) -> str | None:
    want = cached_reference()["eval0"]
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
    ref = cached_reference()
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
    got, want = rec["evals"], cached_reference()["evals"]
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
    steps = cached_reference()["steps"]
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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex08Job)
