"""Grader of ex11: expert-parallel dispatch and combine of a mixture-of-experts layer (`gpucourse grade ex11`).

One real job per world size (1, 2, 3 and 4 ranks, through gpucourse.launch; ex11_job.py), side by side. Every
rank builds the same 12 experts and every rank's tokens and routing from fixed seeds, runs the single-process
layer as the reference, then the submission on its own tokens with its own E/N experts. What is checked:
- dispatch delivers each kept row to the rank of its expert, in the stated order, with its local expert id;
- the layer equals the single-process one: outputs, gradients of the tokens, the routing weights and every
  expert's weights (balanced routing; and skewed routing, where the splits are uneven);
- capacity: the same assignments dropped as the single-process layer, and counted (kept, dropped,
  tokens_per_expert);
- communication (2-4 ranks): all_to_all_single only (no all_gather, all_reduce, broadcast or point-to-point),
  one each way in forward and in backward (plus the counts), each moving exactly the kept rows: its bytes
  match gpucourse.costs.expert_parallel_all_to_all_bytes;
- num_experts the group does not divide raises ValueError naming both sizes.
"""
from pathlib import Path

import pytest

from gpucourse import costs

from .job_records import JobRecords, check, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex11_job.py")
WORLD_SIZES = (1, 2, 3, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: JobRecords}: the four jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex11-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- what makes one rank's record of a case wrong (None when it is right) ---------------------------
def equal_problem(rec) -> str | None:
    return rec["mismatches"][0] if rec["mismatches"] else None


def dispatch_problem(rec) -> str | None:
    return rec["dispatch"][0] if rec["dispatch"] else None


def accounting_problem(rec) -> str | None:
    return (rec["accounting"] or rec["mismatches"] or [None])[0]


def calls_of(rec, phase):
    return [c for c in rec["calls"] if c["phase"] == phase]


def collectives_problem(rec) -> str | None:
    """all_to_all_single only: forward at most 3 (counts, tokens out, tokens back), backward exactly 2."""
    for phase, most in (("forward", 3), ("backward", 2)):
        calls = calls_of(rec, phase)
        ops = ", ".join(c["op"] for c in calls) or "none"
        others = [c["op"] for c in calls if c["op"] != "all_to_all_single"]
        if others:
            return (f"{phase} started {', '.join(dict.fromkeys(others))} ({ops}): move the tokens with "
                    f"all_to_all_single only; each rank must never hold every rank's tokens")
        if phase == "backward" and len(calls) != most or len(calls) > most or len(calls) < 2:
            return (f"{phase} started {len(calls)} all_to_all_single call(s); expected "
                    + ("the counts, then one all-to-all of the tokens each way" if phase == "forward" else
                       "one all-to-all of the gradients each way"))
    return None


def bytes_problem(rec) -> str | None:
    """The tokens' all-to-alls move exactly the kept rows, as costs.expert_parallel_all_to_all_bytes predicts."""
    n, row = rec["n"], rec["row_bytes"]
    formula = costs.expert_parallel_all_to_all_bytes(rec["tokens"], 2, row // 4, n, bytes_per_value=4,
                                                     kept_fraction=rec["kept"] / (2 * rec["tokens"]))
    sent, received = rec["kept"] * row, rec["received"] * row  # the buffers, this rank's own rows included
    for phase in ("forward", "backward"):
        calls = calls_of(rec, phase)
        tokens = [c for c in calls if sorted(c["tensor_bytes"]) == sorted([sent, received])]
        small = [c for c in calls if c not in tokens and max(c["tensor_bytes"] or [0]) <= 8 * rec["num_experts"]]
        moved = "; ".join(f"{c['op']} {c['tensor_bytes']} B" for c in calls) or "nothing"
        if len(tokens) != 2 or (phase == "backward" and small) or len(tokens) + len(small) != len(calls):
            return (f"{phase} moved {moved}; expected two all-to-alls of the kept rows ({rec['kept']} rows x "
                    f"{row} B = {sent} B out, {received} B in; of which {formula:g} B to the other ranks, "
                    f"costs.expert_parallel_all_to_all_bytes)" + (" and at most the counts besides"
                                                                  if phase == "forward" else ""))
    if sent * (n - 1) / n != formula:  # the grader's routing is even: the formula holds exactly
        return f"the grader's balanced routing sent {sent} B, not what the formula predicts ({formula:g} B × n/(n-1))"
    return None


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_dispatch_delivers_rows_to_their_experts(jobs, world):
    """Each kept row arrives on its expert's rank: by source rank, local expert, token order; local expert ids."""
    check(jobs, ["balanced", "capacity"], dispatch_problem, [world])


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_layer_equals_single_process(jobs, world):
    """Balanced routing: output, tokens.grad, weights.grad and the local experts' gradients equal one process's."""
    check(jobs, ["balanced"], equal_problem, [world])


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_dropped_tokens_accounted(jobs, world):
    """Capacity 2, every expert chosen 4 times per rank: the same assignments dropped, and counted; outputs equal."""
    check(jobs, ["capacity"], accounting_problem, [world])


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_uneven_splits_equal_single_process(jobs, world):
    """Skewed routing (with and without capacity): every rank pair's split differs; the layer still equals one process's."""
    check(jobs, "uneven", equal_problem, [world])


@pytest.mark.points(3)
def test_only_all_to_all(jobs):
    """2-4 ranks: forward and backward start all_to_all_single only: the counts, then one each way."""
    check(jobs, ["balanced", "capacity"], collectives_problem, [2, 3, 4])


@pytest.mark.points(2)
def test_bytes_moved_match_the_formula(jobs):
    """2-4 ranks: each all-to-all of the tokens moves exactly the kept rows (no padding, no extra rows)."""
    check(jobs, ["balanced", "capacity"], bytes_problem, [2, 3, 4])


@pytest.mark.points(1)
def test_num_experts_not_divisible_raises_value_error(jobs):
    """num_experts = 2N+1 on N ranks: ValueError naming both sizes, before anything is sent."""
    check(jobs, "divisible", equal_problem, [2, 3, 4])
