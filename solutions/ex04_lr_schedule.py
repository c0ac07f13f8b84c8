"""Exercise 04: the learning rate for a larger global batch: linear scaling and gradual warmup.

Task
----
A recipe was tuned with learning rate `base_lr` at global batch `base_batch` (one process, say). Data
parallelism on N ranks with the same per-rank batch multiplies the global batch by k = N. Write:

- `scaled_lr(base_lr, base_batch, global_batch)`: the linear scaling rule (Goyal et al. 2017, "Accurate,
  Large Minibatch SGD: Training ImageNet in 1 Hour"): k = global_batch / base_batch, return k * base_lr.
- `warmup_lr(step, *, base_lr, base_batch, global_batch, warmup_steps, total_steps=None)`: the learning rate
  of optimizer step `step` (0 = the first step) under gradual warmup to the scaled rate:
    * during warmup (step < warmup_steps) it rises linearly from base_lr at step 0 towards the scaled rate;
      at step == warmup_steps it IS the scaled rate (as in Goyal et al.: warm up from η to kη, not from 0):
      start + (target - start) * step / warmup_steps, where target is the scaled rate and start its minimum
      with base_lr;
    * afterwards it stays at the scaled rate when total_steps is None; with total_steps it follows a cosine
      from the scaled rate at step warmup_steps down to 0 at step total_steps:
      scaled * (1 + cos(pi * (step - warmup_steps) / (total_steps - warmup_steps))) / 2.
- `warmup_scheduler(optimizer, *, base_lr, base_batch, global_batch, warmup_steps, total_steps=None)`: a
  `torch.optim.lr_scheduler.LambdaLR` that applies `warmup_lr`: build the optimizer with lr=base_lr, call
  `scheduler.step()` after every `optimizer.step()`, and the lr of the optimizer's step s is warmup_lr(s).

Rules
-----
- Warmup never goes above the scaled rate: when global_batch <= base_batch (k <= 1) there is nothing to warm
  up, and the scaled rate applies from step 0. warmup_steps=0 means no warmup: the scaled rate from step 0.
- k need not be a whole number (base_batch 3, global_batch 7 gives k = 7/3).
- The scheduler multiplies each parameter group's own initial lr by warmup_lr(step) / base_lr (that is
  what LambdaLR does with its factor): a group created with lr=base_lr gets exactly warmup_lr(step); a group
  created with lr=base_lr/10 gets a tenth of it.
- Invalid arguments raise ValueError with a message naming the argument and what is allowed:
  base_lr must be a finite number > 0; base_batch and global_batch whole numbers >= 1 (int, not bool or
  float); step and warmup_steps whole numbers >= 0; total_steps None or a whole number > warmup_steps;
  step <= total_steps when total_steps is given. warmup_scheduler raises them when it is created.
- Pure functions of their arguments: every rank computes the same schedule without communicating.

Check your work: `gpucourse grade ex04` (in a notebook: `gpucourse.grading.grade("ex04")`).
"""
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
        if step > total_steps:
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
