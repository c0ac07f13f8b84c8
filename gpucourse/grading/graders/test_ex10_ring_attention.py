"""Grader of ex10: ring attention over a sequence split across ranks (run it with `gpucourse grade ex10`).

One real job per world size (1, 2, 3 and 4 ranks, through gpucourse.launch; ex10_job.py), side by side. Every
rank shards the same full q, k, v with the submission's shard_sequence, runs ring_attention forward and backward
on its shard, and saves raw what came out (output, gradients, where its rows sit in the sequence). The tests
below compare that, here in the grader process, with F.scaled_dot_product_attention on the whole sequence
(float64), recomputed from the job's own seeds; the layout is judged from every rank's shard of the positions.
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
  ValueError naming the sizes;
- group= (4 ranks as two context-parallel groups of 2, non-contiguous: {0, 2} and {1, 3}, each on its own
  sequence): every rank's output and gradients equal SDPA's on its GROUP's sequence, and every call it made ran
  on its own group, with peers in that group (the recorder places each call: the process group it ran on, as
  global ranks, and each send's and receive's global peer).
"""
import functools
from pathlib import Path

import pytest
import torch

from gpucourse import costs

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex10_job.py")
CASES = job_module(JOB)  # its plan, inputs and comparison: SDPA on the whole sequence is computed here
WORLD_SIZES = (1, 2, 3, 4)
CASE_LIMIT_S = 30  # a case takes seconds (4 jobs, 10 ranks side by side); the limit catches deadlocks
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: JobRecords}: the four jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex10-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- the layout, from every rank's raw shard of the positions --------------------------------------------------
def layout(job: JobRecords) -> dict[int, dict]:
    """{rank: {"partition": why not a partition or None, "positions", "work"}}, over every rank of the job: each
    position must be on exactly one rank's shard; a rank's causal work is its (query, key) pairs."""
    world = job.world
    seq = 2 * world * CASES.CHUNK
    found, counts = {}, torch.zeros(seq, dtype=torch.float64)
    for rec in job.ranks("layout"):
        shard = None if rec.get("error") else raw(rec).get("shard")
        mine, partition = None, None
        if not isinstance(shard, torch.Tensor) or shard.shape != (1, 1, seq // world, 2):
            what = tuple(shard.shape) if isinstance(shard, torch.Tensor) else rec.get("returned", "nothing")
            partition = (f"shard_sequence returned {what} for a [1, 1, {seq}, 2] tensor on {world} ranks; "
                         f"expected shape (1, 1, {seq // world}, 2)")
        else:
            mine = shard[0, 0, :, 0].double()
            if bool((mine == mine.round()).all() and (mine >= 0).all() and (mine < seq).all()):
                counts.index_add_(0, mine.long(), torch.ones_like(mine))
        found[rec["rank"]] = {"partition": partition, "mine": mine}
    if not bool((counts == 1).all()):
        bad = int((counts != 1).nonzero()[0])
        for f in found.values():
            f["partition"] = f["partition"] or (
                f"position {bad} of the sequence is on {int(counts[bad])} ranks' shards: shard_sequence must "
                f"give every position to exactly one rank")
    for f in found.values():
        f["work"] = int((f["mine"] + 1).sum()) if f["partition"] is None else None  # query p sees keys 0..p
        f["positions"] = f["mine"].long().tolist() if f["mine"] is not None else None
    return found


def layout_problem(jobs, rec, balanced: bool = False) -> str | None:
    job = next(j for j in jobs.values() if j.result.run_dir == rec["run_dir"])
    ranks = layout(job)
    mine = ranks[rec["rank"]]
    if mine["partition"] or not balanced:
        return mine["partition"]
    works = [r["work"] for r in ranks.values()]
    if max(works) != min(works):
        return (f"with a causal mask the ranks' work ranges from {min(works)} to {max(works)} (query, key) pairs "
                f"(this rank: {mine['work']}, positions {mine['positions']}): pair an early chunk with a late "
                f"one (zig-zag: chunks r and 2N-1-r)")
    return None


# --- attention: the rank's raw output and gradients against SDPA's rows at its shard's positions -----------------
def attention(rec) -> dict:
    """{"output": why the output is wrong or None, "gradients": why the output or a gradient is wrong or None}."""
    case, got = rec["case"], raw(rec)
    params = CASES.case_params(case)
    if params["group"] == "subgroups":  # the rank's group, from the job's plan and the rank's (grader's) number
        subgroup = CASES.subgroup_of(rec["rank"])[0]
        world = len(CASES.SUBGROUPS[subgroup])
    else:
        subgroup, world = None, rec["world"]
    want = CASES.expected(world, case, subgroup)
    shape = (CASES.BATCH, CASES.HEADS, want[0].shape[2] // world, CASES.HEAD_DIM)
    positions = got["positions"]
    if (not isinstance(positions, torch.Tensor) or positions.shape != shape
            or not bool((positions == positions.round()).all() and (positions >= 0).all()
                        and (positions < want[0].shape[2]).all())):
        what = tuple(positions.shape) if isinstance(positions, torch.Tensor) else "no tensor"
        why = (f"shard_sequence of a {tuple(want[0].shape)} tensor gave {what} on {world} rank(s), not this rank's "
               f"rows of the sequence, shape {shape}")
        return {"output": why, "gradients": why}
    mine = [t.gather(2, positions.long()) for t in want]  # SDPA's rows at this rank's positions
    tol, dtype = CASES.tolerance(case), params["dtype"]
    hint = CASES.OUTPUT_HINT + (CASES.CAUSAL_HINT if params["causal"] else "")
    output = CASES.compare("the output", got["out"], mine[0], tol, dtype, hint, kind=rec.get("returned"))
    if not rec.get("requires_grad"):
        return {"output": output, "gradients": output or "the output does not require grad: ring_attention must "
                                                          "support backward"}
    gradients = next((why for why in (CASES.compare(label, got[name], w, tol, dtype, CASES.GRADIENT_HINT)
                                      for (label, name), w in zip(CASES.GRADIENTS, mine[1:])) if why), None)
    return {"output": output, "gradients": output or gradients}


# --- what makes one rank's record of a case wrong (None when it is right) -----------------------------------------
def output_problem(rec) -> str | None:
    return attention(rec)["output"]


def gradient_problem(rec) -> str | None:
    return attention(rec)["gradients"]


def p2p_problem(rec) -> str | None:
    for phase in ("forward", "backward"):
        used = rec.get(phase, {}).get("collectives", [])
        if used:
            return (f"{phase} called {', '.join(used)}: ring attention passes K/V shards with point-to-point "
                    f"calls only (isend/irecv, batch_isend_irecv); a collective lets a rank hold the whole "
                    f"sequence's K or V")
    return None


@functools.lru_cache(maxsize=None)
def shard_bytes(case: str, world: int) -> int:
    """The bytes of one rank's shard of q (k's and v's are as large) in `case` on `world` ranks: the job's whole q,
    from its own inputs, over `world`. The limits scale with it, never with a size the rank reports (that of its
    own shard_sequence's shard, which a wrong layout makes larger)."""
    c = CASES.attention_cases()[case]
    q = CASES.full_inputs(world, c["seed"], c["dtype"], c.get("scale", 1.0))[0]
    return q.numel() * q.element_size() // world


def bytes_problem(rec) -> str | None:
    n = rec["world"]
    shard = shard_bytes(rec["case"], n)
    kv = 2 * shard
    limits = {phase: costs.context_parallel_bytes("ring", shard, n, backward=phase == "backward")
              for phase in ("forward", "backward")}
    formulas = {"forward": "(N-1) × kv", "backward": "(N-1) × kv for K/V + N × kv for dK/dV (0 on one rank)"}
    for phase, limit in limits.items():
        if phase not in rec:
            return f"no {phase} ran: {gradient_problem(rec)}"
        sent = rec[phase]["sent"]
        if sent > limit:
            return (f"{phase} sent {sent} bytes on {n} rank(s); the ring sends {formulas[phase]} = {limit} "
                    f"(kv = the K and V shards, {kv} bytes): a hop more than the ring needs")
    return None


def saved_problem(rec) -> str | None:
    saved, shard = rec["saved_bytes"], shard_bytes(rec["case"], rec["world"])
    if saved is None:
        return output_problem(rec) or "the forward returned no tensor"
    if saved > shard:
        return (f"the forward left {saved} bytes alive for backward besides q, k, v and the output "
                f"({saved / shard:.1f} shards of {shard} bytes; allowed: one, e.g. the log-sum-exp): keep only "
                f"this rank's tensors and pass K/V around the ring again in backward")
    return None


SUBGROUP_HINT = ("with group=..., take the group's size and rank (dist.get_world_size(group), dist.get_rank(group)), "
                 "send to GLOBAL ranks (dist.get_process_group_ranks(group)) and pass group= to every call")


def subgroup_problem(rec) -> str | None:
    why = gradient_problem(rec)
    group = CASES.SUBGROUPS[CASES.subgroup_of(rec["rank"])[0]]
    return why and f"in the group of ranks {list(group)}: {why} ({SUBGROUP_HINT})"


def inside_group_problem(rec) -> str | None:
    """Every call of forward and backward ran on the rank's own group, and its peers are the group's other ranks."""
    group = list(CASES.SUBGROUPS[CASES.subgroup_of(rec["rank"])[0]])
    for phase in ("forward", "backward"):
        if phase not in rec:
            return f"no {phase} ran: {gradient_problem(rec)}"
        if "placed" not in rec[phase]:
            return f"{phase}: the job recorded no process group for the calls it saw"
        for op, groups, peers in rec[phase]["placed"]:
            outside = [g for g in groups or [None] if g != group]
            if outside:
                where = "a process group the grader cannot place" if None in outside else f"ranks {outside[0]}"
                return (f"{phase}: {op} ran on {where}, not on this rank's group {group}: {SUBGROUP_HINT}")
            strays = [p for p in peers if p not in group or p == rec["rank"]]
            if strays:
                peer = "a peer the grader cannot place" if strays[0] is None else f"peer {strays[0]} (global rank)"
                return f"{phase}: {op} named {peer}, not another rank of this rank's group {group}: {SUBGROUP_HINT}"
    return None


def bad_input_problem(rec) -> str | None:
    return CASES.bad_input_problem(rec["case"].removeprefix("bad-"), rec["world"], rec)


# --- the tests ----------------------------------------------------------------------------------------------------
@pytest.mark.points(1)
def test_shard_sequence_partitions_the_sequence(jobs):
    """shard_sequence of the positions 0..seq-1: every position on exactly one rank's shard, in every world size."""
    check(jobs, "layout", lambda rec: layout_problem(jobs, rec))


@pytest.mark.points(1)
def test_causal_work_is_balanced(jobs):
    """2-4 ranks: every rank's queries see as many causal (query, key) pairs as every other's (zig-zag)."""
    check(jobs, "layout", lambda rec: layout_problem(jobs, rec, balanced=True), [2, 3, 4])


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
    check(jobs, "bad-input", bad_input_problem)


@pytest.mark.points(2)
def test_subgroups_equal_sdpa(jobs):
    """4 ranks as groups {0, 2} and {1, 3}, each on its own sequence (causal float32, full float64): every rank's
    output and gradients equal SDPA's on its group's sequence."""
    check(jobs, "subgroups", subgroup_problem, [4])


@pytest.mark.points(1)
def test_subgroups_communicate_inside_their_group(jobs):
    """4 ranks as groups {0, 2} and {1, 3}: every call, forward and backward, runs on the rank's own group, with
    peers among its ranks (the recorder's process group and global peer of each call)."""
    check(jobs, "subgroups", inside_group_problem, [4], only_cases_that_ran=True)  # crashes: the test above
