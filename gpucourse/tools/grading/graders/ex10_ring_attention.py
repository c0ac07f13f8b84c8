"""Grader of ex10: ring attention over a sequence split across ranks (run it with `gpucourse grade ex10`).

One real job per world size (1, 2, 3 and 4 ranks, side by side) runs the submission on every rank's shard of one
sequence (how: below); the tests compare what the ranks saved, here in the grader process, with
F.scaled_dot_product_attention on the whole sequence (float64), and judge the layout from every rank's shard of
the positions. What is checked:
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

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex10 (ring attention): every
case for this job's world size, in one launch.

    ex10_ring_attention.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it on 1, 2, 3 and 4 ranks. Every rank builds the same full q, k, v and
upstream gradient from a fixed seed (`full_inputs`), takes its shard of everything with the submission's
`shard_sequence`, runs `ring_attention` forward and backward on its shard, and saves raw what came out: the
output, the q/k/v gradients and where its shard's rows sit in the sequence (`shard_sequence` of the positions).
The rank judges nothing: the grader process computes F.scaled_dot_product_attention on the whole sequence in
float64 from the same seed (`expected`), takes the rows at those positions and compares (`compare`). Each rank
logs one record per case (jobkit.record_writer, in runtime.log's format):

    {"case": "causal-float32", "group": "causal", "error": None, "raw": ["k_grad", "out", "positions", ...],
     "returned": "Tensor", "requires_grad": True, "forward": {"collectives": [], "sent": 1536},
     "backward": {...}, "saved_bytes": 5120, "shard_bytes": 1024, ...}

Cases (`plan`): layout (shard_sequence of the positions 0..seq-1, saved raw: the grader checks every position is
on exactly one rank and counts each rank's causal (query, key) pairs), attention cases (causal or not, float32
or float64, normal or large scores), bad-input cases (each rank on its own: what it raised, and its message),
and, on 4 ranks only and last (a submission that talks outside its group can deadlock, and a watchdog then ends
the rank), the subgroup cases: two context-parallel groups of 2 with non-contiguous ranks, {0, 2} and {1, 3}
(`SUBGROUPS`), each on its own sequence (its own seed); every rank shards with its GROUP rank and group size and
calls ring_attention(..., group=its group). The grader compares each rank with SDPA on its group's sequence, and
reads from the recorder which process groups (as global ranks) and which peers every call used.

The submission runs under a guard that records every collective and point-to-point call and the bytes sent
(comm_recorder, any layer), and notes every tensor of a quarter shard or more that the forward creates
(jobkit.Allocations) to see what is still alive for backward (the two float32 cases); what it prints is capped
and a watchdog ends a case that deadlocks.
"""
import functools
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from gpucourse.models import costs
from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
BATCH, HEADS, CHUNK, HEAD_DIM = 2, 2, 4, 8  # seq = 2 · world · CHUNK: seq_local = 2 · CHUNK = HEAD_DIM
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10}
LARGE_TOLERANCE = 2e-3  # large scores in float32: a rounding of s (|s| ~ 500) moves a probability by ~1e-4
LARGE_SCALE = 60.0  # q times this: scores reach several hundred, and exp(89) is already inf in float32
OUTPUT_HINT = "merge the blocks' partial results with the log-sum-exp rule"
CAUSAL_HINT = "; mask by GLOBAL chunk (skip future blocks)"
GRADIENT_HINT = ("pass K/V around the ring again in backward, with their accumulated gradients, N hops so each dK/dV "
                 "gets home")
GRADIENTS = (("q.grad", "q_grad"), ("k.grad", "k_grad"), ("v.grad", "v_grad"))  # (what a learner reads, raw name)


# --- the guard ---------------------------------------------------------------------------------------------------
class Guard(jobkit.Guard):
    """What the submission communicates while watched: collectives and point-to-point calls by name, bytes sent."""

    def summary(self) -> dict:
        events = [e for e in self.comm.events if e["kind"] != "wait"]
        return {"collectives": sorted({e["op"] for e in events if e["kind"] == "collective"}),
                "p2p": sorted({e["op"] for e in events if e["kind"] == "p2p"}),
                "sent": self.comm.sent_bytes,
                # where each call went: [op, the groups it ran on (global ranks; None: unplaced), its peers]
                "placed": [[e["op"], e["groups"], e["peers"]] for e in events]}


# --- the plan: every case's parameters, the same in the ranks and in the grader process ---------------------------
def attention_cases() -> dict[str, dict]:
    """{case: its parameters} of the attention cases, in the order they run."""
    cases = {}
    for causal in (False, True):
        name = "causal" if causal else "full"
        cases[f"{name}-float32"] = dict(group=name, causal=causal, dtype=torch.float32, seed=1, memory=True)
        cases[f"{name}-float64"] = dict(group="float64", causal=causal, dtype=torch.float64, seed=2)
        cases[f"{name}-large-scores"] = dict(group="large", causal=causal, dtype=torch.float32, scale=LARGE_SCALE,
                                             seed=3)
    return cases


BAD_INPUTS = ("shapes", "odd", "shard")

# On 4 ranks: two context-parallel groups of 2 with non-contiguous ranks, each on its own sequence.
SUBGROUPS = ((0, 2), (1, 3))
SUBGROUP_WORLD = 4  # the job's world size that runs them
SUBGROUP_SEED = 100  # group g's seed: the case's seed + SUBGROUP_SEED · (g + 1): every group its own problem


def subgroup_cases() -> dict[str, dict]:
    """{case: its parameters} of the subgroup cases (4 ranks only), in the order they run."""
    return {"subgroups-causal": dict(group="subgroups", causal=True, dtype=torch.float32, seed=4),
            "subgroups-float64": dict(group="subgroups", causal=False, dtype=torch.float64, seed=5)}


def subgroup_of(rank: int) -> tuple[int, int]:
    """(which of SUBGROUPS a global rank is in, its rank in that group)."""
    index = next(i for i, ranks in enumerate(SUBGROUPS) if rank in ranks)
    return index, SUBGROUPS[index].index(rank)


def case_params(case: str) -> dict:
    return {**attention_cases(), **subgroup_cases()}[case]


# --- inputs and the reference (the grader process computes the reference, never a rank) ----------------------------
def full_inputs(world: int, seed: int, dtype, scale: float = 1.0):
    """q, k, v and the upstream gradient over the whole sequence, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, 2 * world * CHUNK, HEAD_DIM)
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    return (q * scale).to(dtype), k.to(dtype), v.to(dtype), grad.to(dtype)


def positions_like(x: torch.Tensor) -> torch.Tensor:
    """A tensor of x's shape holding each element's position in the sequence (dim 2), in float64 (exact)."""
    seq = x.shape[2]
    return torch.arange(seq, dtype=torch.float64).view(1, 1, seq, 1).expand(*x.shape).contiguous()


def reference(q, k, v, grad, causal: bool):
    """SDPA on the whole sequence in float64: output and q/k/v gradients."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    out.backward(grad.double())
    return out.detach(), *(t.grad for t in leaves)


def case_seed(case: str, subgroup: int | None = None) -> int:
    """The seed of `case`'s inputs; in the subgroup cases, each group's own."""
    seed = case_params(case)["seed"]
    return seed if subgroup is None else seed + SUBGROUP_SEED * (subgroup + 1)


@functools.lru_cache(maxsize=32)
def expected(world: int, case: str, subgroup: int | None = None) -> tuple[torch.Tensor, ...]:
    """(output, q.grad, k.grad, v.grad) of SDPA on the whole sequence of `case` on `world` ranks (for a subgroup
    case: on that group's ranks, from its own seed), in float64: computed in the grader process from the case's
    seed (tests must not modify them: cached)."""
    c = case_params(case)
    q, k, v, grad = full_inputs(world, case_seed(case, subgroup), c["dtype"], c.get("scale", 1.0))
    return reference(q, k, v, grad, c["causal"])


def tolerance(case: str) -> float:
    c = case_params(case)
    return LARGE_TOLERANCE if "scale" in c else TOLERANCE[c["dtype"]]


def compare(label: str, got, want: torch.Tensor, tol: float, dtype, hint: str, kind: str | None = None) -> str | None:
    """Why `got` (of type `kind`, when it was not saved) is not `want` within tol, or None."""
    if not isinstance(got, torch.Tensor):
        return f"{label} is {kind or type(got).__name__}, not a tensor of shape {tuple(want.shape)}: {hint}"
    if got.shape != want.shape:
        return f"{label} has shape {tuple(got.shape)}, expected {tuple(want.shape)} (this rank's shard)"
    if got.dtype != dtype:
        return f"{label} is {got.dtype}, expected {dtype} (the input's dtype)"
    diff = (got.detach().double() - want).abs().max().item() if want.numel() else 0.0
    if not diff <= tol:  # NaN and inf are wrong too
        return f"{label} differs from SDPA's on the whole sequence by {diff:.3g} (tolerance {tol:g}): {hint}"
    return None


def bad_input(which: str, world: int) -> tuple[str, list[str]]:
    """(what the bad-input case calls, in words; the sizes its ValueError must name)."""
    local = 2 * CHUNK
    if which == "shapes":
        return f"ring_attention with q of seq_local {local} and k, v of {local + 2}", [str(local), str(local + 2)]
    if which == "odd":
        return "ring_attention with seq_local=5 (the zig-zag layout needs two equal chunks)", ["5"]
    seq = 2 * world * CHUNK + 1  # odd: never a multiple of 2 · world
    return f"shard_sequence of a sequence of {seq} on {world} rank(s) ({2 * world} chunks)", [str(seq), str(2 * world)]


def bad_input_problem(which: str, world: int, rec: dict) -> str | None:
    """What is wrong with how a rank's bad-input case ended (its record's raised/message), or None."""
    what, needles = bad_input(which, world)
    if rec["raised"] is None:
        return f"{what} returned; raise ValueError saying what is wrong"
    if not rec["value_error"]:
        return f"{what} raised {rec['message']}, not ValueError"
    text = rec["message"]
    if not all(re.search(rf"(?<!\d){n}(?!\d)", text) for n in needles):
        return f"{what} raised ValueError({text[:150]!r}); name the sizes ({', '.join(needles)})"
    return None


# --- the cases (run in the ranks: they save what the submission produced, and judge nothing) ---------------------
def case_layout(sub, guard, world: int, rank: int) -> dict:
    """shard_sequence of a [1, 1, seq, 2] tensor of the positions 0..seq-1, saved raw."""
    x = positions_like(torch.empty(1, 1, 2 * world * CHUNK, 2))
    with guard.watching():
        shard = sub.shard_sequence(x, rank, world)
    return {"returned": type(shard).__name__, "raw": {"shard": shard if isinstance(shard, torch.Tensor) else None}}


def case_attention(sub, guard, world: int, rank: int, case: str, group=None, subgroup: int | None = None) -> dict:
    """One attention case on this rank's shard: world and rank are the context-parallel group's (the whole job's,
    or in a subgroup case, `group`'s, which is passed on to ring_attention)."""
    c = case_params(case)
    q, k, v, grad = full_inputs(world, case_seed(case, subgroup), c["dtype"], c.get("scale", 1.0))
    with guard.watching():  # the layout is the submission's own; the layout case checks it
        mine = [sub.shard_sequence(t, rank, world) for t in (q, k, v, grad)]
        positions = sub.shard_sequence(positions_like(q), rank, world)  # where its rows sit: the grader's reference
    leaves = [t.detach().clone().requires_grad_() for t in mine[:3]]
    shard_bytes = leaves[0].numel() * leaves[0].element_size()
    allocs = jobkit.Allocations(min_numel=leaves[0].numel() // 4)  # a quarter shard: a chunk of K or V counts
    with guard.watching(), allocs:
        out = sub.ring_attention(*leaves, causal=c["causal"], **({} if group is None else {"group": group}))
    is_tensor = isinstance(out, torch.Tensor)
    saved = None  # what the forward left alive for backward, besides q, k, v and the output
    if c.get("memory") and is_tensor:
        saved = allocs.alive_bytes(exclude=[out] + leaves, within=shard_bytes)
    record = {"forward": guard.summary(), "saved_bytes": saved, "shard_bytes": shard_bytes, "world": world,
              "element_size": leaves[0].element_size(), "returned": type(out).__name__,
              "requires_grad": is_tensor and out.requires_grad}
    if record["requires_grad"]:
        with guard.watching():
            out.backward(mine[3])
        record["backward"] = guard.summary()
    record["raw"] = {"positions": positions if isinstance(positions, torch.Tensor) else None,
                     "out": out if is_tensor else None,
                     **{name: t.grad for (_, name), t in zip(GRADIENTS, leaves)}}
    return record


def case_bad_input(sub, guard, world: int, rank: int, which: str) -> dict:
    """Each rank on its own, before any communication: what the call raised (type and message), if anything."""
    local = 2 * CHUNK
    if which == "shapes":
        q = torch.randn(BATCH, HEADS, local, HEAD_DIM)
        k = torch.randn(BATCH, HEADS, local + 2, HEAD_DIM)
        call = lambda: sub.ring_attention(q, k, k.clone())  # noqa: E731
    elif which == "odd":
        q = torch.randn(BATCH, HEADS, 5, HEAD_DIM)
        call = lambda: sub.ring_attention(q, q.clone(), q.clone())  # noqa: E731
    else:
        x = torch.randn(1, 1, 2 * world * CHUNK + 1, 4)
        call = lambda: sub.shard_sequence(x, rank, world)  # noqa: E731
    try:
        with guard.watching():
            call()
    except Exception as err:  # noqa: BLE001 - the wrong exception is the learner's bug; the grader says so
        return {"world": world, "raised": type(err).__name__, "value_error": isinstance(err, ValueError),
                "message": str(err)[:300] if isinstance(err, ValueError) else jobkit.one_line(err, guard.submission)}
    return {"world": world, "raised": None, "value_error": False, "message": ""}


def plan(world: int) -> list[tuple[str, str, object, dict]]:
    """(case, group, function, its parameters) in the order they run on `world` ranks; a function takes
    (submission, guard, world=, rank=, **parameters), the subgroup cases (4 ranks, last) also group= and subgroup=."""
    cases = [("layout", "layout", case_layout, {})]
    cases += [(case, c["group"], case_attention, {"case": case}) for case, c in attention_cases().items()]
    cases += [(f"bad-{which}", "bad-input", case_bad_input, {"which": which}) for which in BAD_INPUTS]
    if world == SUBGROUP_WORLD:
        cases += [(case, c["group"], case_attention, {"case": case}) for case, c in subgroup_cases().items()]
    return cases


class Ex10Job(jobkit.GradingJob):
    """ex10's grading job: every case of one world size."""

    name, wanted = "ex10", ("ring_attention", "shard_sequence")
    case_limit = 20.0
    barrier_between_cases = True  # a rank that failed before a send must not meet its peers' next case
    reason = "a deadlock (a receive that no rank's send matches), an endless loop, or far too slow"

    def make_guard(self, comm) -> Guard:
        guard = Guard(comm)
        guard.submission = self.submission  # tracebacks are reported at the submission's own lines
        return guard

    def prepare(self) -> None:
        """What loads lazily on first use (autograd's backward, the dispatch mode, gc over the process), before any
        case's clock; on 4 ranks, the two subgroups (every rank takes part in creating every group, torch's rule)."""
        world = self.ctx.world_size
        self.subgroups = [dist.new_group(list(ranks)) for ranks in SUBGROUPS] if world == SUBGROUP_WORLD else None
        warm = jobkit.Allocations()
        with warm:
            x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
            (x @ x.T).softmax(-1).sum().backward()
        warm.alive_bytes()

    def plan(self) -> list[tuple]:
        at = {"world": self.ctx.world_size, "rank": self.ctx.rank}
        cases = []
        for case, group, fn, params in plan(self.ctx.world_size):
            if group == "subgroups":  # this rank's group: its size, its rank in it, the group itself
                index, group_rank = subgroup_of(self.ctx.rank)
                own = {"world": len(SUBGROUPS[index]), "rank": group_rank, "group": self.subgroups[index],
                       "subgroup": index}
                cases.append((case, group, functools.partial(fn, **own, **params)))
            else:
                cases.append((case, group, functools.partial(fn, **at, **params)))
        return cases


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
WORLD_SIZES = (1, 2, 3, 4)
CASE_LIMIT_S = 20  # a case takes at most seconds (4 jobs, 10 ranks side by side, a loaded machine); deadlocks hit it
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
    seq = 2 * world * CHUNK
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
    params = case_params(case)
    if params["group"] == "subgroups":  # the rank's group, from the job's plan and the rank's (grader's) number
        subgroup = subgroup_of(rec["rank"])[0]
        world = len(SUBGROUPS[subgroup])
    else:
        subgroup, world = None, rec["world"]
    want = expected(world, case, subgroup)
    shape = (BATCH, HEADS, want[0].shape[2] // world, HEAD_DIM)
    positions = got["positions"]
    if (not isinstance(positions, torch.Tensor) or positions.shape != shape
            or not bool((positions == positions.round()).all() and (positions >= 0).all()
                        and (positions < want[0].shape[2]).all())):
        what = tuple(positions.shape) if isinstance(positions, torch.Tensor) else "no tensor"
        why = (f"shard_sequence of a {tuple(want[0].shape)} tensor gave {what} on {world} rank(s), not this rank's "
               f"rows of the sequence, shape {shape}")
        return {"output": why, "gradients": why}
    mine = [t.gather(2, positions.long()) for t in want]  # SDPA's rows at this rank's positions
    tol, dtype = tolerance(case), params["dtype"]
    hint = OUTPUT_HINT + (CAUSAL_HINT if params["causal"] else "")
    output = compare("the output", got["out"], mine[0], tol, dtype, hint, kind=rec.get("returned"))
    if not rec.get("requires_grad"):
        return {"output": output, "gradients": output or "the output does not require grad: ring_attention must "
                                                          "support backward"}
    gradients = next((why for why in (compare(label, got[name], w, tol, dtype, GRADIENT_HINT)
                                      for (label, name), w in zip(GRADIENTS, mine[1:])) if why), None)
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
    c = attention_cases()[case]
    q = full_inputs(world, c["seed"], c["dtype"], c.get("scale", 1.0))[0]
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
    group = SUBGROUPS[subgroup_of(rec["rank"])[0]]
    return why and f"in the group of ranks {list(group)}: {why} ({SUBGROUP_HINT})"


def inside_group_problem(rec) -> str | None:
    """Every call of forward and backward ran on the rank's own group, and its peers are the group's other ranks."""
    group = list(SUBGROUPS[subgroup_of(rec["rank"])[0]])
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


def bad_input_verdict(rec) -> str | None:
    return bad_input_problem(rec["case"].removeprefix("bad-"), rec["world"], rec)


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
    check(jobs, "bad-input", bad_input_verdict)


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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex10Job)
