"""The grading job of ex05 (GPipe step): every case for this job's number of stages, in one launch.

    ex05_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex05_gpipe.py launches it through gpucourse.launch on 2 and 4 ranks (one stage per rank). Every rank
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

import torch
import torch.distributed as dist
from torch import nn

from gpucourse.grading import jobkit  # what every grading job shares
from gpucourse import runtime

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


if __name__ == "__main__":
    jobkit.main(Ex05Job)
