"""Back-of-the-envelope cost models used throughout the course.

Everything here is arithmetic: no GPUs, no torch. The point is to predict a
number *before* measuring it, so that a measurement that disagrees with the
model tells you something. Sizes are in bytes, times in seconds.
"""
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..units import human_seconds, human_si

# Bus-bandwidth factors from NVIDIA nccl-tests (doc/PERFORMANCE.md). busbw =
# algbw * factor is the traffic through the busiest link of a ring, so it is
# comparable across collectives and GPU counts, and to the hardware link rate.
_BUSBW = {"all_reduce": lambda n: 2 * (n - 1) / n,
          **dict.fromkeys(["all_gather", "reduce_scatter", "all_to_all"], lambda n: (n - 1) / n),
          **dict.fromkeys(["broadcast", "reduce", "send_recv", "p2p"], lambda n: 1.0)}
COLLECTIVES = tuple(_BUSBW)


def _require(ok, message):
    """Raise ValueError(message) unless ok: every check names the bad argument."""
    if not ok:
        raise ValueError(message)


def _check_stage(stage):
    _require(stage in (0, 1, 2, 3), f"stage must be 0, 1, 2 or 3, got {stage!r}")


def _check_nonneg(value, name):
    _require(value >= 0, f"{name} must be >= 0, got {value}")


# --- 1. nccl-tests bandwidth definitions (chapter 01) -------------------------------------------------------

def algbw(size_bytes, seconds):
    """Algorithm bandwidth: buffer size / time, as nccl-tests prints it."""
    _check_nonneg(size_bytes, "size_bytes")
    _require(seconds > 0, f"seconds must be > 0, got {seconds}")
    return size_bytes / seconds


def busbw_factor(collective, n):
    """busbw / algbw for `collective` on `n` ranks (nccl-tests convention).

    Size convention (as in nccl-tests): for all_gather the size is the *output*
    (total, n shards) buffer; for reduce_scatter it is the *input* (total)
    buffer; for all_reduce / broadcast / reduce it is the one buffer.
    """
    _require(collective in _BUSBW, f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    _require(n >= 1, f"n (number of ranks) must be >= 1, got {n}")
    return _BUSBW[collective](n)


def busbw(collective, size_bytes, seconds, n):
    """Bus bandwidth: compare this, not algbw, with the link's rated speed."""
    return algbw(size_bytes, seconds) * busbw_factor(collective, n)


# --- 2. bytes on the wire (chapter 01) ----------------------------------------------------------------------

def bytes_moved_per_rank(collective, size_bytes, n):
    """Bytes each rank sends in a bandwidth-optimal (ring / pipelined) algorithm.

    This is exactly busbw_factor * size -- which is *why* nccl-tests defines
    busbw that way. A ring all_reduce is a reduce_scatter then an all_gather,
    each sending (n-1)/n of the buffer, hence 2(n-1)/n. One rank moves nothing.
    """
    _check_nonneg(size_bytes, "size_bytes")
    factor = busbw_factor(collective, n)
    return 0.0 if n == 1 else factor * size_bytes


# --- 3. alpha-beta (latency-bandwidth) model (chapter 01) ---------------------------------------------------

def collective_time(collective, size_bytes, n, alpha, beta, algorithm="ring"):
    """Predicted time: (#sequential messages) * alpha + (bytes sent) * beta.

    alpha = per-message latency (s); beta = seconds per byte (1 / bandwidth).
    ring: a ring all_reduce takes 2(n-1) steps, all_gather / reduce_scatter /
    all_to_all / pipelined broadcast and reduce take n-1, send_recv one.
    tree: depth ceil(log2 n); all_reduce = reduce up + broadcast down, giving
    2*log2(n)*alpha + 2*S*beta. This assumes the tree is pipelined so each
    rank sends ~S bytes each way -- a simplification of what NCCL does.
    """
    busbw_factor(collective, n)  # validates collective and n
    _check_nonneg(size_bytes, "size_bytes")
    _check_nonneg(alpha, "alpha")
    _check_nonneg(beta, "beta")
    if n == 1:
        return 0.0
    if algorithm == "ring":
        steps = {"all_reduce": 2 * (n - 1), "send_recv": 1, "p2p": 1}.get(collective, n - 1)
        return steps * alpha + bytes_moved_per_rank(collective, size_bytes, n) * beta
    if algorithm == "tree":
        passes = {"all_reduce": 2, "broadcast": 1, "reduce": 1}.get(collective)
        _require(passes, f"algorithm='tree' supports all_reduce, broadcast, reduce; got {collective!r}")
        return passes * (math.ceil(math.log2(n)) * alpha + size_bytes * beta)
    raise ValueError(f"algorithm must be 'ring' or 'tree', got {algorithm!r}")


@dataclass(frozen=True)
class AlphaBeta:
    """Fitted latency alpha (s) and inverse bandwidth beta (s/byte).

    It remembers the collective it was fitted on, so predict() reproduces
    the measurements; a bare AlphaBeta(a, b) is a single link: a + S*b.
    """
    alpha: float
    beta: float
    collective: str = "send_recv"
    n: int = 2
    algorithm: str = "ring"

    @property
    def bandwidth(self):
        """1/beta in bytes/s (inf if beta == 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def predict(self, size_bytes):
        return collective_time(self.collective, size_bytes, self.n, self.alpha, self.beta, self.algorithm)

    def __str__(self):
        return f"α = {human_seconds(self.alpha)}, β⁻¹ = {human_si(self.bandwidth, 'B/s')}"


def fit_alpha_beta(sizes_bytes, times_s, collective="all_reduce", *, n, algorithm="ring"):
    """Fit alpha, beta to measured (size, time) pairs by least squares.

    The model is linear in alpha and beta: t = a*alpha + b*S*beta, with a and
    b read off collective_time. We minimise *relative* error (rows weighted by
    1/t): timing noise is roughly proportional to t, and with plain least
    squares the 256 MiB points would drown out the small ones that set alpha.
    Negative alpha or beta is unphysical (noise), so if the free fit goes
    negative we refit with that coefficient pinned at 0.
    """
    s, t = np.asarray(sizes_bytes, dtype=float), np.asarray(times_s, dtype=float)
    _require(s.ndim == 1 and s.shape == t.shape,
             f"sizes_bytes and times_s must be 1-D and the same length, got {s.shape}, {t.shape}")
    _require(len(np.unique(s)) >= 2, "sizes_bytes needs at least 2 distinct sizes to separate alpha from beta")
    _require(np.all(t > 0), "times_s must all be > 0")
    _require(n >= 2, f"n must be >= 2 to fit (one rank does no communication), got {n}")
    a = collective_time(collective, 0, n, 1.0, 0.0, algorithm)  # number of latency terms
    b = collective_time(collective, 1, n, 0.0, 1.0, algorithm)  # bytes sent per buffer byte
    X = np.column_stack([np.full_like(s, a), b * s]) / t[:, None]  # weighted rows; target is 1
    y = np.ones_like(t)
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    if np.any(coef < 0):  # optimum on the boundary: best single-coefficient fit
        cands = [np.array([0.0, X[:, 1] @ y / (X[:, 1] @ X[:, 1])]),
                 np.array([X[:, 0] @ y / (X[:, 0] @ X[:, 0]), 0.0])]
        coef = min(cands, key=lambda c: np.sum((X @ c - y) ** 2))
    return AlphaBeta(float(coef[0]), float(coef[1]), collective, n, algorithm)


# --- 4. interconnect presets (chapter 01; used again in 03, 06, 08) -----------------------------------------

@dataclass(frozen=True)
class Interconnect:
    """A named link: latency alpha (s) and bandwidth per direction (bytes/s).

    Nominal, not measured: vendor link rates and typical small-message NCCL
    latencies. Measure your own machine (chapter on benchmarking) and fit.
    """
    name: str
    alpha: float
    bandwidth_bytes_per_s: float
    source: str

    @property
    def beta(self):
        return 1.0 / self.bandwidth_bytes_per_s


_NOMINAL = "nominal vendor link rate per direction, typical latency; not measured"
INTERCONNECTS = {ic.name: ic for ic in [
    Interconnect("NVLink 4 (H100 SXM)", 3e-6, 450e9, _NOMINAL + " (900 GB/s bidirectional per GPU)"),
    Interconnect("NVLink 3 (A100 SXM)", 3e-6, 300e9, _NOMINAL + " (600 GB/s bidirectional per GPU)"),
    Interconnect("PCIe 5 x16", 5e-6, 64e9, _NOMINAL),
    Interconnect("PCIe 4 x16", 5e-6, 32e9, _NOMINAL),
    Interconnect("InfiniBand NDR 400G", 6e-6, 50e9, _NOMINAL),
    Interconnect("InfiniBand HDR 200G", 7e-6, 25e9, _NOMINAL),
    Interconnect("100 GbE", 30e-6, 12.5e9, _NOMINAL + " (TCP sockets)"),
]}


# --- 5. DDP step time and scaling efficiency (chapter 03) ---------------------------------------------------

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
    _check_nonneg(compute_s, "compute_s")
    _check_nonneg(grad_bytes, "grad_bytes")
    _require(bucket_bytes > 0, f"bucket_bytes must be > 0, got {bucket_bytes}")
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
    _check_nonneg(compute_s, "compute_s")
    times = [float(t) for t in bucket_times]
    _require(len(times) > 0 and all(t >= 0 for t in times),
             f"bucket_times must be one or more non-negative seconds (one per bucket), got {bucket_times!r}")
    _check_step_options(backward_fraction, overlap_cost)
    return _ddp_step(compute_s, sum(times), times[-1], len(times), overlap, backward_fraction, overlap_cost)


def _check_step_options(backward_fraction, overlap_cost):
    _require(0 <= backward_fraction <= 1, "backward_fraction must be between 0 and 1 (backward's share of "
                                          f"forward + backward, about 2/3), got {backward_fraction}")
    _require(0 <= overlap_cost <= 1, "overlap_cost must be between 0 (overlap is free) and 1 (an all-reduce beside "
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
        _require(throughput is None and base_throughput is None, "give throughputs or step times, not both")
        _require(step_s is not None and step_s > 0, f"step_s must be > 0, got {step_s}")
        _require(base_step_s is not None and base_step_s >= 0, f"base_step_s must be >= 0, got {base_step_s}")
        return base_step_s / step_s
    _require(base_throughput is not None and base_throughput > 0,
             f"base_throughput must be > 0, got {base_throughput}")
    _require(throughput is not None and throughput >= 0, f"throughput must be >= 0, got {throughput}")
    _require(n >= 1 and base_n >= 1, f"n and base_n (world sizes) must be >= 1, got {n}, {base_n}")
    return throughput / (n / base_n * base_throughput)


# --- 6. pipeline parallelism (chapter 05) -------------------------------------------------------------------

def pipeline_bubble_fraction(p, m, v=1):
    """Idle fraction of the step of a GPipe/1F1B schedule: (p-1)/(m+p-1); interleaved, (p-1)/(v*m+p-1).

    p stages, m micro-batches: p-1 slots to fill and drain the pipe out of
    m+p-1 in total. More micro-batches shrink the bubble. With v stages per
    rank (interleaved 1F1B, Narayanan et al. 2021) each slot is 1/v as long,
    so the p-1 fill and drain slots cost (p-1)/v of a micro-batch's time.
    """
    _require(p >= 1, f"p (pipeline stages) must be >= 1, got {p}")
    _require(m >= 1, f"m (micro-batches) must be >= 1, got {m}")
    _require(v >= 1, f"v (stages per rank) must be >= 1, got {v}")
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_ratio(p, m, v=1):
    """Bubble time over the ideal (bubble-free) step: (p-1)/m; interleaved, (p-1)/(v*m).

    The same bubble as pipeline_bubble_fraction, measured against the work
    instead of the whole step, as Narayanan et al. 2021 write it. For p = 4,
    m = 4: 3/7 of the step is idle, which is 3/4 on top of the ideal step.
    """
    _require(p >= 1, f"p (pipeline stages) must be >= 1, got {p}")
    _require(m >= 1, f"m (micro-batches) must be >= 1, got {m}")
    _require(v >= 1, f"v (stages per rank) must be >= 1, got {v}")
    return (p - 1) / (v * m)


_PIPE_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


def simulate_pipeline(orders, durations):
    """Replay each rank's pipeline actions in their order, with fixed durations and free communication.

    orders: {rank: ["0F0", "0F1", "0B0", ...]}: <stage><kind><micro-batch>, kind F (forward), B (full
    backward), I (backward to the input only) or W (backward to the weights). durations: {kind: seconds}
    (an action's own name, e.g. "1F0", takes precedence over its kind).
    An action starts when its rank is free and what it needs is done: F on stage s after F on s-1; B or I
    on stage s after F on s and B or I on s+1 (the last stage's after its own F); W after I. This is the
    time the schedule itself costs, without a real machine's overheads: compare a measured timeline with it.
    An entry may also be a tuple of actions, e.g. ("0F3", "3B1"): one overlapped block (DualPipe's F&B), which
    starts when all of them can, lasts durations["F&B"] if given or else the sum of theirs, and whose results
    are all ready at its end.
    Returns {rank: [(action, start, end)]}, a block's actions with the block's start and end; raises
    ValueError on an order that can never finish.
    """
    parsed, seconds = {}, {}
    for rank, actions in orders.items():
        parsed[rank] = []
        for entry in actions:
            block = []
            for action in (entry if isinstance(entry, (tuple, list)) else (entry,)):
                match = _PIPE_ACTION.fullmatch(str(action))
                _require(match, f"action {action!r} of rank {rank}: expected <stage><F|B|I|W><micro-batch>, e.g. '0F1'")
                _require(action in durations or match[2] in durations,
                         f"durations has no time for kind {match[2]!r} (action {action})")
                block.append((int(match[1]), match[2], int(match[3])))
                seconds[block[-1]] = durations.get(action, durations.get(match[2]))
            _require(block, f"rank {rank} has an empty block of actions")
            parsed[rank].append(tuple(block))
    last = max(s for acts in parsed.values() for block in acts for s, _, _ in block)
    done, free, out, head = {}, dict.fromkeys(parsed, 0.0), {r: [] for r in parsed}, dict.fromkeys(parsed, 0)

    def ready_at(stage, kind, mb):
        """When everything (stage, kind, mb) needs is done, or None if something is not done yet."""
        if kind == "F":
            needed = [(stage - 1, "F", mb)] if stage > 0 else []
        elif kind == "W":
            needed = [(stage, "I", mb)]
        else:  # B or I: the stage's own forward, and the output's gradient from the next stage (B or I there)
            needed = [(stage, "F", mb)]
            if stage < last:
                grad = [d for d in ((stage + 1, "B", mb), (stage + 1, "I", mb)) if d in done]
                needed.append(grad[0] if grad else (stage + 1, "B or I", mb))
        return max((done[d] for d in needed), default=0.0) if all(d in done for d in needed) else None

    while any(head[r] < len(parsed[r]) for r in parsed):
        progressed = False
        for rank, acts in parsed.items():
            while head[rank] < len(acts) and None not in (ats := [ready_at(*a) for a in acts[head[rank]]]):
                block = acts[head[rank]]
                start = max([free[rank], *ats])
                length = (durations.get("F&B", sum(seconds[a] for a in block)) if len(block) > 1
                          else seconds[block[0]])
                free[rank] = start + length
                for a in block:
                    done[a] = free[rank]
                    out[rank].append((f"{a[0]}{a[1]}{a[2]}", start, free[rank]))
                head[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: "+".join("".join(map(str, a)) for a in parsed[r][head[r]])
                     for r in parsed if head[r] < len(parsed[r])}
            raise ValueError(f"these orders can never finish: each rank waits on another ({stuck}); "
                             "check the actions and that every stage's forward comes before its backward")
    return out


def pipeline_order_from_torch(order, blocks=True):
    """A rank's plan in torch.distributed.pipelining's notation as simulate_pipeline takes it.

    order: e.g. ["0F0", "(0F3;3B1)OVERLAP_F_B", "0REDUCE_GRAD"] (str of torch's _Action). Compute actions are kept;
    an overlapped pair becomes a tuple (one block) or, with blocks=False, its actions one after the other; the
    rest (communication, REDUCE_GRAD, ...) is left out.
    """
    out = []
    for action in order:
        if str(action).endswith("OVERLAP_F_B"):
            pair = tuple(re.findall(r"\d+[FBIW]\d+", str(action)))
            _require(len(pair) >= 2, f"{action!r}: an OVERLAP_F_B with fewer than two compute actions")
            out.extend([pair] if blocks else pair)
        elif _PIPE_ACTION.fullmatch(str(action)):
            out.append(str(action))
    return out


def dualpipev_bubble(ranks, forward, backward, weight, overlapped=None):
    """Idle time per rank of DualPipeV on `ranks` ranks (2 * ranks stages): (ranks - 1)(F&B + B - 3W).

    DeepSeek-V3 (arXiv 2412.19437, Table 2) gives DualPipe's bubble as (PP/2 - 1)(F&B + B - 3W), F a forward
    chunk, B a full backward chunk, W its weight part, F&B a forward and a backward chunk run overlapped; 1F1B's
    is (PP - 1)(F + B). DualPipeV folds the same schedule into a V: 2 * ranks stages, two per rank, so PP/2 - 1 =
    ranks - 1. overlapped (F&B) defaults to forward + backward: the pair run one after the other, as torch's
    ScheduleDualPipeV does unless a custom overlap function is registered. With F = I = W (B = 2F), replaying
    torch 2.13's DualPipeV order with each overlapped pair as one block (simulate_pipeline) gives exactly this.
    """
    _require(ranks >= 1, f"ranks must be >= 1, got {ranks}")
    for value, name in ((forward, "forward"), (backward, "backward"), (weight, "weight")):
        _check_nonneg(value, name)
    _require(weight <= backward, f"weight ({weight}) is part of the full backward and cannot exceed it ({backward})")
    both = forward + backward if overlapped is None else overlapped
    _check_nonneg(both, "overlapped")
    return (ranks - 1) * (both + backward - 3 * weight)


def pipeline_peak_activations(p, m, v=1, rank=0, schedule="1F1B"):
    """Most chunks whose activations one rank holds at once (a chunk: one micro-batch through one of its stages).

    "GPipe" (v = 1): m, every forward before any backward. "1F1B" (v = 1): min(p - rank, m), the warm-up forwards
    plus the one before the first backward.
    "Interleaved1F1B" (v >= 2 stages per rank), as torch 2.13 and Megatron-LM order it: (v - 1) * k + 2(p - 1 -
    rank) warm-up forwards plus one, at most all m * v chunks, where k = m / max(1, m // p) micro-batches per
    round (k = p when p divides m). On rank 0 with p | m that is v*p + p - 1 chunks of 1/v of the rank's layers:
    p * (1 + (p - 1) / (p * v)) micro-batches' worth, Korthikanti et al. 2022's factor over 1F1B's p.
    "DualPipeV" (2 stages per rank): 2p + 1 chunks on every rank, DeepSeek-V3's PP + 1 with PP = 2p stages.
    """
    _require(p >= 1, f"p (pipeline ranks) must be >= 1, got {p}")
    _require(m >= 1, f"m (micro-batches) must be >= 1, got {m}")
    _require(v >= 1, f"v (stages per rank) must be >= 1, got {v}")
    _require(0 <= rank < p, f"rank must be in [0, {p}), got {rank}")
    if schedule in ("GPipe", "1F1B"):
        _require(v == 1, f"{schedule} has one stage per rank: v must be 1, got {v}")
        return m if schedule == "GPipe" else min(p - rank, m)
    if schedule == "Interleaved1F1B":
        per_round = m // max(1, m // p)
        return min((v - 1) * per_round + 2 * (p - 1 - rank) + 1, m * v)
    if schedule == "DualPipeV":
        _require(v == 2 and m >= 2 * p, f"DualPipeV needs v = 2 and m >= 2p micro-batches, got v={v}, m={m}, p={p}")
        return 2 * p + 1
    raise ValueError(f"schedule must be 'GPipe', '1F1B', 'Interleaved1F1B' or 'DualPipeV', got {schedule!r}")


def pipeline_stage_costs(layers_per_stage, d_model, vocab, seq_len):
    """Parameters and training FLOPs per token of each stage of a GPT cut into stages: the token and position
    embeddings on the first stage, the output head on the last.

    layers_per_stage: transformer blocks on each stage, e.g. [2, 2, 2, 2]. Parameters: the weights of every
    Linear and Embedding (12 d^2 per block; V d for the token table, T d for positions, V d for an untied head;
    biases and norms left out). FLOPs per token, forward + backward, as model_flops_per_token counts them: 6 per
    weight of a matrix product (an embedding lookup does none) plus 12 d T per block for attention (non-causal).
    The head alone costs 6 V d, as much as V / (12 d) blocks' matrix products: a pipeline runs at the pace of its
    slowest stage, so an even cut of the blocks leaves the last stage (and, in memory, the first) the heaviest.
    Returns [{"stage", "layers", "params", "flops_per_token"}].
    """
    _require(len(layers_per_stage) >= 1 and all(n >= 0 for n in layers_per_stage),
             f"layers_per_stage must be a non-empty list of counts >= 0, got {layers_per_stage}")
    _require(d_model >= 1 and vocab >= 1 and seq_len >= 1,
             f"d_model, vocab and seq_len must be >= 1, got {d_model}, {vocab}, {seq_len}")
    out = []
    for s, layers in enumerate(layers_per_stage):
        matmul = 12 * d_model ** 2 * layers + (vocab * d_model if s == len(layers_per_stage) - 1 else 0)
        tables = (vocab + seq_len) * d_model if s == 0 else 0
        out.append({"stage": s, "layers": layers, "params": matmul + tables,
                    "flops_per_token": 6 * matmul + 12 * layers * d_model * seq_len})
    return out


# --- 7. ZeRO memory and communication (chapter 07) ----------------------------------------------------------

def zero_memory_bytes(num_params, dp_degree, stage, *, param_bytes=2, grad_bytes=2,
                      optimizer_bytes=12, offload=False):
    """Model-state bytes per GPU under ZeRO (Rajbhandari et al., 2019).

    Mixed-precision Adam keeps fp16 params (2), fp16 grads (2) and fp32
    master params + momentum + variance (12): 16 bytes/param. Each stage
    shards one more of these over the dp_degree ranks:
      stage 0 (plain DP) 16Ψ; 1: 4Ψ + 12Ψ/N; 2: 2Ψ + 14Ψ/N; 3: 16Ψ/N.
    offload=True (ZeRO-Offload, stage >= 1): optimizer states live in CPU
    memory, and from stage 2 the gradient shards too; only GPU bytes are
    returned. Activations and buffers are not counted.
    """
    _check_nonneg(num_params, "num_params")
    _require(dp_degree >= 1, f"dp_degree must be >= 1, got {dp_degree}")
    _check_stage(stage)
    _require(stage >= 1 or not offload, "offload=True needs stage >= 1 (ZeRO-Offload shards the optimizer)")
    P, G, O = param_bytes, grad_bytes, optimizer_bytes
    if offload:
        O = 0
        G = 0 if stage >= 2 else G
    sharded = {0: 0, 1: O, 2: G + O, 3: P + G + O}[stage]
    replicated = P + G + O - sharded
    return num_params * (replicated + sharded / dp_degree)


def zero_comm_volume(num_params, stage, bytes_per_elem=2):
    """Bytes each rank communicates per step, following the ZeRO paper.

    DP and stages 1-2 do a reduce-scatter + all-gather (= one all-reduce):
    2Ψ elements (the paper rounds 2(N-1)/N to 2). Stage 3 must all-gather
    parameters again for the backward pass: 3Ψ, i.e. 1.5x data parallel.
    """
    _check_nonneg(num_params, "num_params")
    _check_stage(stage)
    return (3 if stage == 3 else 2) * num_params * bytes_per_elem


# --- 8. FSDP, HSDP and DDP as one family: what each collective carries per step (chapter 07) ----------------

def sharded_dp_comm_bytes(param_bytes, replicate, shard, *, grad_bytes=None, reshard_after_forward=True):
    """The collectives of one training step under fully_shard on a (replicate x shard) mesh, per rank.

    Ranks form a replicate x shard grid: parameters, gradients and optimizer states are sharded over the `shard`
    ranks of a group and replicated over the `replicate` groups. shard = N is FSDP (ZeRO-3), replicate = N with
    shard = 1 is DDP, both > 1 is HSDP (hybrid sharding). Per step, with the whole model in one or many groups:
      all_gather      over the shard group, payload = the gathered parameters (param_bytes): in forward, and
                      again in backward when the forward freed them (reshard_after_forward=True, the default);
      reduce_scatter  over the shard group, payload = the full gradients (grad_bytes, default param_bytes);
      all_reduce      over the replicate group, payload = the reduce-scatter's output, grad_bytes / shard.
    Collectives over a group of one rank are not run and are left out. Returns {collective: {"group": "shard"
    or "replicate", "ranks": the group's size, "calls_bytes": the payload summed over the step, "sent": bytes
    this rank sends in a bandwidth-optimal algorithm (bytes_moved_per_rank)}}. Padding (FSDP pads each
    parameter's first dimension to a multiple of `shard`) is not modelled: sizes that divide evenly have none.
    """
    _check_nonneg(param_bytes, "param_bytes")
    for value, name in ((replicate, "replicate"), (shard, "shard")):
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{name} must be a whole number >= 1 (ranks along that mesh dimension), got {value!r}")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    _check_nonneg(grad_bytes, "grad_bytes")
    out = {}
    if shard > 1:
        gathered = (2 if reshard_after_forward else 1) * param_bytes
        out["all_gather"] = {"group": "shard", "ranks": shard, "calls_bytes": gathered,
                             "sent": bytes_moved_per_rank("all_gather", gathered, shard)}
        out["reduce_scatter"] = {"group": "shard", "ranks": shard, "calls_bytes": grad_bytes,
                                 "sent": bytes_moved_per_rank("reduce_scatter", grad_bytes, shard)}
    if replicate > 1:
        out["all_reduce"] = {"group": "replicate", "ranks": replicate, "calls_bytes": grad_bytes / shard,
                             "sent": bytes_moved_per_rank("all_reduce", grad_bytes / shard, replicate)}
    return out


# --- 9. bytes per parameter, by optimizer and precision (chapter 07) ----------------------------------------

# fp32 tensors of the parameter's shape that each optimizer keeps per parameter
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}
PRECISIONS = ("mixed", "fp32")


def state_bytes_per_param(optimizer="adam", precision="mixed"):
    """Bytes per parameter of the model states, as zero_memory_bytes's keyword arguments.

    precision="mixed" (bf16/fp16 training, as in the ZeRO paper): a 2-byte parameter and gradient, and an
    fp32 master copy (4) besides the fp32 optimizer states (4 each): Adam 2 + 2 + (4 + 8) = 16.
    precision="fp32": 4-byte parameter and gradient, no master copy (the parameter is the master):
    Adam 4 + 4 + 8 = 16 too, SGD with momentum 4 + 4 + 4, plain SGD 4 + 4 + 0.
    The master copy counts as optimizer state, as in the ZeRO paper; recipe_bytes_per_param keeps it apart
    and knows more recipes.

        zero_memory_bytes(psi, n, stage, **state_bytes_per_param("sgd_momentum", "fp32"))
    """
    _require(precision in PRECISIONS, f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    parts = recipe_bytes_per_param(precision, optimizer)  # validates optimizer
    return {"param_bytes": parts["parameters"], "grad_bytes": parts["gradients"],
            "optimizer_bytes": parts["master weights"] + parts["optimizer states"]}


# --- 10. mixed precision, recipe by recipe: bytes per parameter (chapter 07b) -------------------------------
# Bytes per parameter element of each model state, per recipe; "state" is one optimizer state element (Adam
# keeps two, m and v). Chapter 07 measures the first four by counting the tensors a real run holds after an
# optimizer step; "fp8" is modelled (no FP8 hardware in this course's CI), with its assumption written down.
PRECISION_RECIPES = {
    "fp32": {"parameters": 4, "gradients": 4, "master weights": 0, "state": 4},
    # autocast casts weights to 16 bits on the fly, per op: the parameters, their gradients and the optimizer
    # stay fp32, so the model states do not shrink (the 16-bit copies backward needs come on top, transiently)
    "autocast": {"parameters": 4, "gradients": 4, "master weights": 0, "state": 4},
    # 16-bit parameters and gradients, an fp32 master copy the optimizer updates, fp32 states: the ZeRO paper's
    # "mixed-precision Adam", 2 + 2 + 4 + 4 + 4 = 16
    "mixed": {"parameters": 2, "gradients": 2, "master weights": 4, "state": 4},
    # everything in bf16, optimizer states too: half the bytes, and updates below bf16's resolution are lost
    "bf16": {"parameters": 2, "gradients": 2, "master weights": 0, "state": 2},
    # MODELLED: "mixed" plus an FP8 (1-byte) copy of each weight, cast once per step and kept for the FP8
    # matrix products of forward and backward (Transformer Engine caches it across micro-batches; it may also
    # keep a transposed copy, one byte more). FP8 saves activation memory and GEMM time, not model states.
    "fp8": {"parameters": 2 + 1, "gradients": 2, "master weights": 4, "state": 4},
}
RECIPES = tuple(PRECISION_RECIPES)
MEASURED_RECIPES = ("fp32", "autocast", "mixed", "bf16")  # what a CPU run can hold and count; fp8 is modelled


def recipe_bytes_per_param(recipe="mixed", optimizer="adam"):
    """Bytes per parameter of each model state under a precision recipe and an optimizer.

    Returns {"parameters", "gradients", "master weights", "optimizer states", "total"}. With Adam:
      fp32      4 + 4 + 0 + 8 = 16
      autocast  4 + 4 + 0 + 8 = 16   (autocast does not shrink parameters)
      mixed     2 + 2 + 4 + 8 = 16   (bf16/fp16 params and grads, fp32 master, fp32 m and v)
      bf16      2 + 2 + 0 + 4 = 8    (no master: small updates are rounded away)
      fp8       3 + 2 + 4 + 8 = 17   (modelled: mixed + a 1-byte FP8 weight copy)
    Per-tensor extras (Adam's step counter, 4 bytes a tensor) and activations are not per parameter: not here.
    """
    _require(recipe in PRECISION_RECIPES, f"unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    _require(optimizer in OPTIMIZER_STATES,
             f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZER_STATES)}")
    r = PRECISION_RECIPES[recipe]
    parts = {"parameters": r["parameters"], "gradients": r["gradients"], "master weights": r["master weights"],
             "optimizer states": r["state"] * OPTIMIZER_STATES[optimizer]}
    return {**parts, "total": sum(parts.values())}


def low_precision_speedup(gemm_fraction, device_name, dtype="fp8", baseline="bf16"):
    """MODELLED step-time speedup from running the matrix products in `dtype` instead of `baseline`.

    Amdahl's law with the datasheet peaks (peak_flops): the GEMMs, a `gemm_fraction` of the baseline step's
    time, run peak(dtype) / peak(baseline) times faster; everything else (norms, softmax, communication, the
    casts and scale computations FP8 adds) does not change. An upper bound: GEMMs rarely run at peak, and small
    ones gain less. On an H100 SXM fp8's dense peak is twice bf16's, so the bound is 1 / (1 - f/2).
    """
    _require(0 <= gemm_fraction <= 1, f"gemm_fraction must be between 0 and 1 (the share of the step's time "
                                      f"spent in matrix products), got {gemm_fraction!r}")
    ratio = peak_flops(device_name, dtype) / peak_flops(device_name, baseline)
    return 1.0 / ((1 - gemm_fraction) + gemm_fraction / ratio)


# --- 11. peak FLOP/s, model and hardware FLOPs per token, MFU and HFU (chapters 07, 09) ---------------------

# Dense (no 2:4 structured sparsity) peak TFLOP/s per device, keyed by the exact string
# torch.cuda.get_device_name() returns. NVIDIA's datasheets print tensor-core rates "with sparsity" (marked *) and say
# in a footnote that the dense rate is one half of that; FP32 is the non-tensor (CUDA core) rate, never sparse.
# One rule, so every figure below can be checked against its datasheet: dense = printed sparse figure / 2.
# Variants of one chip differ (H100 SXM, PCIe and NVL have different clocks, power and SM counts), so a name is
# matched exactly, never by substring: an unknown name, or a dtype whose rate the table does not list, is an error
# that asks for the peak, never the nearest guess. A SKU or rate whose datasheet figure could not be confirmed is
# left out on purpose (H200 NVL; the H100 NVL's tf32, fp32 and fp8 rates).
DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")


class DevicePeak(NamedTuple):
    """One device's dense peaks: TFLOP/s by dtype, and the datasheet they come from (name, URL, figures as printed)."""
    tflops: dict
    source: str


_H100_DATASHEET = ("NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/ "
                   "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)")
_A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet (one table for the 40/80 GB PCIe and SXM boards), "
                   "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                   "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A100 = DevicePeak({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                   f"{_A100_DATASHEET}; printed: FP32 19.5, TF32 156 (312*), BF16 312 (624*), FP16 312 (624*) "
                   "(the A100 datasheet prints the dense rate, and the sparse one beside it)")
_H100_SXM_RATES = {"bf16": 1979 / 2, "fp16": 1979 / 2, "tf32": 989 / 2, "fp32": 67.0, "fp8": 3958 / 2}
PEAK_DENSE_TFLOPS = {
    "NVIDIA H100 80GB HBM3": DevicePeak(  # the H100 SXM5 board
        _H100_SXM_RATES, f"{_H100_DATASHEET}, H100 SXM column; printed: FP32 67, TF32 989*, BF16 1,979*, "
                         "FP16 1,979*, FP8 3,958* (* with sparsity)"),
    "NVIDIA H100 PCIe": DevicePeak(
        {"bf16": 1513 / 2, "fp16": 1513 / 2, "tf32": 756 / 2, "fp32": 51.0, "fp8": 3026 / 2},
        f"{_H100_DATASHEET}, H100 PCIe column; printed: FP32 51, TF32 756*, BF16 1,513*, FP16 1,513*, FP8 3,026*"),
    "NVIDIA H100 NVL": DevicePeak(  # per GPU (some datasheet versions print a pair of NVL cards' figures)
        {"bf16": 1671 / 2, "fp16": 1671 / 2},
        f"{_H100_DATASHEET}, H100 NVL column, per GPU; printed: BF16 1,671*, FP16 1,671*; its other rates are not "
        "listed here (not confirmed): pass peak="),
    "NVIDIA H200": DevicePeak(  # the H200 SXM board; same GH100 compute as the H100 SXM, more and faster memory
        _H100_SXM_RATES, "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/, "
                         "H200 SXM column; printed: FP32 67, TF32 989*, BF16 1,979*, FP16 1,979*, FP8 3,958*"),
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L4": DevicePeak(
        {"bf16": 242 / 2, "fp16": 242 / 2, "tf32": 120 / 2, "fp32": 30.3, "fp8": 485 / 2},
        "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/; printed: FP32 30.3, "
        "TF32 120*, BF16 242*, FP16 242*, FP8 485*"),
    "Tesla T4": DevicePeak(  # Turing: no bf16, tf32 or fp8 tensor cores, and no structured sparsity
        {"fp16": 65.0, "fp32": 8.1},
        "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/tesla-t4/; printed: "
        "single precision 8.1, mixed precision (FP16/FP32) 65 (dense: Turing has no sparsity)"),
    "NVIDIA B200": DevicePeak(  # HGX B200, configured up to 1,000 W; a B200 run at a lower power limit peaks lower
        {"bf16": 4500 / 2, "fp16": 4500 / 2, "tf32": 2200 / 2, "fp32": 75.0, "fp8": 9000 / 2},
        "NVIDIA HGX B200 specifications, individual Blackwell GPU, https://www.nvidia.com/en-us/data-center/hgx/; "
        "printed: FP32 75 TFLOPS, TF32 2.2 PFLOPS*, FP16/BF16 4.5 PFLOPS*, FP8 9 PFLOPS*"),
}


def _known_devices():
    return ", ".join(sorted(PEAK_DENSE_TFLOPS))


def peak_flops(device_name, dtype="bf16"):
    """Dense peak FLOP/s of one device for `dtype` ('bf16', 'fp16', 'tf32', 'fp32', 'fp8'), from its datasheet.

    `device_name` is exactly what torch.cuda.get_device_name() returns ('NVIDIA H100 80GB HBM3' is the SXM board,
    'NVIDIA H100 PCIe' and 'NVIDIA H100 NVL' are slower ones). A device the table does not know, or a dtype the
    device has no listed rate for, raises ValueError telling the caller to pass the peak themselves: a wrong peak
    is how published MFU figures go over 100 % (a fallback table) or halve (a sparse rate for dense work).
    PEAK_DENSE_TFLOPS[device_name].source says where each figure comes from.
    """
    _require(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device_name not in PEAK_DENSE_TFLOPS:
        raise ValueError(f"no datasheet peak for {device_name!r} (known, by exact name: {_known_devices()}): "
                         "look up its dense (not 'with sparsity') peak for your dtype and pass it yourself, "
                         "e.g. mfu(..., peak=<FLOP/s per device>)")
    rates = PEAK_DENSE_TFLOPS[device_name].tflops
    _require(dtype in rates, f"{device_name} has no {dtype!r} rate in gpucourse's table (it lists "
                             f"{', '.join(rates)}): choose one of those dtypes or pass the peak yourself "
                             "(peak=<dense FLOP/s per device>)")
    return rates[dtype] * 1e12


def mfu(achieved_flops_per_second, device_name=None, dtype="bf16", n_devices=1, *, peak=None):
    """Model FLOPs utilisation: achieved *model* FLOP/s over the devices' total dense peak (0..1).

    achieved_flops_per_second: model FLOPs per token (model_flops_per_token) x tokens/s, summed over all
    n_devices. The peak is peak_flops(device_name, dtype) per device, or `peak` (FLOP/s per device) when given,
    for a device the table does not list. Recomputation is not model work: count it in hfu, not here
    (Chowdhery et al. 2022, PaLM, appendix B).
    """
    _check_nonneg(achieved_flops_per_second, "achieved_flops_per_second")
    _require(isinstance(n_devices, int) and not isinstance(n_devices, bool) and n_devices >= 1,
             f"n_devices must be a whole number >= 1, got {n_devices!r}")
    if peak is None:
        _require(device_name is not None, "give device_name (torch.cuda.get_device_name()) or peak= "
                                          "(dense FLOP/s per device)")
        peak = peak_flops(device_name, dtype)
    _require(peak > 0, f"peak must be > 0 (dense FLOP/s per device), got {peak!r}")
    return achieved_flops_per_second / (peak * n_devices)


def hfu(achieved_hardware_flops_per_second, device_name=None, dtype="bf16", n_devices=1, *, peak=None):
    """Hardware FLOPs utilisation: the same division as mfu, of the FLOPs the hardware executed.

    Pass hardware_flops_per_token(...) x tokens/s: it adds what recomputation runs again. HFU >= MFU; only MFU
    compares runs that recompute differently (the PaLM paper reports both: 46.2 % MFU, 57.8 % HFU).
    """
    return mfu(achieved_hardware_flops_per_second, device_name, dtype, n_devices, peak=peak)


def _check_transformer(n_params, n_layers, attn_width, seq_len):
    for value, name in ((n_params, "n_params"), (n_layers, "n_layers"), (attn_width, "attn_width"),
                        (seq_len, "seq_len")):
        _require(value >= 0 if name == "n_params" else value >= 1, f"{name} must be >= "
                 f"{0 if name == 'n_params' else 1}, got {value!r}")


def _attention_keys(seq_len, causal):
    """Keys each query is scored against, averaged over the sequence: T, or (T + 1) / 2 under a causal mask."""
    return (seq_len + 1) / 2 if causal else seq_len


def model_flops_per_token(n_params, n_layers, attn_width, seq_len, *, causal=False):
    """Training FLOPs per token (forward + backward) of a decoder-only transformer: 6 N + 12 L d T.

    n_params (N): parameters that take part in matrix products - every Linear weight, the output head included.
    Not the embedding tables (a lookup does no arithmetic), biases or norms; FlopCounterMode counts the same.
    Each such weight costs 2 FLOPs per token forward (multiply + add) and 4 backward (the input's gradient and
    the weight's): 6 N.
    Attention (PaLM appendix B's 12 L H Q T): attn_width d = H Q, heads x head size, the width of q, k and v -
    d_model in most models, but not all (PaLM 540B: 48 x 256 = 12288, d_model 18432). Per layer and token the
    scores q.K^T and the weighted sum of V each take 2 d FLOPs per key: 4 d T forward, x 3 with backward.
    causal=False is PaLM's convention, and what most published MFU figures (and FlopCounterMode) use: every
    query against all T keys. A causal model needs only the unmasked half: query i against i + 1 keys, (T + 1)/2
    on average, so causal=True gives 6 N + 6 L d (T + 1), the useful work of a kernel that skips masked blocks.
    """
    _check_transformer(n_params, n_layers, attn_width, seq_len)
    return 6 * n_params + 12 * n_layers * attn_width * _attention_keys(seq_len, causal)


RECOMPUTE = ("none", "selective", "full")


def hardware_flops_per_token(n_params, n_layers, attn_width, seq_len, *, recompute="none", causal=False):
    """FLOPs per token the hardware executes: model FLOPs plus what activation recomputation runs again.

    recompute="full": every layer's forward runs twice (checkpointed layers), + 2 N + 4 L d T.
    recompute="selective" (Korthikanti et al. 2022): only attention's core (scores, softmax, weighted sum) is
    recomputed, + 4 L d T. These count in HFU, never in MFU: the model did not get any more work done.
    """
    _require(recompute in RECOMPUTE, f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    flops = model_flops_per_token(n_params, n_layers, attn_width, seq_len, causal=causal)
    attention_forward = 4 * n_layers * attn_width * _attention_keys(seq_len, causal)
    return flops + {"none": 0, "selective": attention_forward, "full": 2 * n_params + attention_forward}[recompute]


# --- 12. context parallelism: bytes each rank sends per attention layer (chapter 10) ------------------------

CONTEXT_PARALLEL = ("all_gather", "ring", "ulysses")


def attention_shard_bytes(batch, seq, heads, head_dim, n, bytes_per_value=2):
    """Bytes of one rank's shard of q (or of k or v: pass their number of heads) with the sequence split over n
    ranks: batch × heads × seq/n × head_dim × bytes per value."""
    for value, name in ((batch, "batch"), (seq, "seq"), (heads, "heads"), (head_dim, "head_dim"), (n, "n")):
        _require(isinstance(value, int) and value >= 1, f"{name} must be a whole number >= 1, got {value!r}")
    _require(seq % n == 0, f"seq={seq} is not divisible by n={n}: every rank holds seq/n tokens")
    _require(bytes_per_value > 0, f"bytes_per_value must be > 0, got {bytes_per_value}")
    return batch * heads * (seq // n) * head_dim * bytes_per_value


def context_parallel_bytes(method, shard_bytes, n, *, backward=False, kv_shard_bytes=None):
    """Bytes one rank sends for one attention layer's forward (or its backward) with the sequence split over n ranks.

    shard_bytes: this rank's q shard (batch × heads × seq/n × head_dim × bytes per value); kv_shard_bytes: its k
    (or v) shard, the same unless grouped-query attention gives K/V fewer heads than q (kv_heads / heads of it).
    K and V together are kv = 2 · kv_shard_bytes. What each way sends (chapter 10 counts the sends and checks these):
      all_gather  forward all-gather K and V ((n-1)/n of the whole K and V = (n-1)·kv); backward reduce-scatter
                  dK and dV (the same).
      ring        forward (n-1) hops of the local K/V block; backward the K/V blocks go round again ((n-1)·kv)
                  and their gradients dK/dV travel with them all the way home (n hops: n·kv). One rank: nothing.
      ulysses     forward all-to-all of q, k and v (sequence-split to head-split) and of the output back: 4
                  tensors, each sending (n-1)/n of itself; backward the same 4 (dO in, dq/dk/dv out). With
                  grouped-query attention k and v are the smaller ones.
    The per-rank volume of all_gather and ring does not shrink with n (each rank sees every other's K/V once);
    Ulysses' does, as (n-1)/n · 4 shards with shards of seq/n. That is bytes, not time: Ulysses' all-to-alls sit
    on the critical path (attention waits for them), an all-to-all across nodes runs at the inter-node links'
    speed, and n is capped by the number of (K/V) heads; the ring overlaps each hop with a block's compute.
    """
    _require(method in CONTEXT_PARALLEL, f"unknown method {method!r}; valid: {', '.join(CONTEXT_PARALLEL)}")
    _check_nonneg(shard_bytes, "shard_bytes")
    kv_shard_bytes = shard_bytes if kv_shard_bytes is None else kv_shard_bytes
    _check_nonneg(kv_shard_bytes, "kv_shard_bytes")
    _require(n >= 1, f"n (number of ranks) must be >= 1, got {n}")
    kv = 2 * kv_shard_bytes
    if method == "all_gather":
        return (n - 1) * kv
    if method == "ring":
        return (n - 1) * kv + (n * kv if backward and n > 1 else 0)  # one rank sends nothing
    moved = lambda size: bytes_moved_per_rank("all_to_all", size, n)  # noqa: E731
    return 2 * moved(shard_bytes) + 2 * moved(kv_shard_bytes)  # q and the output; k and v


def hybrid_context_parallel_bytes(shard_bytes, ulysses, ring, *, backward=False, kv_shard_bytes=None):
    """Bytes one rank sends for one attention layer with Ulysses inside groups of `ulysses` ranks and ring attention
    across `ring` such groups (USP, Fang and Zhao 2024, arXiv 2405.07719): n = ulysses × ring ranks.

    shard_bytes is this rank's q shard with the sequence split over all n ranks. The all-to-alls of q, k, v and the
    output run inside the Ulysses group, as Ulysses over `ulysses` ranks. They leave each rank heads/ulysses heads
    over seq/ring tokens: a block of exactly shard_bytes again, which then goes round a ring of `ring` ranks. So the
    bytes are Ulysses' over `ulysses` ranks plus the ring's over `ring` ranks, for the same shard: ring = 1 is plain
    Ulysses, ulysses = 1 the plain ring. The Ulysses degree is capped by the (K/V) heads, the ring's is not.
    """
    for value, name in ((ulysses, "ulysses"), (ring, "ring")):
        _require(isinstance(value, int) and value >= 1, f"{name} degree must be a whole number >= 1, got {value!r}")
    kwargs = {"backward": backward, "kv_shard_bytes": kv_shard_bytes}
    return (context_parallel_bytes("ulysses", shard_bytes, ulysses, **kwargs)
            + context_parallel_bytes("ring", shard_bytes, ring, **kwargs))


def ring_step_times(block_tokens, heads, head_dim, flops_per_s, bandwidth_bytes_per_s, *, batch=1, kv_heads=None,
                    bytes_per_value=2):
    """(compute seconds, transfer seconds) of one forward step of ring attention, modelled.

    Compute: this rank's block_tokens queries against one K/V block of block_tokens keys, with no mask inside the
    block: QKᵀ and PV, 2 · 2 · batch · heads · block_tokens² · head_dim FLOPs at flops_per_s. Transfer: the K/V
    block passed on to the next rank, 2 · batch · kv_heads · block_tokens · head_dim · bytes_per_value bytes at
    bandwidth_bytes_per_s. No latency term: the blocks that matter are megabytes.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for value, name in ((block_tokens, "block_tokens"), (flops_per_s, "flops_per_s"),
                        (bandwidth_bytes_per_s, "bandwidth_bytes_per_s"), (heads, "heads"), (kv_heads, "kv_heads"),
                        (head_dim, "head_dim"), (batch, "batch"), (bytes_per_value, "bytes_per_value")):
        _require(value > 0, f"{name} must be > 0, got {value!r}")
    compute = 4 * batch * heads * block_tokens ** 2 * head_dim / flops_per_s
    transfer = 2 * batch * kv_heads * block_tokens * head_dim * bytes_per_value / bandwidth_bytes_per_s
    return compute, transfer


def ring_overlap_block_tokens(flops_per_s, bandwidth_bytes_per_s, *, heads=1, kv_heads=None, bytes_per_value=2):
    """The block size (tokens per rank, S/N) from which one ring step's compute takes at least as long as passing
    its K/V block on, so that the transfer can hide behind it (ring_step_times: compute ∝ c², transfer ∝ c):

        4 · h · c² · d / F  >=  2 · h_kv · c · d · bytes / B   <=>   c >= (h_kv / h) · bytes · F / (2 · B)

    F is the FLOP/s attention achieves (a datasheet peak gives the largest, most demanding block), B the link's
    bandwidth per direction. Batch and head_dim cancel. Grouped-query attention (kv_heads < heads) divides it by
    heads / kv_heads: fewer bytes per FLOP.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for value, name in ((flops_per_s, "flops_per_s"), (bandwidth_bytes_per_s, "bandwidth_bytes_per_s"),
                        (heads, "heads"), (kv_heads, "kv_heads"), (bytes_per_value, "bytes_per_value")):
        _require(value > 0, f"{name} must be > 0, got {value!r}")
    return kv_heads / heads * bytes_per_value * flops_per_s / (2 * bandwidth_bytes_per_s)


# --- 13. mixture of experts and expert parallelism (chapter 11) ---------------------------------------------

def moe_capacity(tokens, top_k, num_experts, capacity_factor):
    """Expert capacity: the most (token, choice) assignments one expert accepts from one rank's `tokens`.

    Switch Transformer (Fedus et al. 2021): tokens / experts x capacity factor, with top-k routing k assignments
    per token. Rounded up; a factor of 1.0 leaves no room for any imbalance, 1.25 is the paper's usual choice.
    """
    for value, name in ((tokens, "tokens"), (top_k, "top_k"), (num_experts, "num_experts")):
        _require(isinstance(value, int) and value >= 1, f"{name} must be a whole number >= 1, got {value!r}")
    _require(top_k <= num_experts, f"top_k={top_k} cannot exceed num_experts={num_experts}")
    _require(capacity_factor > 0, f"capacity_factor must be > 0, got {capacity_factor}")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def expert_parallel_all_to_all_bytes(tokens, top_k, hidden, n, bytes_per_value=2, kept_fraction=1.0):
    """Bytes one rank sends to the OTHER ranks in one all-to-all of an expert-parallel MoE layer, routing uniform.

    A rank's tokens x top_k assignments, of which `kept_fraction` survive the capacity, each a row of `hidden`
    values; with experts spread evenly over `n` ranks and routing uniform, (n-1)/n of the rows go to other ranks
    (the rest stay on this rank). The dispatch's buffer is tokens x top_k x kept_fraction x hidden x bytes; the
    combine sends the same back, and backward repeats both: 4 such all-to-alls per layer per step. Skewed
    routing moves a different amount per rank: count it (the chapter does).
    """
    for value, name in ((tokens, "tokens"), (top_k, "top_k"), (hidden, "hidden")):
        _check_nonneg(value, name)
    _require(isinstance(n, int) and n >= 1, f"n (number of ranks) must be a whole number >= 1, got {n!r}")
    _require(bytes_per_value > 0, f"bytes_per_value must be > 0, got {bytes_per_value}")
    _require(0 <= kept_fraction <= 1, f"kept_fraction must be between 0 and 1, got {kept_fraction}")
    return tokens * top_k * kept_fraction * hidden * bytes_per_value * (n - 1) / n


def moe_params(hidden, ffn, num_experts, top_k, *, shared=0):
    """{"total": ..., "active": ...} weight-matrix parameters of one MoE layer: a router (hidden x E) and
    E routed plus `shared` shared experts, each two matrices (hidden x ffn and ffn x hidden).

    "active" is what one token uses: the router, its top_k routed experts and every shared expert. Biases and
    normalisation are left out (a few per-row values, not matrix work). Fine-grained experts (DeepSeekMoE,
    arXiv 2401.06066) split each expert m ways (m x E experts of ffn / m, top m x k): total and active stay the
    same, only the number of ways to combine experts grows.
    """
    for value, name in ((hidden, "hidden"), (ffn, "ffn"), (num_experts, "num_experts"), (top_k, "top_k")):
        _require(isinstance(value, int) and value >= 1, f"{name} must be a whole number >= 1, got {value!r}")
    _require(isinstance(shared, int) and shared >= 0, f"shared must be a whole number >= 0, got {shared!r}")
    _require(top_k <= num_experts, f"top_k={top_k} cannot exceed num_experts={num_experts}")
    expert, router = 2 * hidden * ffn, hidden * num_experts
    return {"total": router + (num_experts + shared) * expert, "active": router + (top_k + shared) * expert}


def moe_flops_per_token(hidden, ffn, num_experts, top_k, *, shared=0, training=True):
    """{"active": ..., "total": ...} matrix FLOPs per token of one MoE layer: 2 per weight in forward, 6 with
    backward (`training`), on the active parameters (what the token runs: the number MFU counts) and on all of
    them (what a dense layer of the same size would run). An MFU computed on total parameters overstates the
    work by total / active: for DeepSeek-V3, about 671 B / 37 B (arXiv 2412.19437).
    """
    params = moe_params(hidden, ffn, num_experts, top_k, shared=shared)
    per_weight = 6 if training else 2
    return {kind: per_weight * n for kind, n in params.items()}


def moe_overlap_time(compute_s, all_to_all_s, chunks=1):
    """One MoE layer's forward with its tokens cut into `chunks` pieces that pipeline on two streams, one
    communicating and one computing: {"time", "exposed_s", "hidden"}.

    compute_s: the experts' time for the whole batch; all_to_all_s: one all-to-all (dispatch) of the whole batch,
    and the combine takes as long. Chunk j is dispatched (D_j), computed (X_j), combined (C_j); the
    communication stream runs D_1, D_2, C_1, D_3, C_2, ..., D_m, C_(m-1), C_m (the next dispatch before the
    previous combine), the compute stream X_1 ... X_m; an operation starts when its stream is free and its input
    is ready. exposed_s = time - compute_s. With one chunk nothing overlaps: 2 a + c. "hidden": more than one
    chunk and no communication exposed beyond the pipeline's fill and drain (the first dispatch and the last
    combine, 2 a / m). It holds whenever compute_s >= 2 x all_to_all_s: each chunk's compute then covers the
    next chunk's dispatch and the previous chunk's combine. Below that the communication stream falls behind
    once the pipeline is long enough (from 4 chunks at compute_s = 1.9 x all_to_all_s; 2 chunks are too short
    to show it).
    """
    _check_nonneg(compute_s, "compute_s")
    _check_nonneg(all_to_all_s, "all_to_all_s")
    _require(isinstance(chunks, int) and chunks >= 1, f"chunks must be a whole number >= 1, got {chunks!r}")
    a, c = all_to_all_s / chunks, compute_s / chunks
    comm_free = compute_free = 0.0
    dispatched, computed, combined = [0.0] * chunks, [0.0] * chunks, [0.0] * chunks
    order = [("D", 0)] + [op for j in range(1, chunks) for op in (("D", j), ("C", j - 1))] + [("C", chunks - 1)]
    for kind, j in order:
        if kind == "D":
            comm_free = dispatched[j] = comm_free + a
        else:
            for i in range(j + 1):  # the compute stream runs every chunk that is ready, in order
                if not computed[i]:
                    compute_free = computed[i] = max(compute_free, dispatched[i]) + c
            comm_free = combined[j] = max(comm_free, computed[j]) + a
    time = combined[-1]
    exposed = time - compute_s
    return {"time": time, "exposed_s": exposed, "hidden": chunks > 1 and exposed <= 2 * a * (1 + 1e-9)}


# --- 14. a dry run's step on a named system, modelled (gpucourse dryrun) -------------------------------------

# A system: the device (a PEAK_DENSE_TFLOPS name), GPUs per node, the link inside a node and between nodes.
SYSTEMS = {
    "h100-sxm": {"device": "NVIDIA H100 80GB HBM3", "node_size": 8, "inside": "NVLink 4 (H100 SXM)",
                 "between": "InfiniBand NDR 400G"},
    "a100-sxm": {"device": "NVIDIA A100-SXM4-80GB", "node_size": 8, "inside": "NVLink 3 (A100 SXM)",
                 "between": "InfiniBand HDR 200G"},
}
# The recorder's op names (dist's) -> this module's collectives; a name that starts with a key takes its value.
_DRYRUN_OPS = (("all_reduce", "all_reduce"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
               ("all_to_all", "all_to_all"), ("broadcast", "broadcast"), ("reduce", "reduce"),
               ("barrier", "all_reduce"), ("monitored_barrier", "all_reduce"), ("send", "send_recv"),
               ("isend", "send_recv"), ("recv", "send_recv"), ("irecv", "send_recv"),
               ("batch_isend_irecv", "send_recv"))


def dryrun_step_time(rank_report, *, system="h100-sxm", dtype="bf16"):
    """A step time and MFU for one rank of a `gpucourse dryrun` report, MODELLED, never measured.

    Compute: the rank's counted FLOPs at the device's dense `dtype` peak (a lower bound: real kernels reach a
    fraction of it). Communication: each counted call's ring α–β time (`collective_time`) on the system's link
    inside a node when every rank of its group sits in one node of `node_size` GPUs (ranks node_size*k ...), its
    link between nodes otherwise; a send or receive on the link between the rank and its peer(s), whatever group
    it was issued in; nothing overlapped with compute. Returns {"label": "modelled", "system",
    "device", "dtype", "compute_s", "comm_s", "latency_s" (the alpha part of comm_s), "step_s", "mfu", "assumes"};
    mfu = compute_s / step_s.
    """
    _require(system in SYSTEMS, f"system must be one of {sorted(SYSTEMS)}, got {system!r}")
    spec = SYSTEMS[system]
    compute = rank_report["flops"] / peak_flops(spec["device"], dtype)
    comm = latency = 0.0
    for row in rank_report["comms"]:
        kind = next((k for prefix, k in _DRYRUN_OPS if row["op"].startswith(prefix)), None)
        n = row["group_size"]
        if kind is None or row["calls"] == 0 or n < 2 and kind != "send_recv":
            continue
        # a send or receive rides the link to its peer; a collective, the links its group spans
        members = [rank_report["rank"], *row["peers"]] if row.get("peers") else row["group"] or []
        nodes = {r // spec["node_size"] for r in members}
        link = INTERCONNECTS[spec["inside"] if len(nodes) <= 1 else spec["between"]]
        comm += row["calls"] * collective_time(kind, row["bytes"] / row["calls"], max(n, 2), link.alpha, link.beta)
        latency += row["calls"] * collective_time(kind, 0, max(n, 2), link.alpha, 0.0)
    step = compute + comm
    return {"label": "modelled", "system": system, "device": spec["device"], "dtype": dtype, "compute_s": compute,
            "comm_s": comm, "latency_s": latency, "step_s": step, "mfu": compute / step if step > 0 else None,
            "assumes": f"compute at the {dtype} dense peak; ring alpha-beta per call on nominal links "
                       f"({spec['inside']} inside a node of {spec['node_size']}, {spec['between']} between); "
                       "no overlap"}
