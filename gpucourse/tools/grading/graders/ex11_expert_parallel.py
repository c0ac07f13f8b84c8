"""Grader of ex11: expert-parallel dispatch and combine of a mixture-of-experts layer (`gpucourse grade ex11`).

One real job per world size (1, 2, 3 and 4 ranks, through gpucourse.launch; ex11_expert_parallel.py), side by side. Every
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
  match gpucourse.models.costs.expert_parallel_all_to_all_bytes;
- num_experts the group does not divide raises ValueError naming both sizes;
- group= (4 ranks as two expert-parallel groups of 2, non-contiguous: {0, 2} and {1, 3}, each with its own experts
  and tokens): every rank equals the single-process layer of its GROUP (outputs, gradients, what dispatch
  delivered, kept / dropped / tokens_per_expert), and every collective it started ran on its own group (the
  recorder places each call: the process group it ran on, as global ranks).

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex11 (expert-parallel
dispatch and combine): every case for this job's world size, in one launch.

    ex11_expert_parallel.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it on 1, 2, 3 and 4 ranks. Every rank builds the same E experts (small
MLPs) and its own tokens, routing and upstream gradient from fixed seeds (`make_experts`, `routing`), then runs
the submission: dispatch its own tokens, its local experts on what arrived, combine, weight and sum, backward.
The rank judges nothing: it saves raw what came out (what dispatch delivered, the output, the gradients of the
tokens, of the routing weights and of its local experts' weights, the state's accounting) and the collectives
it recorded. The grader process runs the single-process reference (`expected`: the MoE layer on each rank's
tokens, that rank's capacity, every rank's loss summed, so the experts' gradients hold every rank's
contribution) and compares (`compare`). Each rank logs one record per case:

    {"case": "balanced", "group": "balanced", "error": None, "raw": ["arrived_ids", "arrived_tokens", ...],
     "calls": [{"phase": "forward", "op": "all_to_all_single", "tensor_bytes": [...]}], "n": 2, ...}

Cases (`plan`), in this order (the ones with uneven splits last: a submission that never exchanges the counts
aborts gloo there, and a rank that aborts ends the job):
  balanced   every expert gets the same number of rows from every rank (sends and receives are even); token
             order shuffled. Outputs, gradients (tokens, routing weights, local experts' weights), what
             dispatch delivered (rows and local expert ids, in the stated order), and the collectives.
  capacity   every expert is chosen twice as often as its capacity from every rank: half the assignments are
             dropped, and what is kept is still even. Outputs, gradients, kept / dropped / tokens_per_expert.
  divisible  (2-4 ranks) num_experts = 2N+1: what dispatch raised (a ValueError naming both sizes, before
             anything is sent).
  subgroups-capacity, subgroups-uneven   (4 ranks only) two expert-parallel groups of 2 with non-contiguous
             ranks, {0, 2} and {1, 3} (`SUBGROUPS`), each with its own experts and tokens (its own seeds; routed as
             capacity, then as uneven-capacity), dispatch/combine called with group=its group. Outputs, gradients,
             what dispatch delivered, the accounting, and the process group (as global ranks) each collective ran on.
  uneven, uneven-capacity   skewed routing (some experts chosen by many tokens, some by none): the splits
             differ per rank pair. Outputs and gradients.

The submission runs under the guard that records every collective it starts, through any layer (comm_recorder),
with what it prints capped and a watchdog per case.
"""
import functools
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpucourse.models import costs
from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
TOLERANCE = 1e-5  # float32; sums over experts and ranks in another order differ by ~1e-7
HIDDEN, FFN, NUM_EXPERTS, TOP_K = 8, 16, 12, 2  # 12 experts: divisible by 1, 2, 3 and 4 ranks


class Guard(jobkit.Guard):
    """Every collective the submission starts (comm_recorder: any layer), stamped with the phase it ran in."""

    def __init__(self, comm):
        super().__init__(comm)
        self.phase = "forward"
        self.calls: list[dict] = []  # {"phase", "op", "kind", "tensor_bytes"}
        comm.on_event = self._noted

    def _noted(self, event: dict) -> None:
        if event["kind"] != "wait":  # "groups": the recorder's own list, filled in while the call runs
            self.calls.append({"phase": self.phase, "op": event["op"], "kind": event["kind"],
                               "tensor_bytes": event["tensor_bytes"], "groups": event["groups"]})

    def watching(self, phase: str = "forward"):
        self.phase = phase
        return super().watching()


# --- the layer's pieces: experts, routing, the single-process reference -----------------------------
def make_experts(seed: int = 7) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
                         for _ in range(NUM_EXPERTS))


def routing(kind: str, source: int, seed: int) -> dict:
    """One rank's tokens (T, H), expert_ids (T, k), routing weights (T, k), upstream gradient (T, H), capacity."""
    g = torch.Generator().manual_seed(1000 * seed + source)
    if kind in ("balanced", "capacity"):
        # each expert exactly `per` times (choices 2p and 2p+1 of a shuffled p): even sends, even receives
        per = 2 if kind == "balanced" else 4
        tokens = per * NUM_EXPERTS // TOP_K
        p = torch.randperm(tokens, generator=g)
        ids = torch.stack([(2 * p) % NUM_EXPERTS, (2 * p + 1) % NUM_EXPERTS], dim=1)
        capacity = None if kind == "balanced" else 2
    else:
        tokens = 20
        skew = torch.zeros(NUM_EXPERTS)
        skew[torch.randperm(NUM_EXPERTS, generator=g)[:3]] = 3.0  # three favourites per rank, others rare
        ids = (torch.randn(tokens, NUM_EXPERTS, generator=g) + skew).topk(TOP_K, dim=1).indices
        capacity = None if kind == "uneven" else 4
    return {"x": torch.randn(tokens, HIDDEN, generator=g), "ids": ids,
            "w": torch.rand(tokens, TOP_K, generator=g) + 0.1, "gy": torch.randn(tokens, HIDDEN, generator=g),
            "capacity": capacity}


def reference_kept(ids: torch.Tensor, capacity) -> torch.Tensor:
    """(T, k) bool: row-major, an expert keeps its first `capacity` assignments."""
    seen, kept = [0] * NUM_EXPERTS, torch.zeros(ids.shape, dtype=torch.bool)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            kept[t, j] = capacity is None or seen[e] < capacity
            seen[e] += 1
    return kept


def reference(experts: nn.ModuleList, batches: list[dict]) -> list[dict]:
    """The MoE layer in one process, on each rank's batch: outputs, and gradients of one summed loss."""
    out = []
    for b in batches:
        x, w = b["x"].clone().requires_grad_(), b["w"].clone().requires_grad_()
        kept = reference_kept(b["ids"], b["capacity"])
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(TOP_K):
                if kept[t, j]:
                    y[t] = y[t] + w[t, j] * experts[int(b["ids"][t, j])](x[t])
        out.append({"y": y, "x": x, "w": w, "kept": kept})
    sum((o["y"] * b["gy"]).sum() for o, b in zip(out, batches)).backward()
    return out


def expected_arrivals(batches, kept, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What dispatch must deliver to `rank`: rows by source rank, then local expert, then row-major order."""
    per = NUM_EXPERTS // n
    rows, local = [], []
    for s, b in enumerate(batches):
        for e in range(per):
            for t in range(b["ids"].shape[0]):
                for j in range(TOP_K):
                    if kept[s][t, j] and int(b["ids"][t, j]) == rank * per + e:
                        rows.append(b["x"][t])
                        local.append(e)
    empty = torch.zeros(0, HIDDEN)
    return (torch.stack(rows) if rows else empty), torch.tensor(local, dtype=torch.long)


# --- comparing ---------------------------------------------------------------------------------------
def compare(label: str, got, want: torch.Tensor, hint: str, tol: float = TOLERANCE) -> str | None:
    if got is None:
        return f"{label} is None (expected a tensor of shape {tuple(want.shape)}): {hint}"
    if not isinstance(got, torch.Tensor):
        return f"{label} is a {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"{label} has shape {tuple(got.shape)}, expected {tuple(want.shape)}: {hint}"
    diff = (got.detach().double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    if not diff <= tol:
        return f"{label} differs from the single-process layer's by {diff:.2g} (tolerance {tol:g}): {hint}"
    return None


def run_local_experts(experts, local_tokens, local_ids, first: int) -> torch.Tensor:
    """Each received row through its local expert (global index first + local id), in place of the row."""
    if not isinstance(local_tokens, torch.Tensor) or local_tokens.dim() != 2 or local_tokens.shape[1] != HIDDEN:
        raise TypeError(f"dispatch's local_tokens must be a tensor of shape (M, {HIDDEN}), got "
                        f"{getattr(local_tokens, 'shape', type(local_tokens).__name__)}")
    if not isinstance(local_ids, torch.Tensor) or local_ids.shape != local_tokens.shape[:1]:
        raise TypeError(f"dispatch's local_expert_ids must be a tensor of shape ({local_tokens.shape[0]},), got "
                        f"{getattr(local_ids, 'shape', type(local_ids).__name__)}")
    out = torch.zeros_like(local_tokens)
    for e in local_ids.unique().tolist():
        idx = (local_ids == e).nonzero().squeeze(1)
        out = out.index_copy(0, idx, experts[first + int(e)](local_tokens[idx]))
    return out


def plain(value):
    """A state field as the rank saves it raw: a tensor, a number, None, or its repr (anything else)."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float)):
        return value
    return repr(value)[:80]


def run_case(sub, guard, ctx, kind: str, seed: int, experts_seed: int = 7):
    """The submission on this rank's tokens with its local experts: what it produced, saved raw. ctx: the
    expert-parallel group (None: every rank), its size n and this rank's rank in it."""
    n, rank, group = ctx["n"], ctx["rank"], ctx["group"]
    per = NUM_EXPERTS // n
    mine = routing(kind, rank, seed)
    local = make_experts(experts_seed)  # every rank builds all; it uses (and is graded on) its own E/N only
    local.zero_grad(set_to_none=True)
    x, w = mine["x"].clone().requires_grad_(), mine["w"].clone().requires_grad_()
    guard.calls = []
    with guard.watching("forward"):
        local_tokens, local_ids, state = sub.dispatch(x, mine["ids"].clone(), NUM_EXPERTS, mine["capacity"],
                                                      group=group)
    arrived = {"arrived_tokens": local_tokens.detach().clone() if isinstance(local_tokens, torch.Tensor) else None,
               "arrived_ids": local_ids.clone() if isinstance(local_ids, torch.Tensor) else None}
    accounting = {f"state_{name}": plain(getattr(state, name, None))
                  for name in ("kept", "dropped", "tokens_per_expert")}
    expert_out = run_local_experts(local, local_tokens, local_ids, rank * per)
    with guard.watching("forward"):
        out = sub.combine(expert_out, state, group=group)
    if not isinstance(out, torch.Tensor) or out.shape != (x.shape[0], TOP_K, HIDDEN):
        raise TypeError(f"combine must return a tensor of shape ({x.shape[0]}, {TOP_K}, {HIDDEN}), got "
                        f"{getattr(out, 'shape', type(out).__name__)}")
    y = (out * w[..., None]).sum(1)
    with guard.watching("backward"):
        y.backward(mine["gy"])
    experts = {f"expert{e}/{name}": p.grad for e in range(rank * per, (rank + 1) * per)
               for name, p in local[e].named_parameters()}
    return {"calls": list(guard.calls), "n": n,
            "raw": {"y": y, "x_grad": x.grad, "w_grad": w.grad, **arrived, **accounting, **experts}}


def case_divisible(sub, guard, ctx):
    """dispatch with num_experts = 2N+1 on N ranks: what it raised, and what it started before."""
    n = ctx["n"]
    x = torch.randn(4, HIDDEN)
    ids = torch.zeros(4, TOP_K, dtype=torch.long)
    ids[:, 1] = 1
    guard.calls = []
    try:
        with guard.watching("forward"):
            sub.dispatch(x, ids, 2 * n + 1, None, group=ctx["group"])
    except Exception as err:  # noqa: BLE001 - the wrong exception is the learner's bug; the grader says so
        return {"n": n, "raised": type(err).__name__, "value_error": isinstance(err, ValueError),
                "message": str(err)[:300] if isinstance(err, ValueError) else jobkit.one_line(err, guard.submission),
                "sent": [c["op"] for c in guard.calls]}
    return {"n": n, "raised": None, "value_error": False, "message": "", "sent": [c["op"] for c in guard.calls]}


def divisible_problems(rec) -> list[str]:
    """What is wrong with how dispatch(num_experts=2N+1) ended on a rank (its record), [] if nothing."""
    n = rec["n"]
    bad = 2 * n + 1
    if rec["raised"] is None:
        return [f"dispatch(num_experts={bad}) on {n} ranks ran: {bad} experts cannot be split evenly "
                f"over {n} ranks; raise ValueError"]
    if not rec["value_error"]:
        return [f"dispatch(num_experts={bad}) on {n} ranks raised {rec['message']}, not ValueError"]
    text = rec["message"]
    named = all(re.search(rf"(?<!\d){v}(?!\d)", text) for v in (bad, n))
    problems = ([] if named else [f"dispatch(num_experts={bad}) on {n} ranks raised ValueError({text[:150]!r}): "
                                  f"name both sizes ({bad} and {n})"])
    if rec["sent"]:
        problems.append(f"dispatch(num_experts={bad}) started {', '.join(rec['sent'])} before raising: check first")
    return problems


# --- the plan, the same in the ranks and in the grader process --------------------------------------------------
ROUTED = {"balanced": ("balanced", 1), "capacity": ("capacity", 2), "uneven": ("uneven", 3),
          "uneven-capacity": ("uneven", 4), "subgroups-capacity": ("subgroups", 5),
          "subgroups-uneven": ("subgroups", 6)}  # case: (group, seed)
KIND = {"subgroups-capacity": "capacity", "subgroups-uneven": "uneven-capacity"}  # else the case's name is its kind
# On 4 ranks: two expert-parallel groups of 2 with non-contiguous ranks, each with its own experts and tokens.
SUBGROUPS = ((0, 2), (1, 3))
SUBGROUP_WORLD = 4  # the job's world size that runs them
SUBGROUP_SEED = 100  # group g's seeds: routing seed + SUBGROUP_SEED · (g + 1), experts' seed 7 + g + 1


def subgroup_of(rank: int) -> tuple[int, int]:
    """(which of SUBGROUPS a global rank is in, its rank in that group)."""
    index = next(i for i, ranks in enumerate(SUBGROUPS) if rank in ranks)
    return index, SUBGROUPS[index].index(rank)


def seeds(case: str, subgroup: int | None = None) -> tuple[int, int]:
    """(routing seed, experts' seed) of `case`; in the subgroup cases, each group's own."""
    if subgroup is None:
        return ROUTED[case][1], 7
    return ROUTED[case][1] + SUBGROUP_SEED * (subgroup + 1), 7 + subgroup + 1


def plan(world: int) -> list[tuple[str, str]]:
    """(case, group) in the order they run on `world` ranks."""
    cases = [(case, ROUTED[case][0]) for case in ("balanced", "capacity")]
    if world > 1:
        cases.append(("divisible", "divisible"))
    if world == SUBGROUP_WORLD:
        cases += [(case, ROUTED[case][0]) for case in ("subgroups-capacity", "subgroups-uneven")]
    return cases + [(case, ROUTED[case][0]) for case in ("uneven", "uneven-capacity")]


@functools.lru_cache(maxsize=None)  # every (case, n, subgroup) of the plan: a smaller cache was refilled per submission
def expected(case: str, n: int, subgroup: int | None = None) -> list[dict]:
    """What each of the n ranks (of the whole job, or of one subgroup) must produce in `case`: the single-process
    layer on every rank's tokens, in the grader process (tests must not modify it: cached). Per rank: y, x_grad,
    w_grad, kept, tokens_per_expert, the arrived rows and local ids, and {parameter's raw name: gradient} of its
    own experts."""
    seed, experts_seed = seeds(case, subgroup)
    experts = make_experts(experts_seed)
    batches = [routing(KIND.get(case, case), s, seed) for s in range(n)]
    ref = reference(experts, batches)
    per = NUM_EXPERTS // n
    out = []
    for rank, (r, b) in enumerate(zip(ref, batches)):
        rows, ids = expected_arrivals(batches, [o["kept"] for o in ref], rank, n)
        grads = {}
        for e in range(rank * per, (rank + 1) * per):
            for name, p in experts[e].named_parameters():  # an expert nobody chose: no gradient, zeros
                grads[f"expert{e}/{name}"] = torch.zeros_like(p) if p.grad is None else p.grad.detach()
        out.append({"y": r["y"].detach(), "x_grad": r["x"].grad, "w_grad": r["w"].grad, "kept": r["kept"],
                    "tokens_per_expert": torch.bincount(b["ids"].reshape(-1), minlength=NUM_EXPERTS),
                    "arrived_tokens": rows, "arrived_ids": ids, "experts": grads, "tokens": b["x"].shape[0]})
    return out


class Ex11Job(jobkit.GradingJob):
    """ex11's grading job: every case of one world size."""

    name, wanted = "ex11", ("dispatch", "combine")
    case_limit = 20.0
    barrier_between_cases = True  # a rank that failed before a collective must not meet its peers' next case
    reason = ("a deadlock (an all-to-all whose split sizes the ranks disagree on, or a collective the others never "
              "matched), an endless loop, or far too slow")

    def make_guard(self, comm) -> Guard:
        guard = Guard(comm)
        guard.submission = self.submission  # tracebacks are reported at the submission's own lines
        return guard

    def prepare(self) -> None:
        # Every rank takes part in creating every group (torch.distributed's rule), before the guard is on.
        world = self.ctx.world_size
        self.subgroups = [dist.new_group(list(ranks)) for ranks in SUBGROUPS] if world == SUBGROUP_WORLD else None

    def watching(self):
        return self.guard.watching("import")

    def plan(self) -> list[tuple]:
        everyone = {"group": None, "n": self.ctx.world_size, "rank": self.ctx.rank}
        cases = []
        for case, group in plan(self.ctx.world_size):
            if case == "divisible":
                cases.append((case, group, functools.partial(case_divisible, ctx=everyone)))
                continue
            subgroup, ctx = None, everyone
            if group == "subgroups":  # this rank's group: the group itself, its size, this rank's rank in it
                subgroup, group_rank = subgroup_of(self.ctx.rank)
                ctx = {"group": self.subgroups[subgroup], "n": len(SUBGROUPS[subgroup]), "rank": group_rank}
            seed, experts_seed = seeds(case, subgroup)
            cases.append((case, group, functools.partial(run_case, ctx=ctx, kind=KIND.get(case, case), seed=seed,
                                                         experts_seed=experts_seed)))
        return cases


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
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
    if ROUTED[rec["case"]][0] == "subgroups":
        subgroup, group_rank = subgroup_of(rec["rank"])
        return expected(rec["case"], len(SUBGROUPS[subgroup]), subgroup)[group_rank]
    return expected(rec["case"], rec["n"])[rec["rank"]]


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
    mismatches = [why for why in (compare(*p) for p in pairs) if why]
    dispatch = [why for why in (
        compare("local_tokens", got["arrived_tokens"], want["arrived_tokens"],
                      "rows by source rank, then local expert, then token order"),
        compare("local_expert_ids", got["arrived_ids"], want["arrived_ids"],
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
    group = list(SUBGROUPS[subgroup_of(rec["rank"])[0]])
    return why and f"in the group of ranks {group}: {why} ({SUBGROUP_HINT})"


def inside_group_problem(rec) -> str | None:
    """Every collective of forward and backward ran on the rank's own group (the recorder's global ranks)."""
    group = list(SUBGROUPS[subgroup_of(rec["rank"])[0]])
    for call in rec["calls"]:
        outside = [g for g in call.get("groups") or [None] if g != group]
        if outside:
            where = "a process group the grader cannot place" if None in outside else f"ranks {outside[0]}"
            return f"{call['phase']}: {call['op']} ran on {where}, not on this rank's group {group}: {SUBGROUP_HINT}"
    return None


def divisible_problem(rec) -> str | None:
    return (divisible_problems(rec) or [None])[0]


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
    n, row = rec["world"], HIDDEN * 4  # the job's world size (JobRecords'), float32 rows
    want = expected(rec["case"], n)[rec["rank"]]  # the single-process layer: which rows are kept, arrive
    tokens, kept, received = want["tokens"], int(want["kept"].sum()), want["arrived_tokens"].shape[0]
    formula = costs.expert_parallel_all_to_all_bytes(tokens, 2, row // 4, n, bytes_per_value=4,
                                                     kept_fraction=kept / (2 * tokens))
    sent, received = kept * row, received * row  # the buffers, this rank's own rows included
    for phase in ("forward", "backward"):
        calls = calls_of(rec, phase)
        tokens = [c for c in calls if sorted(c["tensor_bytes"]) == sorted([sent, received])]
        small = [c for c in calls if c not in tokens and max(c["tensor_bytes"] or [0]) <= 8 * NUM_EXPERTS]
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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex11Job)
