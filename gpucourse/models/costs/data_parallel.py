"""A DDP step's time, its all-reduces hidden behind backward or not, and scaling efficiency (chapter 03)."""
from dataclasses import dataclass

from ._checks import check_nonneg, require
from .comms import collective_time


# --- DDP step time and scaling efficiency (chapter 03) ------------------------------------------------------

BACKWARD_FRACTION = 2 / 3  # backward's share of forward + backward: about 2x the forward's FLOPs


@dataclass(frozen=True)
class DDPStep:
    compute: float   # forward + backward (+ optimizer), seconds
    backward: float  # the part of compute that gradient all-reduces can hide behind, seconds
    comm: float      # total all-reduce time over all buckets
    exposed: float   # communication not hidden behind backward
    step: float      # compute + exposed + overlap_penalty
    num_buckets: int
    overlap_penalty: float = 0.0  # compute time lost to the hidden all-reduces (overlap_cost × hidden)

    @property
    def hidden(self):
        """Communication that ran while backward computed."""
        return self.comm - self.exposed

    @property
    def efficiency(self):
        """Weak-scaling efficiency: the fraction of the step spent computing (one rank's step is all compute)."""
        return scaling_efficiency(step_s=self.step, base_step_s=self.compute) if self.step else 1.0


def ddp_step_time(compute_s, grad_bytes, n, alpha, beta, *, bucket_bytes=25 * 2**20, overlap=True,
                  backward_fraction=BACKWARD_FRACTION, overlap_cost=0.0):
    """A simple model of one DDP step: compute + exposed communication (+ what overlap costs compute).

    Gradients are all-reduced in buckets (ring) as backward produces them, so
    with overlap they can hide behind the backward pass only: the forward pass
    runs before any gradient exists. backward_fraction is backward's share of
    compute_s (about 2/3: backward costs about twice the forward's FLOPs;
    measure it when you can). The last bucket is only ready when backward
    ends, and nothing can hide more than the backward there is:
    exposed = max(last bucket, comm - backward). Without overlap, all of comm
    is exposed.

    overlap_cost says what hiding costs: the fraction of the hidden
    communication's time that compute loses to it, so
    step = compute + exposed + overlap_cost * (comm - exposed).
    0 (the default) is free overlap, what NCCL on a GPU is expected to approach; 1 means
    an all-reduce beside compute takes as long as one after it (gloo's thread
    and compute sharing the same CPU cores). It is a property of the machine:
    measure it apart from the steps you predict (chapter 03 times compute
    alone, all-reduces alone and both at once).

    The buckets are `full` buckets of bucket_bytes plus a smaller remainder,
    timed in closed form: a trillion parameters in 1 MiB buckets costs the
    same to model as a million.
    """
    check_nonneg(compute_s, "compute_s")
    check_nonneg(grad_bytes, "grad_bytes")
    require(bucket_bytes > 0, f"bucket_bytes must be > 0, got {bucket_bytes}")
    _check_step_options(backward_fraction, overlap_cost)
    full, rest = divmod(grad_bytes, bucket_bytes)
    t_full = collective_time("all_reduce", bucket_bytes, n, alpha, beta)
    t_rest = collective_time("all_reduce", rest, n, alpha, beta) if rest else 0.0
    comm = full * t_full + t_rest
    last = t_rest if rest else (t_full if full else 0.0)
    return _ddp_step(compute_s, comm, last, int(full) + (1 if rest else 0), overlap, backward_fraction, overlap_cost)


def ddp_step_from_bucket_times(compute_s, bucket_times, *, overlap=True, backward_fraction=BACKWARD_FRACTION,
                               overlap_cost=0.0):
    """ddp_step_time's step, from measured all-reduce times instead of the alpha-beta ring.

    bucket_times: the seconds each bucket's all-reduce took, measured apart from compute, in the order DDP
    sends them (the last one is the bucket backward finishes last: the first layers'). The overlap rule is
    ddp_step_time's, the same function: only where the communication time comes from differs. Use it when
    an alpha-beta line does not fit your collective at the sizes your buckets have (gloo on CPU: in six runs
    of chapter 03, 1 MiB all-reduces timed alone took 1.3x to 4x what a line fitted from 4 KiB to 16 MiB
    said, the line itself moving from run to run); use ddp_step_time to extrapolate.
    """
    check_nonneg(compute_s, "compute_s")
    times = [float(t) for t in bucket_times]
    require(len(times) > 0 and all(t >= 0 for t in times),
             f"bucket_times must be one or more non-negative seconds (one per bucket), got {bucket_times!r}")
    _check_step_options(backward_fraction, overlap_cost)
    return _ddp_step(compute_s, sum(times), times[-1], len(times), overlap, backward_fraction, overlap_cost)


def _check_step_options(backward_fraction, overlap_cost):
    require(0 <= backward_fraction <= 1, "backward_fraction must be between 0 and 1 (backward's share of "
                                          f"forward + backward, about 2/3), got {backward_fraction}")
    require(0 <= overlap_cost <= 1, "overlap_cost must be between 0 (overlap is free) and 1 (an all-reduce beside "
                                     f"compute costs as much as one after it), got {overlap_cost}")


def _ddp_step(compute_s, comm, last, num_buckets, overlap, backward_fraction, overlap_cost):
    """The overlap rule of a DDP step, given its all-reduce time in total (comm) and of its last bucket."""
    backward = backward_fraction * compute_s
    exposed = max(last, comm - backward) if overlap else comm
    penalty = overlap_cost * (comm - exposed)
    return DDPStep(compute_s, backward, comm, exposed, compute_s + exposed + penalty, num_buckets, penalty)


def scaling_efficiency(throughput=None, base_throughput=None, n=1, base_n=1, *, step_s=None, base_step_s=None):
    """Scaling efficiency, throughput(N) / (N/N0 × throughput(N0)): 1.0 is perfect (linear) scaling.

    Give the throughputs at world size n and at the baseline base_n (samples/s; strong or weak scaling alike),
    or, for weak scaling (batch per rank fixed, so throughput = N × batch / step), the step times at N and at
    the baseline: then it is base_step_s / step_s.
    """
    if step_s is not None or base_step_s is not None:
        require(throughput is None and base_throughput is None, "give throughputs or step times, not both")
        require(step_s is not None and step_s > 0, f"step_s must be > 0, got {step_s}")
        require(base_step_s is not None and base_step_s >= 0, f"base_step_s must be >= 0, got {base_step_s}")
        return base_step_s / step_s
    require(base_throughput is not None and base_throughput > 0,
             f"base_throughput must be > 0, got {base_throughput}")
    require(throughput is not None and throughput >= 0, f"throughput must be >= 0, got {throughput}")
    require(n >= 1 and base_n >= 1, f"n and base_n (world sizes) must be >= 1, got {n}, {base_n}")
    return throughput / (n / base_n * base_throughput)
