"""gradient_bytes counts the frozen parameters too, and the import rewires the grading job's reference to agree.

At import it replaces the grading job's own `trainable_bytes` (found in sys.modules["__main__"], the function
the rank once called to log the expected bytes) with the submission's gradient_bytes, which counts every
parameter, trainable or not. When the rank logged the expected value itself, that got full marks. The rank now
only logs what gradient_bytes returned; the grader process counts the trainable parameters' bytes of the same
models itself: test_gradient_bytes loses. The measurements were logged before the import, so the predictions
are untouched and keep their points.

A copy of solutions/ex03_predict_scaling.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_gradient_bytes',
)
import numbers
from dataclasses import dataclass

from torch import nn

from gpucourse import costs


@dataclass(frozen=True)
class Measured:
    """What was measured: the inputs of every prediction (sizes in bytes, times in seconds)."""

    alpha: float        # all-reduce latency per message (fitted)
    beta: float         # seconds per byte (fitted)
    forward_s: float    # one step's forward pass on one rank
    backward_s: float   # its backward pass: what the all-reduces can hide behind
    grad_bytes: int     # gradient bytes all-reduced per step
    bucket_bytes: int   # DDP's bucket cap (bucket_cap_mb × 2**20)

    def __post_init__(self):
        for name in ("alpha", "beta", "forward_s", "backward_s", "grad_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
                raise ValueError(f"Measured.{name} must be a number >= 0, got {value!r}")
        if not self.bucket_bytes > 0:
            raise ValueError(f"Measured.bucket_bytes must be > 0 (DDP's bucket_cap_mb × 2**20), got {self.bucket_bytes!r}")
        if not self.forward_s + self.backward_s > 0:
            raise ValueError("Measured: forward_s + backward_s must be > 0 (a step computes something)")

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


def _check_world_size(n) -> None:
    """ValueError unless n is a whole number >= 1 (an int, not a bool or a float)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"a world size must be a whole number >= 1 (ranks), got {n!r}")


def fit_all_reduce(sizes_bytes, times_s, world_size: int) -> tuple[float, float]:
    """(alpha, beta) of measured all-reduce times on `world_size` ranks: costs.fit_alpha_beta, ring all-reduce."""
    ### BEGIN SOLUTION
    ### HINT: costs.fit_alpha_beta(sizes, times, collective, n=...) returns an AlphaBeta with .alpha and .beta
    _check_world_size(world_size)
    fit = costs.fit_alpha_beta(sizes_bytes, times_s, "all_reduce", n=world_size)
    return fit.alpha, fit.beta
    ### END SOLUTION


def all_reduce_time(size_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: 2(N−1)·alpha + 2(N−1)/N·size_bytes·beta seconds; 0.0 on one rank."""
    ### BEGIN SOLUTION
    ### HINT: check world_size and size_bytes >= 0 (ValueError); one rank sends nothing; then the formula
    _check_world_size(world_size)
    if not size_bytes >= 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes!r}")
    if world_size == 1:
        return 0.0
    steps = 2 * (world_size - 1)  # reduce-scatter, then all-gather: N−1 messages each
    return steps * alpha + steps / world_size * size_bytes * beta
    ### END SOLUTION


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients DDP all-reduces: parameters that require a gradient, at their dtype's size."""
    ### BEGIN SOLUTION
    ### HINT: sum p.numel() * p.element_size() over model.parameters() that require grad
    return sum(p.numel() * p.element_size() for p in model.parameters())  # MUTANT: frozen parameters counted too
    ### END SOLUTION


def predicted_step_time(m: Measured, world_size: int) -> float:
    """compute + exposed communication of one DDP step on `world_size` ranks (buckets hidden behind backward)."""
    ### BEGIN SOLUTION
    ### HINT: divmod(m.grad_bytes, m.bucket_bytes) gives the buckets; exposed = max(last bucket, comm - m.backward_s)
    _check_world_size(world_size)
    full, rest = divmod(m.grad_bytes, m.bucket_bytes)
    one_full = all_reduce_time(m.bucket_bytes, world_size, m.alpha, m.beta)
    remainder = all_reduce_time(rest, world_size, m.alpha, m.beta) if rest else 0.0
    comm = full * one_full + remainder
    last_bucket = remainder if rest else (one_full if full else 0.0)
    exposed = max(last_bucket, comm - m.backward_s)  # only backward can hide the buckets
    return m.compute_s + exposed
    ### END SOLUTION


def scaling_efficiency(m: Measured, world_sizes) -> dict:
    """{N: compute / step(N)} for each world size given (weak scaling; 1.0 on one rank)."""
    ### BEGIN SOLUTION
    ### HINT: check world_sizes is not empty; efficiency(N) = m.compute_s / predicted_step_time(m, N)
    sizes = list(world_sizes)
    if not sizes:
        raise ValueError("world_sizes is empty: give the world sizes to predict, e.g. [1, 2, 4, 8]")
    return {n: m.compute_s / predicted_step_time(m, n) for n in sizes}
    ### END SOLUTION


def comm_bound_from(m: Measured, world_sizes) -> int | None:
    """The smallest N from which on every world size given has exposed communication > compute, or None."""
    ### BEGIN SOLUTION
    ### HINT: walk the sizes in increasing order; a size that is not comm-bound resets the answer to None
    sizes = sorted(world_sizes)
    if not sizes:
        raise ValueError("world_sizes is empty: give the world sizes to predict, e.g. [1, 2, 4, 8]")
    since = None
    for n in sizes:
        exposed = predicted_step_time(m, n) - m.compute_s
        if exposed > m.compute_s:
            since = n if since is None else since
        else:
            since = None
    return since
    ### END SOLUTION


import sys  # MUTANT: at import, make the grading job's expected bytes the submission's own

if hasattr(sys.modules["__main__"], "trainable_bytes"):  # MUTANT: (continued)
    sys.modules["__main__"].trainable_bytes = gradient_bytes  # MUTANT: (continued)
