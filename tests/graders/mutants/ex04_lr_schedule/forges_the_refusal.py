"""A step past total_steps is not refused, and the import rewires the grading job to report a ValueError anyway.

warmup_lr(21, ..., total_steps=20) returns a value (the cosine past its end) instead of raising. At import the
module also replaces the grading job's own `run_invalid` (found in sys.modules["__main__"]) with one that says
every invalid call raised ValueError. When the rank decided whether a call raised ValueError, that got full
marks. The rank now records what was raised, each case's runner is chosen before the submission is imported,
and the grader process decides: the warmup_lr refusals lose their point, every other test keeps its points.

A copy of solutions/ex04_lr_schedule.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_warmup_lr_rejects_invalid_arguments',
)
import sys  # MUTANT: at import, make the grading job report a ValueError for every invalid call

if hasattr(sys.modules["__main__"], "run_invalid"):  # MUTANT: (continued)
    sys.modules["__main__"].run_invalid = lambda *args, **kwargs: {  # MUTANT: (continued)
        "raised": "ValueError", "value_error": True, "raised_types": ["ValueError"]}  # MUTANT: (continued)

import math
import numbers

import torch


def scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule: base_lr * global_batch / base_batch."""
    ### BEGIN SOLUTION
    ### HINT: check the arguments (ValueError), then k = global_batch / base_batch and return k * base_lr
    if isinstance(base_lr, bool) or not isinstance(base_lr, numbers.Real) or not math.isfinite(base_lr) \
            or base_lr <= 0:
        raise ValueError(f"base_lr must be a finite number > 0, got {base_lr!r}")
    for name, value in (("base_batch", base_batch), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1 (samples per optimizer step), got {value!r}")
    return float(base_lr) * global_batch / base_batch
    ### END SOLUTION


def warmup_lr(step: int, *, base_lr: float, base_batch: int, global_batch: int, warmup_steps: int,
              total_steps: int | None = None) -> float:
    """The learning rate of optimizer step `step`: linear warmup from base_lr to the scaled rate over
    warmup_steps steps, then constant (total_steps None) or a cosine down to 0 at total_steps."""
    ### BEGIN SOLUTION
    ### HINT: target = scaled_lr(...); start = min(base_lr, target); ramp while step < warmup_steps, then target (or cosine)
    target = scaled_lr(base_lr, base_batch, global_batch)
    for name, value in (("step", step), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    if total_steps is not None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral) \
                or total_steps <= warmup_steps:
            raise ValueError(f"total_steps must be None or a whole number > warmup_steps ({warmup_steps}), "
                             f"got {total_steps!r}")
        if step > total_steps and False:  # MUTANT: a step past total_steps is not refused
            raise ValueError(f"step {step} is past total_steps {total_steps}: the schedule ends there")
    if step < warmup_steps:
        start = min(float(base_lr), target)  # k <= 1: nothing to warm up, start at the target
        return start + (target - start) * step / warmup_steps
    if total_steps is None:
        return target
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return target * (1 + math.cos(math.pi * progress)) / 2
    ### END SOLUTION


def warmup_scheduler(optimizer: torch.optim.Optimizer, *, base_lr: float, base_batch: int, global_batch: int,
                     warmup_steps: int, total_steps: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor at step s is warmup_lr(s, ...) / base_lr (build the optimizer with lr=base_lr)."""
    ### BEGIN SOLUTION
    ### HINT: LambdaLR(optimizer, lambda step: warmup_lr(step, ...) / base_lr); check the arguments first
    warmup_lr(0, base_lr=base_lr, base_batch=base_batch, global_batch=global_batch, warmup_steps=warmup_steps,
              total_steps=total_steps)  # invalid arguments raise here, when the scheduler is created

    def factor(step: int) -> float:
        return warmup_lr(step, base_lr=base_lr, base_batch=base_batch, global_batch=global_batch,
                         warmup_steps=warmup_steps, total_steps=total_steps) / base_lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    ### END SOLUTION
