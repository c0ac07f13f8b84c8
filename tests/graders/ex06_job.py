"""The grading job of ex06 (tensor-parallel layers): every case for this job's world size, in one launch.

    ex06_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex06_tensor_parallel.py launches it on 1, 2 and 4 ranks. Every rank builds the same dense layers and
inputs from a fixed seed, loads them into the submission's layers (`from_dense`), runs forward and backward,
and compares this rank's outputs and gradients with the matching slices of the dense ones. Each rank logs
one record per case (jobkit.record_writer, in runtime.log's format):

    {"case": "column-bias-gather", "group": "column", "error": None,
     "mismatches": ["weight.grad differs from rows 4:8 of the dense weight's gradient by 0.31 ..."]}

Cases: column (gather_output False/True, with and without bias), row (input_is_parallel True/False, with and
without bias), row-bias-once (zero weights: the output must be the bias, once), mlp (ParallelMLP vs
nn.Sequential(fc1, GELU, fc2)), mlp-collectives (every collective started during one forward and during its
backward), divisible-* (a size the group does not divide: ValueError naming both sizes; 2 and 4 ranks), and
groups (4 ranks only: two tensor-parallel groups of 2, each with its own input).

The submission runs under a guard that records every collective it starts, through any layer (comm_recorder;
it refuses nothing), with what it prints capped and a watchdog per case: a deadlock costs the cases it breaks.
"""
import argparse
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
TOLERANCE = 1e-5  # float32; the reference differs from dense by ~1e-7 (the order of the sums)
BATCH, SEQ, HIDDEN, FFN = 2, 3, 8, 16  # small, divisible by 1, 2 and 4


# --- the guard: every collective the submission starts, by phase ------------------------------------
class Guard(jobkit.Guard):
    """Every collective and point-to-point call the submission starts (comm_recorder: any layer), stamped with
    the phase it ran in. `calls` is kept across watches (forward, then backward); the job empties it itself."""

    def __init__(self, comm):
        super().__init__(comm)
        self.phase = "forward"
        self.calls: list[dict] = []  # {"phase", "op", "bytes"}
        comm.on_event = self._noted

    def _noted(self, event: dict) -> None:
        if event["kind"] != "wait":
            self.calls.append({"phase": self.phase, "op": event["op"], "bytes": event["bytes"]})

    def watching(self, phase: str = "forward"):
        """Run the submission: record its collectives under `phase`, cap what it prints."""
        self.phase = phase
        return super().watching()


def one_line(err: BaseException) -> str:
    return jobkit.one_line(err, SUBMISSION[0])


# --- comparing with the dense layers -----------------------------------------------------------------
def compare(label: str, got, want: torch.Tensor, hint: str) -> str | None:
    """None when got equals want (within TOLERANCE), else one line saying how it differs and what to try."""
    if got is None:
        return f"{label} is None (expected a tensor of shape {tuple(want.shape)}): {hint}"
    if not isinstance(got, torch.Tensor):
        return f"{label} is a {type(got).__name__}, not a tensor"
    if got.shape != want.shape:
        return f"{label} has shape {tuple(got.shape)}, expected {tuple(want.shape)}: {hint}"
    diff = (got.detach().double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    if not diff <= TOLERANCE:  # NaN is wrong too
        return f"{label} differs from the dense layer's by {diff:.2g} (tolerance {TOLERANCE:g}): {hint}"
    return None


def mismatches(pairs) -> list[str]:
    return [why for why in (compare(*p) for p in pairs) if why]


def dense_linear(seed: int, in_f: int, out_f: int, bias: bool) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


def inputs(seed: int, features: int) -> torch.Tensor:
    """x of shape (batch, sequence, features), the same on every rank of the job."""
    return torch.randn(BATCH, SEQ, features, generator=torch.Generator().manual_seed(seed))


def upstream(seed: int, shape) -> torch.Tensor:
    """The gradient fed into backward, the same on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1000))


def rows(n: int, rank: int, total: int) -> slice:
    per = total // n
    return slice(rank * per, (rank + 1) * per)


# --- the cases ---------------------------------------------------------------------------------------
def case_column(sub, guard, ctx, bias: bool, gather: bool, seed: int = 11):
    n, rank = ctx["n"], ctx["rank"]
    dense = dense_linear(seed, HIDDEN, FFN, bias)
    x = inputs(seed, HIDDEN)
    gy = upstream(seed, (BATCH, SEQ, FFN))
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    yd.backward(gy)
    mine = rows(n, rank, FFN)
    xs = x.clone().requires_grad_()
    with guard.watching("forward"):
        layer = sub.ColumnParallelLinear.from_dense(dense, gather_output=gather, group=ctx["group"])
        y = layer(xs)
    with guard.watching("backward"):
        # gather_output=False: this rank's slice of Y gets its slice of the upstream gradient
        y.backward(gy if gather else gy[..., mine])
    want = yd if gather else yd[..., mine]
    part = "" if gather else f"[..., {mine.start}:{mine.stop}]"
    pairs = [("the output", y, want, f"expected dense(x){part}" + ("; all-gather the slices in rank order"
                                                                    if gather else ", this rank's output features")),
             ("x.grad", xs.grad, xd.grad, "in backward, all-reduce (sum) the partial input gradients (f)"),
             ("weight.grad", getattr(layer.weight, "grad", None), dense.weight.grad[mine],
              f"expected rows {mine.start}:{mine.stop} of the dense weight's gradient")]
    if bias:
        pairs.append(("bias.grad", getattr(getattr(layer, "bias", None), "grad", None), dense.bias.grad[mine],
                      f"expected elements {mine.start}:{mine.stop} of the dense bias's gradient"))
    elif getattr(layer, "bias", None) is not None:
        return {"mismatches": ["bias=False but the layer has a bias"]}
    return {"mismatches": mismatches(pairs)}


def case_row(sub, guard, ctx, bias: bool, parallel_input: bool, seed: int = 21):
    n, rank = ctx["n"], ctx["rank"]
    dense = dense_linear(seed, FFN, HIDDEN, bias)
    x = inputs(seed, FFN)
    gy = upstream(seed, (BATCH, SEQ, HIDDEN))
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    yd.backward(gy)
    mine = rows(n, rank, FFN)
    xs = (x[..., mine] if parallel_input else x).clone().requires_grad_()
    with guard.watching("forward"):
        layer = sub.RowParallelLinear.from_dense(dense, input_is_parallel=parallel_input, group=ctx["group"])
        y = layer(xs)
    with guard.watching("backward"):
        y.backward(gy)
    pairs = [("the output", y, yd, "expected dense(x) on every rank: all-reduce (sum) the partial products, "
                                   "then add the bias once"),
             ("x.grad", xs.grad, xd.grad[..., mine] if parallel_input else xd.grad,
              f"expected the dense input gradient's features {mine.start}:{mine.stop}" if parallel_input else
              "expected the full dense input gradient: all-gather the slices' gradients in backward"),
             ("weight.grad", getattr(layer.weight, "grad", None), dense.weight.grad[:, mine],
              f"expected columns {mine.start}:{mine.stop} of the dense weight's gradient")]
    if bias:
        pairs.append(("bias.grad", getattr(getattr(layer, "bias", None), "grad", None), dense.bias.grad,
                      "expected the whole dense bias's gradient (the bias is not split)"))
    elif getattr(layer, "bias", None) is not None:
        return {"mismatches": ["bias=False but the layer has a bias"]}
    return {"mismatches": mismatches(pairs)}


def case_bias_once(sub, guard, ctx):
    """Zero weights and a known bias: the output must be the bias, not world size × bias."""
    dense = nn.Linear(FFN, HIDDEN)
    with torch.no_grad():
        dense.weight.zero_()
        dense.bias.copy_(torch.arange(1.0, HIDDEN + 1))
    x = torch.randn(BATCH, SEQ, FFN // ctx["n"], generator=torch.Generator().manual_seed(5))
    with guard.watching("forward"):
        y = sub.RowParallelLinear.from_dense(dense, input_is_parallel=True, group=ctx["group"])(x)
    want = dense.bias.detach().expand(BATCH, SEQ, HIDDEN)
    if isinstance(y, torch.Tensor) and y.shape == want.shape and ctx["n"] > 1 \
            and torch.allclose(y, want * ctx["n"]):
        return {"mismatches": [f"with zero weights the output is {ctx['n']} × the bias: the bias was added on every "
                               f"rank before the all-reduce; add it once, after the reduction"]}
    return {"mismatches": mismatches([("the output", y, want, "with zero weights it must equal the bias, "
                                                              "added once after the reduction")])}


def mlp_setup(seed: int):
    torch.manual_seed(seed)
    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    x = inputs(seed, HIDDEN)
    return fc1, fc2, x, upstream(seed, (BATCH, SEQ, HIDDEN))


def run_mlp(sub, guard, ctx, seed: int):
    n, rank = ctx["n"], ctx["rank"]
    fc1, fc2, x, gy = mlp_setup(seed)
    xd = x.clone().requires_grad_()
    yd = fc2(nn.functional.gelu(fc1(xd)))
    yd.backward(gy)
    mine = rows(n, rank, FFN)
    xs = x.clone().requires_grad_()
    with guard.watching("setup"):
        mlp = sub.ParallelMLP.from_dense(fc1, fc2, group=ctx["group"])
    guard.calls = []
    with guard.watching("forward"):
        y = mlp(xs)
    with guard.watching("backward"):
        y.backward(gy)
    pairs = [("the output", y, yd, "expected fc2(gelu(fc1(x))) on every rank"),
             ("x.grad", xs.grad, xd.grad, "all-reduce the input gradient in backward (f before fc1)"),
             ("fc1.weight.grad", getattr(mlp.fc1.weight, "grad", None), fc1.weight.grad[mine],
              f"expected rows {mine.start}:{mine.stop} of fc1's weight gradient"),
             ("fc1.bias.grad", getattr(mlp.fc1.bias, "grad", None), fc1.bias.grad[mine],
              f"expected elements {mine.start}:{mine.stop} of fc1's bias gradient"),
             ("fc2.weight.grad", getattr(mlp.fc2.weight, "grad", None), fc2.weight.grad[:, mine],
              f"expected columns {mine.start}:{mine.stop} of fc2's weight gradient"),
             ("fc2.bias.grad", getattr(mlp.fc2.bias, "grad", None), fc2.bias.grad,
              "expected fc2's whole bias gradient")]
    return {"mismatches": mismatches(pairs), "calls": list(guard.calls),
            "activation_bytes": x.numel() * x.element_size(), "n": n}


def case_mlp(sub, guard, ctx):
    return run_mlp(sub, guard, ctx, seed=31)


def case_groups(sub, guard, ctx):
    """Two tensor-parallel groups of 2 on 4 ranks, each group with its own input and weights."""
    return run_mlp(sub, guard, ctx, seed=41 + ctx["group_index"])


def case_divisible(sub, guard, ctx, which: str):
    n = ctx["n"]
    bad = 2 * n + 1  # never divisible by n >= 2
    build = {"column": lambda: sub.ColumnParallelLinear(HIDDEN, bad, group=ctx["group"]),
             "row": lambda: sub.RowParallelLinear(bad, HIDDEN, group=ctx["group"]),
             "mlp": lambda: sub.ParallelMLP(HIDDEN, bad, group=ctx["group"])}[which]
    call = {"column": f"ColumnParallelLinear({HIDDEN}, {bad})", "row": f"RowParallelLinear({bad}, {HIDDEN})",
            "mlp": f"ParallelMLP({HIDDEN}, {bad})"}[which]
    try:
        with guard.watching("setup"):
            build()
    except ValueError as err:
        text = str(err)
        named = all(re.search(rf"(?<!\d){v}(?!\d)", text) for v in (bad, n))
        return {"mismatches": [] if named else
                [f"{call} on {n} ranks raised ValueError({text[:150]!r}): name both sizes ({bad} and {n})"]}
    except Exception as err:  # noqa: BLE001 - the wrong exception is the learner's bug
        return {"mismatches": [f"{call} on {n} ranks raised {one_line(err)}, not ValueError"]}
    return {"mismatches": [f"{call} on {n} ranks was created: {bad} is not divisible by {n}; raise ValueError"]}


def plan(world: int, rank: int, halves) -> list[tuple[str, str, object]]:
    """(case, group, function of (submission, guard)) in the order they run. Each case gets its ctx: the whole
    world, or (groups, 4 ranks) this rank's tensor-parallel group of 2 among `halves`."""
    ctx = {"group": None, "n": world, "rank": rank}
    p = functools.partial
    cases = []
    for bias in (True, False):
        for gather in (False, True):
            cases.append((f"column-{'bias' if bias else 'nobias'}-{'gather' if gather else 'split'}", "column",
                          p(case_column, ctx=ctx, bias=bias, gather=gather)))
    for bias in (True, False):
        for par in (True, False):
            cases.append((f"row-{'bias' if bias else 'nobias'}-{'parallel' if par else 'full'}-input", "row",
                          p(case_row, ctx=ctx, bias=bias, parallel_input=par)))
    cases.append(("row-bias-once", "bias-once", p(case_bias_once, ctx=ctx)))
    cases.append(("mlp", "mlp", p(case_mlp, ctx=ctx)))
    if world > 1:
        for which in ("column", "row", "mlp"):
            cases.append((f"divisible-{which}", "divisible", p(case_divisible, ctx=ctx, which=which)))
    if world == 4:
        half = rank // 2
        cases.append(("groups", "groups", p(case_groups, ctx={"group": halves[half], "n": 2, "rank": rank % 2,
                                                              "group_index": half})))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--case-limit", type=float, default=20.0)
    args = parser.parse_args()
    SUBMISSION[0] = os.path.abspath(args.submission)
    rt = runtime.setup(seed=0)
    world = rt.world_size
    # Every rank takes part in creating every group (torch.distributed's rule), before the guard is on.
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None
    log = jobkit.record_writer()  # before the submission is imported: see record_writer
    guard, watchdog = Guard(comm_recorder.install()), jobkit.Watchdog(
        "a deadlock (a collective that the other ranks never matched), an endless loop, or far too slow", log)
    cases = plan(world, rt.rank, halves)
    log(case="plan", cases={case: group for case, group, _ in cases}, world_size=world)

    sub = jobkit.import_or_exit(args.submission, "ex06", ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP"),
                                lambda: guard.watching("import"), watchdog, args.case_limit, log)
    # A barrier after each case: a rank that failed before a collective must not meet its peers' next one.
    jobkit.run_cases(cases, (sub, guard), watchdog, args.case_limit, args.submission, log,
                     between=guard.dist.barrier)
    runtime.teardown()


if __name__ == "__main__":
    main()
