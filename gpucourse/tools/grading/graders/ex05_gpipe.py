"""Grader of ex05: one GPipe step over p stage processes (run it with `gpucourse grade ex05`).

Two real jobs side by side (2 and 4 ranks, one stage per rank, through gpucourse.launch; ex05_gpipe.py) run
every case on the submission and save each stage's gradients and returned loss raw; the tests below compare
them, here in the grader process, with the unsplit model run on the full batch from the job's own seeds, and
read the rest of the records. What is checked:
- every stage's gradients, and the loss returned by the last rank, equal the unsplit model's on the full
  batch (mean loss), for (p, m) = (2, 1), (2, 4), (2, 3) with 3-d activations, (4, 1), (4, 4), (4, 3), (4, 8);
  the other ranks return None;
- the stage's forward runs once per micro-batch, and the micro-batches are really pipelined: with stages
  that take a known time per micro-batch, stage s+1 starts micro-batch 0 before stage s ends its last one;
- GPipe's schedule, from the order of each stage's own forwards, backwards and sends (no clocks): every
  forward before any backward, and each output sent before the next micro-batch's forward starts;
- n_micro < 1, and a batch not divisible by n_micro, raise ValueError;
- only point-to-point communication: no torch.distributed collective is called, and send/recv are.

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex05 (GPipe step): every case
for this job's number of stages, in one launch.

    ex05_gpipe.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it through gpucourse.launch on 2 and 4 ranks (one stage per rank). Every rank
builds the same model from the same seed (`make_model`) and keeps its own slice of it as its stage; after
gpipe_step it saves, raw, what the submission produced: the stage's gradients and what gpipe_step returned.
The rank judges nothing: the grader process runs the whole model on the full batch itself (`reference`) and
compares. Each rank logs one record per case (jobkit.record_writer), e.g.

    {"case": "equiv-p2-m4", "group": "equiv", "error": None, "raw": ["grads", "loss"], "returned": "tensor",
     "forward_calls": 4, "forward_times": [[t0, t1], ...], "order": "FSfFSf...", "collectives": [],
     "p2p_calls": 16}

Cases (`specs`): equivalence with the unsplit model for several micro-batch counts (2-d and 3-d activations
of changing widths), an overlap case whose stages sleep a known time per micro-batch (the tests compare the
stages' forward times across ranks), and invalid arguments (last: a submission that does not reject them
may hang, and the watchdog then ends the rank). Each equivalence case also records the stage's schedule as
"order": F and f where a forward starts and ends, B where backward reaches its output, S for each send.
The submission runs under guard: every collective it calls, through any layer, is recorded (and still
runs, so that a rank does not hang waiting for the others), point-to-point calls are counted, its output is
capped, and a watchdog ends the rank, after logging why, when a case runs longer than --case-limit.
"""
import functools
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpucourse.run import runtime
from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
SLEEP_S = 0.1  # per micro-batch forward in the overlap cases: long against a send, and a busy machine's delays
MODEL_SEED = 11


# --- the guard ------------------------------------------------------------------------------------
class Guard(jobkit.Guard):
    """Records the collectives and counts the point-to-point calls the submission makes (comm_recorder: any
    layer), and notes each send in the stage's schedule as it happens."""

    def __init__(self, comm, submission: str):
        super().__init__(comm)
        self.submission = submission  # tracebacks are reported at the submission's own lines
        self.order = ""  # this rank's schedule: F/f a forward starts/ends, B a backward reaches it, S a send
        comm.on_event = self._noted

    def reset(self) -> None:
        self.order = ""

    def _noted(self, event: dict) -> None:
        self.order += "S" * event["sends"]

    @property
    def collectives(self) -> list[str]:
        return self.comm.collectives()

    @property
    def p2p(self) -> int:
        return sum(e["kind"] == "p2p" for e in self.comm.events)

    def one_line(self, err: BaseException) -> str:
        return jobkit.one_line(err, self.submission)


# --- the models and the data: the same in every rank and in the grader process ---------------------
class Sleepy(nn.Module):
    """A layer that also sleeps a known time: stage compute long enough to see overlap on a loaded machine."""

    def __init__(self, inner: nn.Module, seconds: float):
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.inner(x)


def make_model(n_stages: int, first_width: int = 12, out_width: int = 5) -> list[nn.Module]:
    """n_stages blocks of two Linear+Tanh layers; the widths change from stage to stage, so every stage sends
    and receives activations of its own shape. Seeded: the same model wherever it is built."""
    torch.manual_seed(MODEL_SEED)
    widths = [first_width] + [16 + 4 * (i % 3) for i in range(2 * n_stages - 1)] + [out_width]
    layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])]
    return [nn.Sequential(*layers[2 * s:2 * s + 2]) for s in range(n_stages)]


def data(batch: int, seq: int | None, in_width: int = 12, out_width: int = 5):
    gen = torch.Generator().manual_seed(7)
    shape = (batch,) if seq is None else (batch, seq)
    return torch.randn(*shape, in_width, generator=gen), torch.randn(*shape, out_width, generator=gen)


def specs(world: int) -> list[tuple[str, str, dict]]:
    """(case, group, options) in the order they run on `world` stages."""
    cases = [(f"equiv-p{world}-m1", "equiv", {"batch": 8, "n_micro": 1}),
             (f"equiv-p{world}-m4", "equiv", {"batch": 8, "n_micro": 4}),
             (f"equiv-p{world}-m3-3d", "equiv", {"batch": 6, "n_micro": 3, "seq": 3}),
             (f"overlap-p{world}-m4", "overlap", {"batch": 8, "n_micro": 4, "sleep": SLEEP_S})]
    if world == 4:
        cases.insert(3, (f"equiv-p{world}-m8", "equiv", {"batch": 16, "n_micro": 8}))
    if world == 2:  # invalid arguments last: a submission that ignores them may hang until the watchdog
        cases += [("invalid-n_micro-0", "invalid", {"batch": 8, "n_micro": 0}),
                  ("invalid-batch-6-m4", "invalid", {"batch": 6, "n_micro": 4})]
    return cases


def options(world: int, case: str) -> dict:
    for name, _, opts in specs(world):
        if name == case:
            return opts
    raise KeyError(f"ex05 plans no case {case!r} on {world} stage(s)")


def reference(world: int, case: str) -> dict:
    """The unsplit model on the full batch, in one process (the grader's): {"loss": the mean loss, "grads":
    [{parameter name: gradient} of each stage]}. Computed in the grader process, never in a rank."""
    opts = options(world, case)
    blocks = make_model(world)
    x, y = data(opts["batch"], opts.get("seq"))
    loss = nn.MSELoss()(nn.Sequential(*blocks)(x), y)
    loss.backward()
    return {"loss": loss.detach(), "grads": [{n: p.grad for n, p in block.named_parameters()} for block in blocks]}


# --- the cases, as each rank runs them: what the submission produced, saved raw ---------------------
def watch_forward(stage: nn.Module) -> list[list[float]]:
    """[[start, end], ...] wall-clock times of every call of stage's forward (comparable across ranks)."""
    times: list[list[float]] = []
    stage.register_forward_pre_hook(lambda module, args: times.append([time.time(), None]))

    def done(module, args, output):
        times[-1][1] = time.time()

    stage.register_forward_hook(done)
    return times


def watch_order(stage: nn.Module, guard: Guard) -> None:
    """Note in guard.order when each forward of the stage starts (F) and ends (f), and when backward reaches
    its output (B): with the sends the guard notes (S), the stage's schedule, whatever the clocks say."""

    def ended(module, args, output):
        guard.order += "f"
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: setattr(guard, "order", guard.order + "B"))

    stage.register_forward_pre_hook(lambda module, args: setattr(guard, "order", guard.order + "F"))
    stage.register_forward_hook(ended)


def case_equiv(gpipe_step, guard, batch, n_micro, seq=None, sleep=0.0):
    rank, world = dist.get_rank(), dist.get_world_size()
    block = make_model(world)[rank]
    stage = Sleepy(block, sleep) if sleep else block
    times = watch_forward(stage)
    watch_order(stage, guard)
    x, y = data(batch, seq)
    first, last = rank == 0, rank == world - 1
    with guard.watching():
        out = gpipe_step(stage, x if first else None, y if last else None, nn.MSELoss(), n_micro)
    returned = "None" if out is None else "tensor" if isinstance(out, torch.Tensor) else type(out).__name__
    loss = out if isinstance(out, (torch.Tensor, float)) else None
    return {"raw": {"grads": {n: p.grad for n, p in block.named_parameters()}, "loss": loss}, "returned": returned,
            "forward_calls": len(times), "forward_times": times, "collectives": guard.collectives,
            "p2p_calls": guard.p2p, "order": guard.order}


def case_invalid(gpipe_step, guard, batch, n_micro):
    """Arguments to reject: which exception each rank raised (None: it returned)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = make_model(world)[rank]
    x, y = data(batch, None)
    raised = None
    with guard.watching():
        try:
            gpipe_step(stage, x if rank == 0 else None, y if rank == world - 1 else None, nn.MSELoss(), n_micro)
        except Exception as err:  # noqa: BLE001 - which exception it is, is what this case records
            raised = {"type": type(err).__name__, "value_error": isinstance(err, ValueError),
                      "line": guard.one_line(err)}
    return {"raised": raised, "collectives": guard.collectives}


class Ex05Job(jobkit.GradingJob):
    """ex05's grading job: every case on this job's number of stages (one per rank)."""

    name, wanted = "ex05", ("gpipe_step",)
    reason = ("a deadlock (a recv no rank sends to, or two ranks both waiting in send/recv for each other), an "
              "endless loop, or far too slow")

    def setup(self):
        return runtime.setup(seed=0, seed_per_rank=False)

    def prepare(self) -> None:
        torch.set_num_threads(1)
        # The first `tensor.backward(gradient)` of a process imports sympy (seconds on a loaded machine): pay for
        # it here, not inside the first case's time limit (and not as a stall of every stage waiting for the next).
        torch.ones(2, requires_grad=True).mul(2).backward(torch.ones(2))

    def make_guard(self, comm) -> Guard:
        return Guard(comm, self.submission)

    def plan(self) -> list[tuple]:
        run = {"equiv": case_equiv, "overlap": case_equiv, "invalid": case_invalid}
        return [(case, group, functools.partial(run[group], **opts)) for case, group, opts in
                specs(self.ctx.world_size)]

    def case_args(self, module) -> tuple:
        return module.gpipe_step, self.guard

    def fields(self) -> dict:  # a case that raised still reports the collectives it had called
        return {"collectives": self.guard.collectives}


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
WORLD_SIZES = (2, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 180
TOLERANCE = 1e-5  # float32; the reference reaches ~1e-8


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{number of stages: JobRecords}: the two jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex05-p{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- what makes one rank's record wrong (None when it is right) -----------------------------------
@functools.lru_cache(maxsize=None)
def cached_reference(world: int, case: str) -> dict:
    """The unsplit model's loss and every stage's gradients on the case's full batch (one process, this one)."""
    return reference(world, case)


def n_micro(world: int, case: str) -> int:
    return options(world, case)["n_micro"]


def grad_problem(rec, world) -> str | None:
    got, want = raw(rec)["grads"], cached_reference(world, rec["case"])["grads"][rec["rank"]]
    missing = sum(got.get(name) is None for name in want)
    if missing:
        return f"{missing} parameter(s) of this stage have no .grad after gpipe_step: run the backward"
    diffs = [(got[n].double() - w.double()).abs().max().item() if got[n].shape == w.shape else float("nan")
             for n, w in want.items()]
    diff = max(diffs, key=lambda d: float("inf") if d != d else d)  # NaN is the worst
    if not diff <= TOLERANCE:  # NaN is wrong too
        scales = [(got[n].norm() / w.norm()).item() for n, w in want.items() if got[n].shape == w.shape]
        scale = sum(scales) / len(scales) if scales else float("nan")
        micro = n_micro(world, rec["case"])
        hint = (f"they are {scale:.3g}x the reference: scale each micro-batch loss by 1/n_micro" if
                abs(scale - micro) < 0.01 * micro and micro > 1 else
                "every micro-batch's backward must run once, with the gradient the next stage sent for it")
        return (f"gradients differ from the unsplit model's on the full batch by {diff:.2g} (tolerance "
                f"{TOLERANCE:g}); {hint}")
    return None


def loss_problem(rec, world) -> str | None:
    if rec["rank"] != world - 1:
        return None if rec["returned"] == "None" else f"returned a {rec['returned']}; only the last rank returns the loss"
    loss = raw(rec)["loss"]
    if loss is None or (isinstance(loss, torch.Tensor) and loss.numel() != 1):
        return f"the last rank returned {rec['returned']}, not the loss (a 0-dim tensor)"
    loss, want = float(loss), cached_reference(world, rec["case"])["loss"].item()
    if not abs(loss - want) <= TOLERANCE * max(1.0, abs(want)):
        return (f"returned loss {loss:.6g}, the unsplit model's mean loss on the full batch is "
                f"{want:.6g}: sum the micro-batch losses, each divided by n_micro")
    return None


def calls_problem(rec, world) -> str | None:
    micro = n_micro(world, rec["case"])
    if rec["forward_calls"] != micro:
        return (f"the stage's forward ran {rec['forward_calls']} time(s) for n_micro={micro}: call "
                f"stage(x) once per micro-batch")
    return None


def comm_problem(rec, world) -> str | None:
    if rec.get("collectives"):
        return f"called {rec['collectives'][0]}: only send/recv/isend/irecv/batch_isend_irecv are allowed"
    return None


def overlap_case_problem(rec, world) -> str | None:
    """What is wrong with the overlap case besides its timing: forward once per micro-batch, each returning."""
    if calls_problem(rec, world) or rec["forward_times"][-1][1] is not None:  # forward_calls == n_micro >= 1 ran
        return calls_problem(rec, world)
    return "its last forward never returned"


def pipeline_lead(recs: list[dict]) -> tuple[int, float]:
    """(s, seconds) for the stage pair that overlaps least: how long before stage s ended its last forward
    stage s+1 began its first (negative: stage s+1 waited for the whole batch)."""
    leads = [recs[s]["forward_times"][-1][1] - recs[s + 1]["forward_times"][0][0] for s in range(len(recs) - 1)]
    s = min(range(len(leads)), key=leads.__getitem__)
    return s, leads[s]


def order_problem(rec, world) -> str | None:
    """GPipe runs every micro-batch's forward before any backward (rec["order"]: F/f forward start/end,
    B backward reaches the stage's output, S a send)."""
    order = rec.get("order", "")
    first_backward, last_forward = order.find("B"), order.rfind("f")
    if 0 <= first_backward < last_forward:
        done = order[:first_backward].count("f")
        return (f"a backward started when {done} of {n_micro(world, rec['case'])} forwards had run: GPipe runs the "
                f"forward of every micro-batch, then the backward of every one (one micro-batch at a time is no "
                f"pipeline)")
    return None


def streaming_problem(rec, world) -> str | None:
    """Every stage but the last sends each micro-batch's output before it starts the next micro-batch's forward."""
    if rec["rank"] == world - 1:
        return None
    order = rec.get("order", "")
    starts = [i for i, event in enumerate(order) if event == "F"]
    for micro, (start, stop) in enumerate(zip(starts, starts[1:] + [len(order)])):
        if "S" not in order[start:stop].split("B")[0]:  # from this forward to the next forward or backward
            after = ("its backward began" if "B" in order[start:stop] or micro + 1 == len(starts) else
                     f"micro-batch {micro + 1}'s forward began")
            return (f"micro-batch {micro}'s output was not sent before {after}: send each output on as soon as it "
                    f"is computed, so that the next stage works while this one goes on")
    return None


def invalid_problem(rec, world) -> str | None:
    raised, opts = rec["raised"], options(world, rec["case"])
    holds_data = rec["rank"] in (0, world - 1)  # the first stage holds the batch, the last the targets
    if not (opts["n_micro"] < 1 or holds_data):
        return None
    what = (f"n_micro={opts['n_micro']}" if opts["n_micro"] < 1 else
            f"a batch of {opts['batch']} with n_micro={opts['n_micro']}")
    if raised is None:
        return f"{what} was accepted: raise ValueError before any communication"
    if not raised["value_error"]:
        return f"{what} raised {raised['line']}, expected ValueError"
    return None


def judge(jobs, worlds, cases, problem) -> None:
    """job_records.check over these numbers of stages' jobs, each record judged by problem(rec, its job's number
    of stages) (known from the run folder the grader read the record from, not from anything the rank wrote)."""
    world_of = {str(jobs[w].result.run_dir): w for w in worlds}
    check({w: jobs[w] for w in worlds}, cases, lambda rec: problem(rec, world_of[str(rec["run_dir"])]))


# --- the tests ----------------------------------------------------------------------------------------
EQUIV = [(2, "m1"), (2, "m4"), (2, "m3-3d"), (4, "m1"), (4, "m4"), (4, "m3-3d"), (4, "m8")]


@pytest.mark.points(2)
@pytest.mark.parametrize("world,micro", EQUIV, ids=[f"p{w}-{m}" for w, m in EQUIV])
def test_gradients_match_unsplit_model(jobs, world, micro):
    """Every stage's .grad equals the unsplit model's gradients on the full batch (mean loss)."""
    judge(jobs, [world], [f"equiv-p{world}-{micro}"], grad_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_loss_on_last_rank(jobs, world):
    """The last rank returns the full batch's mean loss; the other ranks return None."""
    judge(jobs, [world], "equiv", loss_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_forward_once_per_micro_batch(jobs, world):
    """stage(x) runs n_micro times per step, on micro-batches, never on the full batch."""
    judge(jobs, [world], "equiv", calls_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_micro_batches_are_pipelined(jobs, world, timing):
    """Stages sleeping 100 ms per micro-batch, m=4: stage s+1 starts micro-batch 0 before stage s ends
    micro-batch 3 (timed: wall clocks of different ranks)."""
    case = f"overlap-p{world}-m4"
    judge(jobs, [world], [case], overlap_case_problem)  # the functional part decides in either timing mode
    s, lead = pipeline_lead(jobs[world].ranks(case))
    timing.check(lead > 0, f"{case}: stage {s + 1} started micro-batch 0 {1e3 * abs(lead):.0f} ms "
                           f"{'before' if lead > 0 else 'after'} stage {s} finished its last forward; needs before",
                 "send each micro-batch's output as soon as it is computed")


@pytest.mark.points(1)
def test_every_forward_before_any_backward(jobs):
    """2 and 4 stages, every micro-batch count: on each stage, every forward comes before the first backward
    (GPipe's schedule; structural: the order of the stage's own calls, no clocks)."""
    judge(jobs, WORLD_SIZES, "equiv", order_problem)


@pytest.mark.points(1)
def test_each_output_sent_before_the_next_forward(jobs):
    """2 and 4 stages: every stage but the last sends each micro-batch's output before it starts the next
    micro-batch's forward (the structural side of the pipelining test: no clocks)."""
    judge(jobs, WORLD_SIZES, "equiv", streaming_problem)


@pytest.mark.points(1)
@pytest.mark.parametrize("case", ["invalid-n_micro-0", "invalid-batch-6-m4"])
def test_invalid_arguments_raise(jobs, case):
    """n_micro=0 (every rank), and a batch of 6 split into 4 (the ranks holding the batch or the targets),
    raise ValueError."""
    judge(jobs, [2], [case], invalid_problem)


@pytest.mark.points(2)
def test_only_point_to_point(jobs):
    """No torch.distributed collective is called in any case, and the stages do talk with send/recv."""
    for world, job in jobs.items():
        cases = job.cases("equiv") + job.cases("overlap")
        judge(jobs, [world], cases, comm_problem)
        p2p = [rec.get("p2p_calls", 0) for case in cases for rec in job.ranks(case)]
        assert all(n > 0 for n in p2p), f"{world} stages: a rank made no send/recv during gpipe_step"


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex05Job)
