"""What communication costs (chapter 01; used again in 03, 06, 07, 08, 10, 11): nccl-tests' bandwidth definitions,
the bytes each rank sends, the alpha-beta model of a collective's time and its fit to measurements, and nominal
interconnects."""
import math
from dataclasses import dataclass

import numpy as np

from ..units import human_seconds, human_si
from ._checks import check_nonneg, require


# Bus-bandwidth factors from NVIDIA nccl-tests (doc/PERFORMANCE.md). busbw =
# algbw * factor is the traffic through the busiest link of a ring, so it is
# comparable across collectives and GPU counts, and to the hardware link rate.
_BUSBW = {"all_reduce": lambda n: 2 * (n - 1) / n,
          **dict.fromkeys(["all_gather", "reduce_scatter", "all_to_all"], lambda n: (n - 1) / n),
          **dict.fromkeys(["broadcast", "reduce", "send_recv", "p2p"], lambda n: 1.0)}
COLLECTIVES = tuple(_BUSBW)


# --- nccl-tests bandwidth definitions (chapter 01) ----------------------------------------------------------

def algbw(size_bytes, seconds):
    """Algorithm bandwidth: buffer size / time, as nccl-tests prints it."""
    check_nonneg(size_bytes, "size_bytes")
    require(seconds > 0, f"seconds must be > 0, got {seconds}")
    return size_bytes / seconds


def busbw_factor(collective, n):
    """busbw / algbw for `collective` on `n` ranks (nccl-tests convention).

    Size convention (as in nccl-tests): for all_gather the size is the *output*
    (total, n shards) buffer; for reduce_scatter it is the *input* (total)
    buffer; for all_reduce / broadcast / reduce it is the one buffer.
    """
    require(collective in _BUSBW, f"unknown collective {collective!r}; valid: {', '.join(COLLECTIVES)}")
    require(n >= 1, f"n (number of ranks) must be >= 1, got {n}")
    return _BUSBW[collective](n)


def busbw(collective, size_bytes, seconds, n):
    """Bus bandwidth: compare this, not algbw, with the link's rated speed."""
    return algbw(size_bytes, seconds) * busbw_factor(collective, n)


# --- bytes on the wire (chapter 01) -------------------------------------------------------------------------

def bytes_moved_per_rank(collective, size_bytes, n):
    """Bytes each rank sends in a bandwidth-optimal (ring / pipelined) algorithm.

    This is exactly busbw_factor * size -- which is *why* nccl-tests defines
    busbw that way. A ring all_reduce is a reduce_scatter then an all_gather,
    each sending (n-1)/n of the buffer, hence 2(n-1)/n. One rank moves nothing.
    """
    check_nonneg(size_bytes, "size_bytes")
    factor = busbw_factor(collective, n)
    return 0.0 if n == 1 else factor * size_bytes


# --- alpha-beta (latency-bandwidth) model (chapter 01) ------------------------------------------------------

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
    check_nonneg(size_bytes, "size_bytes")
    check_nonneg(alpha, "alpha")
    check_nonneg(beta, "beta")
    if n == 1:
        return 0.0
    if algorithm == "ring":
        steps = {"all_reduce": 2 * (n - 1), "send_recv": 1, "p2p": 1}.get(collective, n - 1)
        return steps * alpha + bytes_moved_per_rank(collective, size_bytes, n) * beta
    if algorithm == "tree":
        passes = {"all_reduce": 2, "broadcast": 1, "reduce": 1}.get(collective)
        require(passes, f"algorithm='tree' supports all_reduce, broadcast, reduce; got {collective!r}")
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
    require(s.ndim == 1 and s.shape == t.shape,
             f"sizes_bytes and times_s must be 1-D and the same length, got {s.shape}, {t.shape}")
    require(len(np.unique(s)) >= 2, "sizes_bytes needs at least 2 distinct sizes to separate alpha from beta")
    require(np.all(t > 0), "times_s must all be > 0")
    require(n >= 2, f"n must be >= 2 to fit (one rank does no communication), got {n}")
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


# --- interconnect presets (chapter 01; used again in 03, 06, 08) --------------------------------------------

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
