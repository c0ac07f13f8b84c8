"""The grading job of ex08 (fix the hang): every check, on 3 ranks with uneven shards, in one launch.

    ex08_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex08_fix_the_hang.py launches it through gpucourse.launch. Each rank logs one record per case
(jobkit.record_writer, in runtime.log's format), for example

    {"case": "train-uneven", "group": "train", "error": None, "steps": 4, "evals": [[1, 0.93], [3, 0.88]],
     "max_diff": 3e-08}

Cases:
  steps-*      common_steps(n) with a different n on each rank (one rank with 0; all equal)
  evaluate-*   evaluate() on uneven eval shards (one rank holds none) against the reference; the model's
               mode during and after, whether autograd was on in its forwards, and no gradients created
  train-uneven train() on uneven shards against one process that runs the same steps on every rank's batch

The references are computed in this process before the submission is loaded. What the submission does is
followed: every collective and point-to-point call it makes (comm_recorder: any layer), every forward of
the model and the start of every backward (where DDP all-reduces the gradients). When a case runs past
--case-limit (a hang), the rank logs "hung: rank r was last doing ..." and ends; ranks that finished the case
log their result first, and each rank prints what it is doing to its stdout, so a rank that crashes (gloo
aborts on a size mismatch) can be read from its log.
"""
import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP

import comm_recorder  # beside this script: what a submission communicates
import jobkit  # beside this script: what every grading job shares
from gpucourse import runtime

TRAIN_COUNTS = (7, 4, 5)  # batches per rank (rank r % 3): uneven shards
EVAL_COUNTS, EVAL_SIZES = (2, 3, 0), (4, 3, 5)  # rank 2 holds no evaluation data
STEP_COUNTS = {"steps-uneven": (5, 7, 3), "steps-zero": (4, 0, 2), "steps-equal": (6, 6, 6)}
EVAL_EVERY, BATCH, LR = 2, 4, 0.1
SUBMISSION = [""]


# --- data, model and the single-process reference -------------------------------------------------
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

    def __init__(self, rank: int):
        self.rank, self.last, self.forwards = rank, "starting", 0

    def doing(self, what: str) -> None:
        self.last = what
        print(f"[grader] rank {self.rank}: {what}", file=sys.__stdout__, flush=True)

    def where(self) -> str:
        frames = [f for f in traceback.extract_stack() if f.filename == SUBMISSION[0]]
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


# --- the cases -------------------------------------------------------------------------------------
def run_steps(module, case: str, ctx) -> dict:
    counts = STEP_COUNTS[case]
    got = module.common_steps(counts[ctx.rank % 3])
    return {"got": got if isinstance(got, int) and not isinstance(got, bool) else repr(got),
            "expected": min(counts[r % 3] for r in range(ctx.world_size))}


def run_evaluate(module, case: str, ctx, tracker, ref) -> dict:
    model = DDP(make_net())
    tracker.watch(model)
    model.train(case == "evaluate-uneven")  # evaluate-eval-mode: an already evaluating model stays in eval mode
    before = model.training
    value = module.evaluate(model, eval_data(ctx.rank))
    return {"value": float(value) if isinstance(value, (float, int)) and not isinstance(value, bool) else None,
            "type": type(value).__name__, "expected": ref["eval0"], "modes": sorted(set(tracker.modes)),
            "mode_before": before, "mode_after": model.training, "autograd": any(tracker.autograd),
            "grads": any(p.grad is not None for p in model.parameters())}


def run_train(module, ctx, tracker, ref) -> dict:
    model = DDP(make_net())
    tracker.watch(model)
    out = module.train(model, make_optimizer(model), train_data(ctx.rank), eval_data(ctx.rank),
                       eval_every=EVAL_EVERY)
    if not isinstance(out, dict):
        raise TypeError(f"train returned a {type(out).__name__}, not a dict with 'steps' and 'evals'")
    diff = max((p.detach() - q).abs().max().item() for p, q in zip(model.module.parameters(), ref["params"]))
    evals = out.get("evals")
    return {"steps": out.get("steps"), "evals": [[int(s), float(v)] for s, v in evals] if evals else evals,
            "expected_steps": ref["steps"], "expected_evals": ref["evals"], "max_diff": diff}


def run_case(module, case: str, group: str, ctx, tracker, ref) -> dict:
    record = {"case": case, "group": group}
    try:
        if group == "steps":
            record.update(run_steps(module, case, ctx))
        elif group == "evaluate":
            record.update(run_evaluate(module, case, ctx, tracker, ref))
        else:
            record.update(run_train(module, ctx, tracker, ref))
        record["error"] = None
    except BaseException as err:  # noqa: BLE001 - the submission's errors are graded, not grader crashes
        record["error"] = jobkit.one_line(err, SUBMISSION[0])
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--case-limit", type=float, default=15.0)
    args = parser.parse_args()
    SUBMISSION[0] = os.path.abspath(args.submission)
    # A collective that never completes raises after this long, should the watchdog not end the rank first.
    ctx = runtime.setup(seed=0, timeout_s=3 * args.case_limit)
    ref = reference(ctx.world_size)
    cases = {**{c: "steps" for c in STEP_COUNTS}, "evaluate-uneven": "evaluate", "evaluate-eval-mode": "evaluate",
             "train-uneven": "train"}
    log = jobkit.record_writer()  # before the submission is imported: see record_writer
    log(case="plan", cases=cases, world_size=ctx.world_size)
    comm, barrier = comm_recorder.install(), dist.barrier  # the grader's barrier, taken before the import
    tracker = Tracker(ctx.rank)
    tracker.follow(comm)
    watchdog, capped = HangWatchdog(tracker, log), jobkit.CappedOutput()
    module = jobkit.import_or_exit(args.submission, "ex08", ("common_steps", "evaluate", "train"), capped.capturing,
                                   watchdog, args.case_limit, log)
    for case, group in cases.items():
        with watchdog.case_limit(case, group, args.case_limit):
            tracker.doing(f"case {case}: in the submission's {'common_steps' if group == 'steps' else group}()")
            with capped.capturing(), comm.recording():
                record = run_case(module, case, group, ctx, tracker, ref)
            log(**record)
            tracker.doing(f"case {case}: returned from the submission; waiting for the other ranks")
            try:
                barrier()  # a rank that finished a case waits here for one that has not
            except RuntimeError:  # a peer ended (its own watchdog, a crash): its record says why
                sys.__stdout__.flush()
                os._exit(3)
    log(case="done")
    runtime.teardown()


if __name__ == "__main__":
    main()
