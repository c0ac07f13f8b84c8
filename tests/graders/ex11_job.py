"""The grading job of ex11 (expert-parallel dispatch and combine): every case for this job's world size, in one launch.

    ex11_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex11_expert_parallel.py launches it on 1, 2, 3 and 4 ranks. Every rank builds the same E experts (small
MLPs) and every rank's tokens, routing and upstream gradient from fixed seeds, and runs the single-process
reference: the MoE layer on each rank's tokens (that rank's capacity), every rank's loss summed, so the
experts' gradients hold every rank's contribution. Then it runs the submission: dispatch its own tokens,
its local experts on what arrived, combine, weight and sum, backward. Each rank logs one record per case:

    {"case": "balanced", "group": "balanced", "error": None, "mismatches": [...], "dispatch": [...],
     "accounting": [...], "calls": [{"phase": "forward", "op": "all_to_all_single", "tensor_bytes": [...]}],
     "row_bytes": 32, "kept": 24, "received": 24}

Cases, in this order (the uneven ones last: a submission that never exchanges the counts aborts gloo there, and
a rank that aborts ends the job):
  balanced   every expert gets the same number of rows from every rank (sends and receives are even); token
             order shuffled. Outputs, gradients (tokens, routing weights, local experts' weights), what
             dispatch delivered (rows and local expert ids, in the stated order), and the collectives.
  capacity   every expert is chosen twice as often as its capacity from every rank: half the assignments are
             dropped, and what is kept is still even. Outputs, gradients, kept / dropped / tokens_per_expert.
  divisible  (2-4 ranks) num_experts = 2N+1: ValueError naming both sizes, before anything is sent.
  uneven, uneven-capacity   skewed routing (some experts chosen by many tokens, some by none): the splits
             differ per rank pair. Outputs and gradients.

The submission runs under the guard that records every collective it starts, through any layer (comm_recorder),
with what it prints capped and a watchdog per case.
"""
import argparse
import copy
import functools
import os
import re

import torch
import torch.distributed as dist
from torch import nn

import comm_recorder  # beside this script: what a submission communicates
import jobkit  # beside this script: what every grading job shares
from gpucourse import runtime

SUBMISSION = [""]
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
        if event["kind"] != "wait":
            self.calls.append({"phase": self.phase, "op": event["op"], "kind": event["kind"],
                               "tensor_bytes": event["tensor_bytes"]})

    def watching(self, phase: str = "forward"):
        self.phase = phase
        return super().watching()


def one_line(err: BaseException) -> str:
    return jobkit.one_line(err, SUBMISSION[0])


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


def run_case(sub, guard, ctx, kind: str, seed: int):
    """The single-process reference and the submission on the same weights and routing; every check's finding."""
    n, rank, group = ctx["n"], ctx["rank"], ctx["group"]
    per = NUM_EXPERTS // n
    experts = make_experts()
    batches = [routing(kind, s, seed) for s in range(n)]
    ref = reference(experts, batches)
    mine = batches[rank]
    local = copy.deepcopy(experts)  # every rank builds all; it uses (and is graded on) its own E/N only
    local.zero_grad(set_to_none=True)
    x, w = mine["x"].clone().requires_grad_(), mine["w"].clone().requires_grad_()
    guard.calls = []
    with guard.watching("forward"):
        local_tokens, local_ids, state = sub.dispatch(x, mine["ids"].clone(), NUM_EXPERTS, mine["capacity"],
                                                      group=group)
    arrived = (local_tokens.detach().clone() if isinstance(local_tokens, torch.Tensor) else local_tokens,
               local_ids.clone() if isinstance(local_ids, torch.Tensor) else local_ids)
    expert_out = run_local_experts(local, local_tokens, local_ids, rank * per)
    with guard.watching("forward"):
        out = sub.combine(expert_out, state, group=group)
    if not isinstance(out, torch.Tensor) or out.shape != (x.shape[0], TOP_K, HIDDEN):
        raise TypeError(f"combine must return a tensor of shape ({x.shape[0]}, {TOP_K}, {HIDDEN}), got "
                        f"{getattr(out, 'shape', type(out).__name__)}")
    y = (out * w[..., None]).sum(1)
    with guard.watching("backward"):
        y.backward(mine["gy"])
    r = ref[rank]
    pairs = [("the output", y, r["y"], "expected sum_j w[t, j] * expert_{ids[t, j]}(x[t]) over the kept "
                                       "assignments: combine must put each row back at its (token, choice)"),
             ("tokens.grad", x.grad, r["x"].grad, "in backward, each row's gradient must go back to its source rank "
                                                  "and token (AllToAll's backward: the splits swapped)"),
             ("weights.grad", w.grad, r["w"].grad, "each expert output must come back to its own (token, choice)")]
    for e in range(rank * per, (rank + 1) * per):
        for name, p in local[e].named_parameters():
            want = dict(experts[e].named_parameters())[name].grad
            want = torch.zeros_like(p) if want is None else want  # an expert nobody chose: no gradient
            got = torch.zeros_like(p) if p.grad is None and not want.any() else p.grad
            pairs.append((f"expert {e}'s {name}.grad", got, want, "the expert saw other rows than the "
                                                                  "single-process layer sends it (from every rank)"))
    mismatches = [why for why in (compare(*p) for p in pairs) if why]
    want_rows, want_ids = expected_arrivals(batches, [o["kept"] for o in ref], rank, n)
    dispatch = [why for why in (
        compare("local_tokens", arrived[0], want_rows, "rows by source rank, then local expert, then token order"),
        compare("local_expert_ids", arrived[1], want_ids, "the LOCAL index (0 ... E/N-1) of each row's expert")) if why]
    accounting = []
    kept = getattr(state, "kept", None)
    if not isinstance(kept, torch.Tensor) or kept.shape != r["kept"].shape or not torch.equal(kept.bool(), r["kept"]):
        accounting.append(f"state.kept is not the (T, k) mask of kept assignments: "
                          f"{int((~r['kept']).sum())} of {r['kept'].numel()} are over capacity (row-major order)")
    dropped = getattr(state, "dropped", None)
    if isinstance(dropped, torch.Tensor):
        dropped = dropped.item() if dropped.numel() == 1 else dropped
    if dropped != int((~r["kept"]).sum()):
        accounting.append(f"state.dropped is {dropped!r}; this rank dropped {int((~r['kept']).sum())} assignments")
    tpe = getattr(state, "tokens_per_expert", None)
    want_tpe = torch.bincount(mine["ids"].reshape(-1), minlength=NUM_EXPERTS)
    if not isinstance(tpe, torch.Tensor) or tpe.shape != want_tpe.shape or not torch.equal(tpe.long(), want_tpe):
        accounting.append(f"state.tokens_per_expert is {tpe!r}; expected this rank's assignments per expert "
                          f"before the capacity: {want_tpe.tolist()}")
    received = want_rows.shape[0]
    return {"mismatches": mismatches, "dispatch": dispatch, "accounting": accounting, "calls": list(guard.calls),
            "row_bytes": HIDDEN * 4, "kept": int(r["kept"].sum()), "received": received, "n": n,
            "tokens": mine["x"].shape[0], "num_experts": NUM_EXPERTS}


def case_divisible(sub, guard, ctx):
    n = ctx["n"]
    bad = 2 * n + 1
    x = torch.randn(4, HIDDEN)
    ids = torch.zeros(4, TOP_K, dtype=torch.long)
    ids[:, 1] = 1
    guard.calls = []
    try:
        with guard.watching("forward"):
            sub.dispatch(x, ids, bad, None, group=ctx["group"])
    except ValueError as err:
        text = str(err)
        named = all(re.search(rf"(?<!\d){v}(?!\d)", text) for v in (bad, n))
        sent = [c["op"] for c in guard.calls]
        problems = ([] if named else [f"dispatch(num_experts={bad}) on {n} ranks raised ValueError({text[:150]!r}): "
                                      f"name both sizes ({bad} and {n})"])
        if sent:
            problems.append(f"dispatch(num_experts={bad}) started {', '.join(sent)} before raising: check first")
        return {"mismatches": problems}
    except Exception as err:  # noqa: BLE001 - the wrong exception is the learner's bug
        return {"mismatches": [f"dispatch(num_experts={bad}) on {n} ranks raised {one_line(err)}, not ValueError"]}
    return {"mismatches": [f"dispatch(num_experts={bad}) on {n} ranks ran: {bad} experts cannot be split evenly "
                           f"over {n} ranks; raise ValueError"]}


def plan(world: int, rank: int) -> list[tuple[str, str, object]]:
    ctx = {"group": None, "n": world, "rank": rank}
    p = functools.partial
    cases = [("balanced", "balanced", p(run_case, ctx=ctx, kind="balanced", seed=1)),
             ("capacity", "capacity", p(run_case, ctx=ctx, kind="capacity", seed=2))]
    if world > 1:
        cases.append(("divisible", "divisible", p(case_divisible, ctx=ctx)))
    cases += [("uneven", "uneven", p(run_case, ctx=ctx, kind="uneven", seed=3)),
              ("uneven-capacity", "uneven", p(run_case, ctx=ctx, kind="uneven-capacity", seed=4))]
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
        "a deadlock (an all-to-all whose split sizes the ranks disagree on, or a collective the others never "
        "matched), an endless loop, or far too slow", log)
    cases = plan(rt.world_size, rt.rank)
    log(case="plan", cases={case: group for case, group, _ in cases}, world_size=rt.world_size)
    sub = jobkit.import_or_exit(args.submission, "ex11", ("dispatch", "combine"),
                                lambda: guard.watching("import"), watchdog, args.case_limit, log)
    jobkit.run_cases(cases, (sub, guard), watchdog, args.case_limit, args.submission, log,
                     between=guard.dist.barrier)
    runtime.teardown()


if __name__ == "__main__":
    main()
