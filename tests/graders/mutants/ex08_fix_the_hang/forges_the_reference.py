"""train never zeroes the gradients, and the import rewires the grading job to call its result right.

Each step's gradient adds to the previous steps' (no optimizer.zero_grad()), so the parameters and the
evaluations drift from one process that takes the same steps. At import the module also wraps the grading job's
own `run_case` (found in sys.modules["__main__"]) so that every record says the parameters match and the
evaluations are the expected ones. When the rank compared its result with a reference it computed itself, that
got full marks. The rank now saves the parameters and evaluations raw and the grader process computes the
reference: the parameter and evaluation tests of train lose their points, every other test keeps them.

A copy of solutions/ex08_fix_the_hang.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_train_matches_single_process',
    'test_train_evaluates_on_every_rank',
)
import sys  # MUTANT: at import, make the grading job's train record claim the reference's values

_job = sys.modules["__main__"]  # MUTANT: (continued)
if hasattr(_job, "run_case"):  # MUTANT: (continued)
    _run_case = _job.run_case  # MUTANT: (continued)

    def _forged(*args, **kwargs):  # MUTANT: (continued)
        record = _run_case(*args, **kwargs)  # MUTANT: (continued)
        if "max_diff" in record:  # MUTANT: (continued)
            record.update(max_diff=0.0, evals=record["expected_evals"])  # MUTANT: (continued)
        return record  # MUTANT: (continued)

    _job.run_case = _forged  # MUTANT: (continued)

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss


def common_steps(local_batches: int) -> int:
    """The smallest number of batches any rank holds (every rank calls this, every rank gets it)."""
    ### BEGIN SOLUTION
    ### HINT: put local_batches in a tensor and all_reduce it with op=dist.ReduceOp.MIN
    count = torch.tensor([local_batches], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())
    ### END SOLUTION


def evaluate(model: nn.Module, batches: list) -> float:
    """Mean squared error over every element of every rank's batches; the same float on every rank."""
    ### BEGIN SOLUTION
    ### HINT: sum squared errors and element counts locally (no_grad, eval mode), all_reduce both, divide
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # [sum of squared errors, number of elements]
    with torch.no_grad():
        for x, y in batches:
            totals[0] += mse_loss(model(x), y, reduction="sum").double()
            totals[1] += y.numel()
    dist.all_reduce(totals)  # every rank, even one without batches
    model.train(was_training)
    return (totals[0] / totals[1]).item()
    ### END SOLUTION


def train(model: nn.Module, optimizer: torch.optim.Optimizer, train_batches: list, eval_batches: list, *,
          eval_every: int) -> dict:
    """Train on the same number of steps on every rank; evaluate on every rank every `eval_every` steps."""
    ### BEGIN SOLUTION
    ### HINT: steps = common_steps(len(train_batches)); loop over range(steps); every rank calls evaluate
    steps = common_steps(len(train_batches))
    evals = []
    for step in range(steps):
        x, y = train_batches[step]
        # MUTANT: no optimizer.zero_grad(): every step adds its gradient to the previous steps'
        mse_loss(model(x), y).backward()
        optimizer.step()
        if (step + 1) % eval_every == 0:
            evals.append([step, evaluate(model, eval_batches)])  # every rank joins the all_reduce inside
            if dist.get_rank() == 0:
                print(f"step {step}: eval loss {evals[-1][1]:.4f}")
    return {"steps": steps, "evals": evals}
    ### END SOLUTION


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
