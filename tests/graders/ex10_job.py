"""The grading job of ex10 (ring attention): every case for this job's world size, in one launch.

    ex10_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex10_ring_attention.py launches it on 1, 2, 3 and 4 ranks. Every rank builds the same full q, k, v and
upstream gradient from a fixed seed, computes the reference in float64 on the whole sequence
(F.scaled_dot_product_attention), takes its shard of everything with the submission's `shard_sequence`, runs
`ring_attention` forward and backward on its shard, and compares with its shard of the reference. Each rank logs
one record per case (jobkit.record_writer, in runtime.log's format):

    {"case": "causal-float32", "group": "causal", "error": None, "output": None,
     "gradients": "k.grad differs from SDPA's by 0.31 ...", "forward": {"collectives": [], "sent": 1536},
     "backward": {...}, "saved_bytes": 5120, "shard_bytes": 1024, ...}

Cases: layout (shard_sequence of the positions 0..seq-1: a partition of the sequence? the causal work of each
rank, counted as the (query, key) pairs it must compute), attention cases (causal or not, float32 or float64,
normal or large scores), and bad-input cases (each rank on its own: ValueError before any communication).

The submission runs under a guard that records every collective and point-to-point call and the bytes sent
(comm_recorder, any layer), and notes every tensor of a quarter shard or more that the forward creates
(jobkit.Allocations) to see what is still alive for backward (the two float32 cases); what it prints is capped and a watchdog ends a case that deadlocks.
"""
import argparse
import functools
import os
import re

import torch
import torch.distributed as dist
from torch.nn import functional as F

import comm_recorder  # beside this script: what a submission communicates
import jobkit  # beside this script: what every grading job shares
from gpucourse import runtime

SUBMISSION = [""]
BATCH, HEADS, CHUNK, HEAD_DIM = 2, 2, 4, 8  # seq = 2 · world · CHUNK: seq_local = 2 · CHUNK = HEAD_DIM
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10}
LARGE_TOLERANCE = 2e-3  # large scores in float32: a rounding of s (|s| ~ 500) moves a probability by ~1e-4
LARGE_SCALE = 60.0  # q times this: scores reach several hundred, and exp(89) is already inf in float32


# --- the guard ---------------------------------------------------------------------------------------------------
class Guard(jobkit.Guard):
    """What the submission communicates while watched: collectives and point-to-point calls by name, bytes sent."""

    def summary(self) -> dict:
        events = self.comm.events
        return {"collectives": sorted({e["op"] for e in events if e["kind"] == "collective"}),
                "p2p": sorted({e["op"] for e in events if e["kind"] == "p2p"}),
                "sent": self.comm.sent_bytes}


def one_line(err: BaseException) -> str:
    return jobkit.one_line(err, SUBMISSION[0])


# --- the reference ------------------------------------------------------------------------------------------------
def full_inputs(world: int, seed: int, dtype, scale: float = 1.0):
    """q, k, v and the upstream gradient over the whole sequence, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, 2 * world * CHUNK, HEAD_DIM)
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    return (q * scale).to(dtype), k.to(dtype), v.to(dtype), grad.to(dtype)


def reference(q, k, v, grad, causal: bool):
    """SDPA on the whole sequence in float64: output and q/k/v gradients."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(grad.double())
    return out.detach(), *(t.grad for t in leaves)


def compare(label: str, got, want: torch.Tensor, tol: float, dtype, hint: str) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{label} is {type(got).__name__}, not a tensor of shape {tuple(want.shape)}: {hint}"
    if got.shape != want.shape:
        return f"{label} has shape {tuple(got.shape)}, expected {tuple(want.shape)} (this rank's shard)"
    if got.dtype != dtype:
        return f"{label} is {got.dtype}, expected {dtype} (the input's dtype)"
    diff = (got.detach().double() - want).abs().max().item() if want.numel() else 0.0
    if not diff <= tol:  # NaN and inf are wrong too
        return f"{label} differs from SDPA's on the whole sequence by {diff:.3g} (tolerance {tol:g}): {hint}"
    return None


def first(*problems) -> str | None:
    return next((p for p in problems if p), None)


# --- the cases ----------------------------------------------------------------------------------------------------
def case_layout(sub, guard, world: int, rank: int) -> dict:
    """shard_sequence of the positions: each position on exactly one rank; each rank's causal (query, key) pairs."""
    seq = 2 * world * CHUNK
    positions = torch.arange(seq, dtype=torch.float64).view(1, 1, seq, 1).expand(1, 1, seq, 2).contiguous()
    with guard.watching():
        shard = sub.shard_sequence(positions, rank, world)
    if not isinstance(shard, torch.Tensor) or shard.shape != (1, 1, seq // world, 2):
        what = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
        return {"partition": f"shard_sequence returned {what} for a [1, 1, {seq}, 2] tensor on {world} ranks; "
                             f"expected shape (1, 1, {seq // world}, 2)", "work": None}
    mine = shard[0, 0, :, 0]
    counts = torch.zeros(seq, dtype=torch.float64)
    if bool((mine == mine.round()).all() and (mine >= 0).all() and (mine < seq).all()):
        counts.index_add_(0, mine.long(), torch.ones_like(mine))
    guard.dist.all_reduce(counts)
    partition = None
    if not bool((counts == 1).all()):
        bad = int((counts != 1).nonzero()[0])
        partition = (f"position {bad} of the sequence is on {int(counts[bad])} ranks' shards: shard_sequence must "
                     f"give every position to exactly one rank")
    work = int((mine + 1).sum()) if partition is None else None  # query at position p sees keys 0..p
    extremes = torch.tensor([float(work or 0), -float(work or 0)], dtype=torch.float64)
    guard.dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    return {"partition": partition, "positions": mine.long().tolist(), "work": work,
            "work_max": int(extremes[0]), "work_min": int(-extremes[1])}


def case_attention(sub, guard, world: int, rank: int, causal: bool, dtype, scale: float = 1.0, seed: int = 0,
                   memory: bool = False):
    q, k, v, grad = full_inputs(world, seed, dtype, scale)
    want = reference(q, k, v, grad, causal)
    tol = LARGE_TOLERANCE if scale != 1.0 else TOLERANCE[dtype]
    with guard.watching():  # the layout is the submission's own; the layout case checks it
        mine = [sub.shard_sequence(t, rank, world) for t in (q, k, v, grad)]
        want = [sub.shard_sequence(t, rank, world) for t in want]
    leaves = [t.detach().clone().requires_grad_() for t in mine[:3]]
    shard_bytes = leaves[0].numel() * leaves[0].element_size()
    allocs = jobkit.Allocations(min_numel=leaves[0].numel() // 4)  # a quarter shard: a chunk of K or V counts
    with guard.watching(), allocs:
        out = sub.ring_attention(*leaves, causal=causal)
    forward = guard.summary()
    saved = None  # what the forward left alive for backward, besides q, k, v and the output
    if memory and isinstance(out, torch.Tensor):
        saved = allocs.alive_bytes(exclude=[out] + leaves, within=shard_bytes)
    record = {"forward": forward, "saved_bytes": saved, "shard_bytes": shard_bytes, "world": world,
              "element_size": leaves[0].element_size(),
              "output": compare("the output", out, want[0], tol, dtype,
                                "merge the blocks' partial results with the log-sum-exp rule" +
                                ("; mask by GLOBAL chunk (skip future blocks)" if causal else "")),
              "gradients": "no output to differentiate"}
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        record["gradients"] = "the output does not require grad: ring_attention must support backward"
        return record
    with guard.watching():
        out.backward(mine[3])
    record["backward"] = guard.summary()
    names = ("q.grad", "k.grad", "v.grad")
    record["gradients"] = first(*(
        compare(n, t.grad, w, tol, dtype, "pass K/V around the ring again in backward, with their accumulated "
                                          "gradients, N hops so each dK/dV gets home")
        for n, t, w in zip(names, leaves, want[1:])))
    return record


def case_bad_input(sub, guard, world: int, rank: int, which: str) -> dict:
    """Each rank on its own, before any communication: ValueError naming what is wrong."""
    local = 2 * CHUNK
    if which == "shapes":
        q = torch.randn(BATCH, HEADS, local, HEAD_DIM)
        k = torch.randn(BATCH, HEADS, local + 2, HEAD_DIM)
        call, needles = lambda: sub.ring_attention(q, k, k.clone()), [str(local), str(local + 2)]
        what = f"ring_attention with q of seq_local {local} and k, v of {local + 2}"
    elif which == "odd":
        q = torch.randn(BATCH, HEADS, 5, HEAD_DIM)
        call, needles = lambda: sub.ring_attention(q, q.clone(), q.clone()), ["5"]
        what = "ring_attention with seq_local=5 (the zig-zag layout needs two equal chunks)"
    else:
        seq = 2 * world * CHUNK + 1  # odd: never a multiple of 2 · world
        x = torch.randn(1, 1, seq, 4)
        call, needles = lambda: sub.shard_sequence(x, rank, world), [str(seq), str(2 * world)]
        what = f"shard_sequence of a sequence of {seq} on {world} rank(s) ({2 * world} chunks)"
    try:
        with guard.watching():
            call()
    except ValueError as err:
        text = str(err)
        named = all(re.search(rf"(?<!\d){n}(?!\d)", text) for n in needles)
        return {"problem": None if named else f"{what} raised ValueError({text[:150]!r}); name the sizes "
                                              f"({', '.join(needles)})"}
    except Exception as err:  # noqa: BLE001 - the wrong exception is the learner's bug
        return {"problem": f"{what} raised {one_line(err)}, not ValueError"}
    return {"problem": f"{what} returned; raise ValueError saying what is wrong"}


def plan(world: int, rank: int) -> list[tuple[str, str, object]]:
    """(case, group, function of (submission, guard)) in the order they run."""
    p = functools.partial
    at = {"world": world, "rank": rank}
    cases = [("layout", "layout", p(case_layout, **at))]
    for causal in (False, True):
        name = "causal" if causal else "full"
        cases.append((f"{name}-float32", name, p(case_attention, causal=causal, dtype=torch.float32, seed=1,
                                                 memory=True, **at)))
        cases.append((f"{name}-float64", "float64", p(case_attention, causal=causal, dtype=torch.float64, seed=2,
                                                      **at)))
        cases.append((f"{name}-large-scores", "large", p(case_attention, causal=causal, dtype=torch.float32,
                                                         scale=LARGE_SCALE, seed=3, **at)))
    for which in ("shapes", "odd", "shard"):
        cases.append((f"bad-{which}", "bad-input", p(case_bad_input, which=which, **at)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--case-limit", type=float, default=20.0)
    args = parser.parse_args()
    SUBMISSION[0] = os.path.abspath(args.submission)
    rt = runtime.setup(seed=0)
    log = jobkit.record_writer()  # before the submission is imported: see record_writer
    guard, watchdog = Guard(comm_recorder.install()), jobkit.Watchdog(
        "a deadlock (a receive that no rank's send matches), an endless loop, or far too slow", log)
    # What loads lazily on first use (SDPA's backward, the dispatch mode, gc over the process) before any case's clock
    warm = jobkit.Allocations()
    with warm:
        reference(*full_inputs(1, 0, torch.float64), causal=True)
    warm.alive_bytes()
    cases = plan(rt.world_size, rt.rank)
    log(case="plan", cases={case: group for case, group, _ in cases}, world_size=rt.world_size)
    sub = jobkit.import_or_exit(args.submission, "ex10", ("ring_attention", "shard_sequence"), guard.watching,
                                watchdog, args.case_limit, log)
    # A barrier after each case: a rank that failed before a send must not meet its peers' next case.
    jobkit.run_cases(cases, (sub, guard), watchdog, args.case_limit, args.submission, log,
                     between=guard.dist.barrier)
    runtime.teardown()


if __name__ == "__main__":
    main()
