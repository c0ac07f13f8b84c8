# Generated from solutions/ex04_lr_schedule.py by `gpucourse make-exercises`: course authors edit the
# solution, not this file. Learners: fill in every `# YOUR CODE HERE`, then `gpucourse grade ex04`.
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
    # YOUR CODE HERE
    raise NotImplementedError("check the arguments (ValueError), then k = global_batch / base_batch and return k * base_lr")


def warmup_lr(step: int, *, base_lr: float, base_batch: int, global_batch: int, warmup_steps: int,
              total_steps: int | None = None) -> float:
    """The learning rate of optimizer step `step`: linear warmup from base_lr to the scaled rate over
    warmup_steps steps, then constant (total_steps None) or a cosine down to 0 at total_steps."""
    # YOUR CODE HERE
    raise NotImplementedError("target = scaled_lr(...); start = min(base_lr, target); ramp while step < warmup_steps, then target (or cosine)")


def warmup_scheduler(optimizer: torch.optim.Optimizer, *, base_lr: float, base_batch: int, global_batch: int,
                     warmup_steps: int, total_steps: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor at step s is warmup_lr(s, ...) / base_lr (build the optimizer with lr=base_lr)."""
    # YOUR CODE HERE
    raise NotImplementedError("LambdaLR(optimizer, lambda step: warmup_lr(step, ...) / base_lr); check the arguments first")
