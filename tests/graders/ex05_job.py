"""The grading job of ex05 (GPipe step): every case for this job's number of stages, in one launch.

    ex05_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex05_gpipe.py launches it through gpucourse.launch on 2 and 4 ranks (one stage per rank). Every rank
builds the same model from the same seed, keeps its own slice of it as its stage, and also runs the whole
model by itself on the full batch: the reference. It logs one record per case (jobkit.record_writer), e.g.

    {"case": "equiv-p2-m4", "group": "equiv", "error": None, "max_grad_diff": 3e-9, "grad_scale": 0.4,
     "loss": 0.81, "ref_loss": 0.81, "returned": "tensor", "forward_calls": 4, "forward_times": [[t0, t1], ...],
     "collectives": [], "p2p_calls": 16}

Cases: equivalence with the unsplit model for several micro-batch counts (2-d and 3-d activations of
changing widths), an overlap case whose stages sleep a known time per micro-batch (the tests compare the
stages' forward times across ranks), and invalid arguments (last: a submission that does not reject them
may hang, and the watchdog then ends the rank). Each equivalence case also records the stage's schedule as
"order": F and f where a forward starts and ends, B where backward reaches its output, S for each send.
The submission runs under guard: every collective it calls, through any layer, is recorded (and still
runs, so that a rank does not hang waiting for the others), point-to-point calls are counted, its output is
capped, and a watchdog ends the rank, after logging why, when a case runs longer than --case-limit.
"""
import argparse
import copy
import functools
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import comm_recorder  # beside this script: what a submission communicates
import jobkit  # beside this script: what every grading job shares
from gpucourse import runtime

SLEEP_S = 0.1  # per micro-batch forward in the overlap cases: long against a send, and a busy machine's delays
SUBMISSION = [""]


# --- the guard ------------------------------------------------------------------------------------
class Guard(jobkit.Guard):
    """Records the collectives and counts the point-to-point calls the submission makes (comm_recorder: any
    layer), and notes each send in the stage's schedule as it happens."""

    def __init__(self, comm):
        super().__init__(comm)
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


def one_line(err: BaseException) -> str:
    return jobkit.one_line(err, SUBMISSION[0])


# --- the models -------------------------------------------------------------------------------------
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
    and receives activations of its own shape."""
    widths = [first_width] + [16 + 4 * (i % 3) for i in range(2 * n_stages - 1)] + [out_width]
    layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])]
    return [nn.Sequential(*layers[2 * s:2 * s + 2]) for s in range(n_stages)]


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


def data(batch: int, seq: int | None, in_width: int = 12, out_width: int = 5):
    gen = torch.Generator().manual_seed(7)
    shape = (batch,) if seq is None else (batch, seq)
    return torch.randn(*shape, in_width, generator=gen), torch.randn(*shape, out_width, generator=gen)


# --- the cases ---------------------------------------------------------------------------------------
def case_equiv(gpipe_step, guard, batch, n_micro, seq=None, sleep=0.0):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(11)
    blocks = make_model(world)
    reference = nn.Sequential(*copy.deepcopy(blocks))
    stage = Sleepy(blocks[rank], sleep) if sleep else blocks[rank]
    times = watch_forward(stage)
    watch_order(stage, guard)
    x, y = data(batch, seq)
    loss_fn = nn.MSELoss()
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()  # the unsplit model, on the full batch, in this process
    first, last = rank == 0, rank == world - 1
    with guard.watching():
        out = gpipe_step(stage, x if first else None, y if last else None, loss_fn, n_micro)
    mine, ref = list(blocks[rank].parameters()), list(reference[rank].parameters())
    missing = sum(p.grad is None for p in mine)
    diffs = [(p.grad - r.grad).abs().max().item() for p, r in zip(mine, ref) if p.grad is not None]
    scales = [(p.grad.norm() / r.grad.norm()).item() for p, r in zip(mine, ref) if p.grad is not None]
    returned = "None" if out is None else "tensor" if isinstance(out, torch.Tensor) else type(out).__name__
    loss = float(out) if returned in ("tensor", "float") and (not isinstance(out, torch.Tensor) or out.numel() == 1) \
        else None
    return {"max_grad_diff": max(diffs) if diffs else None, "missing_grads": missing,
            "grad_scale": sum(scales) / len(scales) if scales else None, "returned": returned, "loss": loss,
            "ref_loss": ref_loss.item(), "forward_calls": len(times), "forward_times": times, "n_micro": n_micro,
            "batch": batch, "collectives": guard.collectives, "p2p_calls": guard.p2p, "world": world,
            "order": guard.order}


def case_invalid(gpipe_step, guard, batch, n_micro):
    """Arguments to reject: which exception each rank raised (None: it returned)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(11)
    stage = make_model(world)[rank]
    x, y = data(batch, None)
    raised = None
    with guard.watching():
        try:
            gpipe_step(stage, x if rank == 0 else None, y if rank == world - 1 else None, nn.MSELoss(), n_micro)
        except Exception as err:  # noqa: BLE001 - which exception it is, is what this case records
            raised = {"type": type(err).__name__, "value_error": isinstance(err, ValueError), "line": one_line(err)}
    return {"raised": raised, "batch": batch, "n_micro": n_micro, "collectives": guard.collectives,
            "holds_data": rank in (0, world - 1)}


def plan(world: int) -> list[tuple[str, str, object]]:
    """(case, group, function of (gpipe_step, guard)) in the order they run."""
    p = functools.partial
    cases = [(f"equiv-p{world}-m1", "equiv", p(case_equiv, batch=8, n_micro=1)),
             (f"equiv-p{world}-m4", "equiv", p(case_equiv, batch=8, n_micro=4)),
             (f"equiv-p{world}-m3-3d", "equiv", p(case_equiv, batch=6, n_micro=3, seq=3)),
             (f"overlap-p{world}-m4", "overlap", p(case_equiv, batch=8, n_micro=4, sleep=SLEEP_S))]
    if world == 4:
        cases.insert(3, (f"equiv-p{world}-m8", "equiv", p(case_equiv, batch=16, n_micro=8)))
    if world == 2:  # invalid arguments last: a submission that ignores them may hang until the watchdog
        cases += [("invalid-n_micro-0", "invalid", p(case_invalid, batch=8, n_micro=0)),
                  ("invalid-batch-6-m4", "invalid", p(case_invalid, batch=6, n_micro=4))]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--case-limit", type=float, default=15.0)
    args = parser.parse_args()
    SUBMISSION[0] = os.path.abspath(args.submission)
    ctx = runtime.setup(seed=0, seed_per_rank=False)
    torch.set_num_threads(1)
    # The first `tensor.backward(gradient)` of a process imports sympy (seconds on a loaded machine): pay for it
    # here, not inside the first case's time limit (and not as a stall of every stage waiting for the next).
    torch.ones(2, requires_grad=True).mul(2).backward(torch.ones(2))
    log = jobkit.record_writer()  # before the submission is imported: see record_writer
    guard, watchdog = Guard(comm_recorder.install()), jobkit.Watchdog(
        "a deadlock (a recv no rank sends to, or two ranks both waiting in send/recv for each other), an endless "
        "loop, or far too slow", log)
    cases = plan(ctx.world_size)
    log(case="plan", cases={case: group for case, group, _ in cases})

    module = jobkit.import_or_exit(args.submission, "ex05", ["gpipe_step"], guard.watching, watchdog, args.case_limit,
                                   log)
    # A case that raised still reports the collectives it had called (its own record has them otherwise).
    jobkit.run_cases(cases, (module.gpipe_step, guard), watchdog, args.case_limit, args.submission, log,
                     fields=lambda: {"collectives": guard.collectives})
    runtime.teardown()


if __name__ == "__main__":
    main()
