# Generated from solutions/ex08_fix_the_hang.py by `gpucourse make-exercises`: course authors edit the
# solution, not this file. Learners: fill in every `# YOUR CODE HERE`, then `gpucourse grade ex08`.
"""Exercise 08: fix a data-parallel training loop that hangs.

The story
---------
`_train_that_hangs` below is a real bug report in miniature. Every rank holds its own shard of the data,
and the shards are not the same size (7 batches on rank 0, 4 on rank 1, ...). It trains a
DistributedDataParallel model and, every `eval_every` steps, lets rank 0 evaluate and print. It hangs:

1. DDP all-reduces the gradients inside `loss.backward()`. A collective completes only when EVERY rank calls
   it. The rank with the most batches runs a step the others never run, and waits in backward forever.
2. `evaluate` computes a mean over every rank's evaluation data, so it contains an all_reduce; called on
   rank 0 alone, that all_reduce meets whatever the other ranks call next (a gradient all-reduce of another
   size): gloo crashes ("Received data size doesn't match") or hangs, depending on timing.

Run it (the chapter's notebook does, with a short stall timeout) and read what the launcher reports: which
ranks were still running, and the last line each printed.

Task
----
Write three functions. `model` is a DistributedDataParallel model, `optimizer` its optimizer, batches are
lists of `(x, y)` tensor pairs; the loss is `torch.nn.functional.mse_loss` (mean over the batch's elements).

- `common_steps(local_batches)`: the number of training steps every rank can run: the smallest
  `local_batches` of all ranks. Every rank must call it, and every rank gets the same answer.
- `evaluate(model, batches)`: the mean squared error over EVERY element of EVERY rank's `batches` (ranks may
  hold different numbers of batches, of different sizes, or none). Called on every rank; returns the same
  Python float on every rank. No gradients (torch.no_grad), the model in eval mode while evaluating, and
  left in the mode (train or eval) it was in.
- `train(model, optimizer, train_batches, eval_batches, *, eval_every)`: run exactly
  `common_steps(len(train_batches))` steps, step s using `train_batches[s]` (the remaining batches are
  dropped, as DistributedSampler(drop_last=True) would): zero the gradients, forward, mse_loss, backward,
  optimizer.step(). After step s (0-based), when (s + 1) % eval_every == 0, evaluate on `eval_batches`.
  Return `{"steps": steps run, "evals": [[s, evaluate(...)], ...]}` (identical on every rank).

Rules
-----
- Every collective must be called by every rank, in the same order, with the same shapes.
- Printing on rank 0 only is fine; calling, on rank 0 only, anything that runs a collective is not.
- Do not use torch's `Join` context manager: it handles uneven inputs by letting finished ranks shadow the
  others' all-reduces, which trains on more steps than this exercise asks for.
- The grader runs 3 ranks with uneven shards and a short time limit; when your code hangs it reports which
  rank was last doing what.

Check your work: `gpucourse grade ex08_fix_the_hang`.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss


def common_steps(local_batches: int) -> int:
    """The smallest number of batches any rank holds (every rank calls this, every rank gets it)."""
    # YOUR CODE HERE
    raise NotImplementedError("put local_batches in a tensor and all_reduce it with op=dist.ReduceOp.MIN")


def evaluate(model: nn.Module, batches: list) -> float:
    """Mean squared error over every element of every rank's batches; the same float on every rank."""
    # YOUR CODE HERE
    raise NotImplementedError("sum squared errors and element counts locally (no_grad, eval mode), all_reduce both, divide")


def train(model: nn.Module, optimizer: torch.optim.Optimizer, train_batches: list, eval_batches: list, *,
          eval_every: int) -> dict:
    """Train on the same number of steps on every rank; evaluate on every rank every `eval_every` steps."""
    # YOUR CODE HERE
    raise NotImplementedError("steps = common_steps(len(train_batches)); loop over range(steps); every rank calls evaluate")


def _train_that_hangs(model, optimizer, train_batches, eval_batches, *, eval_every):
    """The bug report: uneven shards and a rank-0-only evaluation (see the module docstring). Do not fix
    this one: it is what the chapter launches to show a hang."""
    for step, (x, y) in enumerate(train_batches):  # bug 1: the ranks hold different numbers of batches
        optimizer.zero_grad()
        mse_loss(model(x), y).backward()  # DDP all-reduces the gradients in here
        optimizer.step()
        print(f"step {step} done", flush=True)
        if dist.get_rank() == 0 and (step + 1) % eval_every == 0:  # bug 2: a collective on one rank only
            totals = torch.zeros(2, dtype=torch.float64)
            with torch.no_grad():
                for xe, ye in eval_batches:
                    totals += torch.tensor([mse_loss(model(xe), ye, reduction="sum").item(), ye.numel()])
            dist.all_reduce(totals)  # "the mean over every rank's data": but only rank 0 is here
            print(f"step {step}: eval loss {(totals[0] / totals[1]).item():.4f}", flush=True)
    return {"steps": len(train_batches), "evals": []}
