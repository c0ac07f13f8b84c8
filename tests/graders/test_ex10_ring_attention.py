"""Grader of ex10: ring attention over a sequence split across ranks (run it with `gpucourse grade ex10`).

One real job per world size (1, 2, 3 and 4 ranks, through gpucourse.launch; ex10_job.py), side by side. Every
rank shards the same full q, k, v with the submission's shard_sequence, runs ring_attention forward and backward
on its shard, and compares with its shard of F.scaled_dot_product_attention on the whole sequence (float64).
What is checked:
- shard_sequence gives every position to exactly one rank, and with a causal mask every rank gets the same work
  (the zig-zag layout; a contiguous split gives the last rank N times the first's);
- outputs and q/k/v gradients equal SDPA's, causal and not, float32 and float64, and with scores large enough
  that exp() without the row maximum subtracted overflows;
- point-to-point only: no collective at all, in forward or backward (every call is recorded, through any layer),
  so no rank ever gathers the whole sequence's K or V;
- bytes sent per rank within the ring's: forward (N-1) · kv, backward (N-1) · kv + N · kv (dK, dV), where kv is
  the K and V shards' bytes;
- what the forward leaves alive for backward, besides q, k, v and the output, is under one shard's bytes: the
  backward passes K/V around again instead of keeping every received block (O(seq_local) per rank);
- bad input (q, k, v of different shapes, an odd seq_local, a sequence 2 · world does not divide) raises
  ValueError naming the sizes.
"""
from pathlib import Path

import pytest

from gpucourse import costs

from .job_records import JobRecords, check, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex10_job.py")
WORLD_SIZES = (1, 2, 3, 4)
CASE_LIMIT_S = 30  # a case takes seconds (4 jobs, 10 ranks side by side); the limit catches deadlocks
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: JobRecords}: the four jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex10-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- what makes one rank's record of a case wrong (None when it is right) -----------------------------------------
def output_problem(rec) -> str | None:
    return rec["output"]


def gradient_problem(rec) -> str | None:
    return rec["output"] or rec["gradients"]


def p2p_problem(rec) -> str | None:
    for phase in ("forward", "backward"):
        used = rec.get(phase, {}).get("collectives", [])
        if used:
            return (f"{phase} called {', '.join(used)}: ring attention passes K/V shards with point-to-point "
                    f"calls only (isend/irecv, batch_isend_irecv); a collective lets a rank hold the whole "
                    f"sequence's K or V")
    return None


def bytes_problem(rec) -> str | None:
    n, kv = rec["world"], 2 * rec["shard_bytes"]
    limits = {phase: costs.context_parallel_bytes("ring", rec["shard_bytes"], n, backward=phase == "backward")
              for phase in ("forward", "backward")}
    formulas = {"forward": "(N-1) × kv", "backward": "(N-1) × kv for K/V + N × kv for dK/dV (0 on one rank)"}
    for phase, limit in limits.items():
        if phase not in rec:
            return f"no {phase} ran: {rec['gradients']}"
        sent = rec[phase]["sent"]
        if sent > limit:
            return (f"{phase} sent {sent} bytes on {n} rank(s); the ring sends {formulas[phase]} = {limit} "
                    f"(kv = the K and V shards, {kv} bytes): a hop more than the ring needs")
    return None


def saved_problem(rec) -> str | None:
    saved, shard = rec["saved_bytes"], rec["shard_bytes"]
    if saved is None:
        return rec["output"] or "the forward returned no tensor"
    if saved > shard:
        return (f"the forward left {saved} bytes alive for backward besides q, k, v and the output "
                f"({saved / shard:.1f} shards of {shard} bytes; allowed: one, e.g. the log-sum-exp): keep only "
                f"this rank's tensors and pass K/V around the ring again in backward")
    return None


# --- the tests ----------------------------------------------------------------------------------------------------
@pytest.mark.points(1)
def test_shard_sequence_partitions_the_sequence(jobs):
    """shard_sequence of the positions 0..seq-1: every position on exactly one rank's shard, in every world size."""
    check(jobs, "layout", lambda rec: rec["partition"])


@pytest.mark.points(1)
def test_causal_work_is_balanced(jobs):
    """2-4 ranks: every rank's queries see as many causal (query, key) pairs as every other's (zig-zag)."""
    def problem(rec):
        if rec["partition"]:
            return rec["partition"]
        if rec["work_max"] != rec["work_min"]:
            return (f"with a causal mask the ranks' work ranges from {rec['work_min']} to {rec['work_max']} "
                    f"(query, key) pairs (this rank: {rec['work']}, positions {rec['positions']}): pair an early "
                    f"chunk with a late one (zig-zag: chunks r and 2N-1-r)")
        return None

    check(jobs, "layout", problem, [2, 3, 4])


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_output_equals_sdpa(jobs, world):
    """No mask, float32: this rank's output equals its shard of SDPA on the whole sequence."""
    check(jobs, ["full-float32"], output_problem, [world])


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_gradients_equal_sdpa(jobs, world):
    """No mask, float32: q.grad, k.grad and v.grad equal this rank's shards of SDPA's."""
    check(jobs, ["full-float32"], gradient_problem, [world])


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_causal_output_equals_sdpa(jobs, world):
    """Causal, float32: the output equals SDPA(is_causal=True)'s shard."""
    check(jobs, ["causal-float32"], output_problem, [world])


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_causal_gradients_equal_sdpa(jobs, world):
    """Causal, float32: q/k/v gradients equal SDPA(is_causal=True)'s shards."""
    check(jobs, ["causal-float32"], gradient_problem, [world])


@pytest.mark.points(1)
def test_float64(jobs):
    """Causal and not, float64, every world size: output and gradients in float64, within 1e-10 of SDPA's."""
    check(jobs, "float64", gradient_problem)


@pytest.mark.points(1)
def test_large_scores_stay_finite(jobs):
    """q scaled so that scores reach several hundred (float32): subtract the row maximum before exp()."""
    check(jobs, "large", gradient_problem)


@pytest.mark.points(2)
def test_point_to_point_only(jobs):
    """Every attention case, every world size: no collective in forward or backward."""
    for group in ("full", "causal", "float64", "large"):
        check(jobs, group, p2p_problem)


@pytest.mark.points(2)
def test_bytes_sent_match_the_ring(jobs):
    """Bytes sent per rank ≤ the ring's: forward (N-1)·kv, backward (2N-1)·kv; nothing at world size 1."""
    check(jobs, ["full-float32", "causal-float32", "full-float64"], bytes_problem)


@pytest.mark.points(2)
def test_backward_keeps_only_local_state(jobs):
    """What the forward leaves alive for backward (besides q, k, v, output) is under one shard: O(seq_local)."""
    check(jobs, ["full-float32", "causal-float32"], saved_problem, [2, 3, 4])


@pytest.mark.points(1)
def test_bad_input_raises_value_error(jobs):
    """q/k/v shapes that differ, an odd seq_local, and shard_sequence of an indivisible sequence: ValueError."""
    check(jobs, "bad-input", lambda rec: rec["problem"])
