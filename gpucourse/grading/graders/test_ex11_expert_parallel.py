"""Grader of ex11: expert-parallel dispatch and combine of a mixture-of-experts layer (`gpucourse grade ex11`).

One real job per world size (1, 2, 3 and 4 ranks, through gpucourse.launch; ex11_job.py), side by side. Every
rank builds the same 12 experts and its own tokens and routing from fixed seeds, runs the submission on its own
tokens with its own E/N experts and saves raw what came out. The tests below run the single-process layer on
every rank's tokens, here in the grader process from the job's own seeds, and compare. What is checked:
- dispatch delivers each kept row to the rank of its expert, in the stated order, with its local expert id;
- the layer equals the single-process one: outputs, gradients of the tokens, the routing weights and every
  expert's weights (balanced routing; and skewed routing, where the splits are uneven);
- capacity: the same assignments dropped as the single-process layer, and counted (kept, dropped,
  tokens_per_expert);
- communication (2-4 ranks): all_to_all_single only (no all_gather, all_reduce, broadcast or point-to-point),
  one each way in forward and in backward (plus the counts), each moving exactly the kept rows: its bytes
  match gpucourse.costs.expert_parallel_all_to_all_bytes;
- num_experts the group does not divide raises ValueError naming both sizes;
- group= (4 ranks as two expert-parallel groups of 2, non-contiguous: {0, 2} and {1, 3}, each with its own experts
  and tokens): every rank equals the single-process layer of its GROUP (outputs, gradients, what dispatch
  delivered, kept / dropped / tokens_per_expert), and every collective it started ran on its own group (the
  recorder places each call: the process group it ran on, as global ranks).
"""
from pathlib import Path

import pytest
import torch

from gpucourse import costs

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex11_job.py")
CASES = job_module(JOB)  # its plan, inputs and comparison: the single-process layer runs here
WORLD_SIZES = (1, 2, 3, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: JobRecords}: the four jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex11-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- a rank's raw results against the single-process layer --------------------------------------------------
def shown(value) -> str:
    """A saved state field as a learner reads it (saved as its repr when it was neither tensor nor number)."""
    return value if isinstance(value, str) else repr(value)


def wanted(rec) -> dict:
    """What this rank must produce: the single-process layer of its expert-parallel group (the whole job's, or
    in a subgroup case its own group's, from the job's plan and the rank's number as the grader knows it)."""
    if CASES.ROUTED[rec["case"]][0] == "subgroups":
        subgroup, group_rank = CASES.subgroup_of(rec["rank"])
        return CASES.expected(rec["case"], len(CASES.SUBGROUPS[subgroup]), subgroup)[group_rank]
    return CASES.expected(rec["case"], rec["n"])[rec["rank"]]


def findings(rec) -> dict[str, list[str]]:
    """{"mismatches", "dispatch", "accounting"}: why this rank's output and gradients, what dispatch delivered,
    and the state's accounting differ from the single-process layer's (empty lists when they do not)."""
    got, want = raw(rec), wanted(rec)
    pairs = [("the output", got["y"], want["y"],
              "expected sum_j w[t, j] * expert_{ids[t, j]}(x[t]) over the kept assignments: combine must put each "
              "row back at its (token, choice)"),
             ("tokens.grad", got["x_grad"], want["x_grad"],
              "in backward, each row's gradient must go back to its source rank and token (AllToAll's backward: the "
              "splits swapped)"),
             ("weights.grad", got["w_grad"], want["w_grad"],
              "each expert output must come back to its own (token, choice)")]
    for key, w in want["experts"].items():
        e, name = key.removeprefix("expert").split("/", 1)
        g = got.get(key)
        g = torch.zeros_like(w) if g is None and not w.any() else g  # an expert nobody chose: no gradient
        pairs.append((f"expert {e}'s {name}.grad", g, w, "the expert saw other rows than the single-process layer "
                                                         "sends it (from every rank)"))
    mismatches = [why for why in (CASES.compare(*p) for p in pairs) if why]
    dispatch = [why for why in (
        CASES.compare("local_tokens", got["arrived_tokens"], want["arrived_tokens"],
                      "rows by source rank, then local expert, then token order"),
        CASES.compare("local_expert_ids", got["arrived_ids"], want["arrived_ids"],
                      "the LOCAL index (0 ... E/N-1) of each row's expert")) if why]
    accounting, kept_want = [], want["kept"]
    kept = got["state_kept"]
    if not isinstance(kept, torch.Tensor) or kept.shape != kept_want.shape or not torch.equal(kept.bool(), kept_want):
        accounting.append(f"state.kept is not the (T, k) mask of kept assignments: "
                          f"{int((~kept_want).sum())} of {kept_want.numel()} are over capacity (row-major order)")
    dropped = got["state_dropped"]
    if isinstance(dropped, torch.Tensor):
        dropped = dropped.item() if dropped.numel() == 1 else dropped
    if dropped != int((~kept_want).sum()):
        accounting.append(f"state.dropped is {shown(dropped)}; this rank dropped {int((~kept_want).sum())} assignments")
    tpe, want_tpe = got["state_tokens_per_expert"], want["tokens_per_expert"]
    if not isinstance(tpe, torch.Tensor) or tpe.shape != want_tpe.shape or not torch.equal(tpe.long(), want_tpe):
        accounting.append(f"state.tokens_per_expert is {shown(tpe)}; expected this rank's assignments per expert "
                          f"before the capacity: {want_tpe.tolist()}")
    return {"mismatches": mismatches, "dispatch": dispatch, "accounting": accounting}


# --- what makes one rank's record of a case wrong (None when it is right) ---------------------------
def equal_problem(rec) -> str | None:
    found = findings(rec)["mismatches"]
    return found[0] if found else None


def dispatch_problem(rec) -> str | None:
    found = findings(rec)["dispatch"]
    return found[0] if found else None


def accounting_problem(rec) -> str | None:
    found = findings(rec)
    return (found["accounting"] or found["mismatches"] or [None])[0]


SUBGROUP_HINT = ("with group=..., take the group's size and rank (dist.get_world_size(group), dist.get_rank(group)) "
                 "and pass group= to every all_to_all_single, in forward and in backward")


def subgroup_problem(rec) -> str | None:
    found = findings(rec)
    why = (found["mismatches"] or found["dispatch"] or found["accounting"] or [None])[0]
    group = list(CASES.SUBGROUPS[CASES.subgroup_of(rec["rank"])[0]])
    return why and f"in the group of ranks {group}: {why} ({SUBGROUP_HINT})"


def inside_group_problem(rec) -> str | None:
    """Every collective of forward and backward ran on the rank's own group (the recorder's global ranks)."""
    group = list(CASES.SUBGROUPS[CASES.subgroup_of(rec["rank"])[0]])
    for call in rec["calls"]:
        outside = [g for g in call.get("groups") or [None] if g != group]
        if outside:
            where = "a process group the grader cannot place" if None in outside else f"ranks {outside[0]}"
            return f"{call['phase']}: {call['op']} ran on {where}, not on this rank's group {group}: {SUBGROUP_HINT}"
    return None


def divisible_problem(rec) -> str | None:
    return (CASES.divisible_problems(rec) or [None])[0]


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
    n, row = rec["world"], CASES.HIDDEN * 4  # the job's world size (JobRecords'), float32 rows
    want = CASES.expected(rec["case"], n)[rec["rank"]]  # the single-process layer: which rows are kept, arrive
    tokens, kept, received = want["tokens"], int(want["kept"].sum()), want["arrived_tokens"].shape[0]
    formula = costs.expert_parallel_all_to_all_bytes(tokens, 2, row // 4, n, bytes_per_value=4,
                                                     kept_fraction=kept / (2 * tokens))
    sent, received = kept * row, received * row  # the buffers, this rank's own rows included
    for phase in ("forward", "backward"):
        calls = calls_of(rec, phase)
        tokens = [c for c in calls if sorted(c["tensor_bytes"]) == sorted([sent, received])]
        small = [c for c in calls if c not in tokens and max(c["tensor_bytes"] or [0]) <= 8 * CASES.NUM_EXPERTS]
        moved = "; ".join(f"{c['op']} {c['tensor_bytes']} B" for c in calls) or "nothing"
        if len(tokens) != 2 or (phase == "backward" and small) or len(tokens) + len(small) != len(calls):
            return (f"{phase} moved {moved}; expected two all-to-alls of the kept rows ({kept} rows x "
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
    check(jobs, "divisible", divisible_problem, [2, 3, 4])


@pytest.mark.points(2)
def test_subgroups_equal_single_process(jobs):
    """4 ranks as groups {0, 2} and {1, 3}, each with its own experts and tokens (capacity; skewed routing with
    capacity): each rank equals its group's single-process layer, what dispatch delivered and the accounting too."""
    check(jobs, "subgroups", subgroup_problem, [4])


@pytest.mark.points(1)
def test_subgroups_communicate_inside_their_group(jobs):
    """4 ranks as groups {0, 2} and {1, 3}: every collective, forward and backward, runs on the rank's own group."""
    check(jobs, "subgroups", inside_group_problem, [4], only_cases_that_ran=True)  # crashes: the test above
