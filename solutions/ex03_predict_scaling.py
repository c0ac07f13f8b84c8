"""Exercise 03: predict data-parallel scaling from your own measurements.

Task
----
Chapter 03 measured three things on this machine: an all-reduce at several sizes (fitted to the α–β model),
the forward and backward time of one training step, and the gradient bytes DDP all-reduces. From those, predict
what DDP would do on more ranks than the machine has (weak scaling: each rank keeps its batch, so its compute
per step stays the same) and where communication starts to dominate. Write:

- `fit_all_reduce(sizes_bytes, times_s, world_size)`: (alpha, beta) of the all-reduce times measured on
  `world_size` ranks, fitted to the ring model below exactly as `gpucourse.models.costs.fit_alpha_beta` does (use it).
- `all_reduce_time(size_bytes, world_size, alpha, beta)`: a ring all-reduce of `size_bytes` bytes on
  `world_size` ranks: 2(N−1)·alpha + 2(N−1)/N · size_bytes · beta (chapter 01); 0.0 on one rank.
- `gradient_bytes(model)`: the bytes of the gradients DDP all-reduces every step: every parameter that
  requires a gradient, at its own dtype's size (a bf16 parameter's gradient is bf16). Frozen ones are not sent.
- `predicted_step_time(m, world_size)`: one DDP step on `world_size` ranks for the measurements `m`
  (a `Measured`, below): compute + exposed communication. The gradients go in buckets of `m.bucket_bytes`
  (full buckets, then one smaller remainder bucket if any bytes are left), each all-reduced as its own
  message, one after the other. They can hide behind the BACKWARD pass only (the forward pass runs before any
  gradient exists), and the last bucket is ready only when backward ends:
      exposed = max(time of the last bucket, all buckets' time − m.backward_s)
  (chapter 03, section 5; `gpucourse.models.costs.ddp_step_time` with its default overlap_cost=0 is this model:
  write it yourself here. Overlap is taken to be free, as on a GPU; the chapter measures what it costs on
  CPU cores, where gloo's thread and compute share the cores).
- `scaling_efficiency(m, world_sizes)`: {N: efficiency} for each N of `world_sizes`, in the order given.
  Weak scaling: efficiency(N) = throughput(N) / (N × throughput(1)) = compute / step(N) (1.0 on one rank).
- `comm_bound_from(m, world_sizes)`: the world size where communication dominates: the smallest N of
  `world_sizes` from which on (that N and every larger one given) the exposed communication exceeds the
  compute, i.e. efficiency is below 50 %; None when the largest one given is not communication-bound.

Rules
-----
- Sizes are bytes, times seconds. `Measured` holds the measurements; compute = forward_s + backward_s.
- Invalid arguments raise ValueError naming what was wrong: a world size that is not a whole number >= 1
  (bool and float are not), an empty `world_sizes`, a negative size. `_check_world_size` checks one.
- Pure functions of their arguments (no communication, no clocks): every rank computes the same prediction.

Graded against your own measurements: `gpucourse grade ex03` runs a real 2-rank job that times an all-reduce
sweep and a training step of a small MLP on this machine, calls your functions on those measurements (and on a
few fixed configurations), and compares with the course's own model (`gpucourse.models.costs`) on the same inputs.
Nothing is graded on how fast anything ran.
"""
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
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
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
