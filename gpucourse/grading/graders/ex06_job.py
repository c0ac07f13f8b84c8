"""The grading job of ex06 (tensor-parallel layers): every case for this job's world size, in one launch.

    ex06_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex06_tensor_parallel.py launches it on 1, 2 and 4 ranks. Every rank builds the same dense layers and
inputs from a fixed seed (`dense_linear`, `inputs`, `upstream`, `mlp_setup`), loads them into the submission's
layers (`from_dense`), runs forward and backward, and saves what the submission produced, raw: the output, the
input's gradient and the shards' gradients, keyed by what they are. The rank judges nothing; the grader process
recomputes the dense layers' values from the same seeds (`expected`) and compares (`compare`). Each rank logs
one record per case (jobkit.record_writer, in runtime.log's format):

    {"case": "column-bias-gather", "group": "column", "error": None, "has_bias": True,
     "raw": ["bias.grad", "the output", "weight.grad", "x.grad"]}

Cases (`specs`): column (gather_output False/True, with and without bias), row (input_is_parallel True/False,
with and without bias), row-bias-once (zero weights: the output must be the bias, once), mlp (ParallelMLP vs
nn.Sequential(fc1, GELU, fc2); also every collective started during one forward and during its backward),
divisible-* (a size the group does not divide: which exception, and its message; 2 and 4 ranks), and groups
(4 ranks only: two tensor-parallel groups of 2, each with its own input and weights).

The submission runs under a guard that records every collective it starts, through any layer (comm_recorder;
it refuses nothing), with what it prints capped and a watchdog per case: a deadlock costs the cases it breaks.
"""
import functools

import torch
import torch.distributed as dist
from torch import nn

from gpucourse.grading import jobkit  # what every grading job shares

TOLERANCE = 1e-5  # float32; the reference differs from dense by ~1e-7 (the order of the sums)
BATCH, SEQ, HIDDEN, FFN = 2, 3, 8, 16  # small, divisible by 1, 2 and 4
ACTIVATION_BYTES = BATCH * SEQ * HIDDEN * 4  # one float32 activation of the MLP: what its all_reduces move


# --- the guard: every collective the submission starts, by phase ------------------------------------
class Guard(jobkit.Guard):
    """Every collective and point-to-point call the submission starts (comm_recorder: any layer), stamped with
    the phase it ran in. `calls` is kept across watches (forward, then backward); the job empties it itself."""

    def __init__(self, comm, submission: str):
        super().__init__(comm)
        self.submission = submission  # tracebacks are reported at the submission's own lines
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

    def one_line(self, err: BaseException) -> str:
        return jobkit.one_line(err, self.submission)


# --- the cases' inputs: the same on every rank, and in the grader process ----------------------------
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


def mlp_setup(seed: int):
    torch.manual_seed(seed)
    fc1, fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
    x = inputs(seed, HIDDEN)
    return fc1, fc2, x, upstream(seed, (BATCH, SEQ, HIDDEN))


def bias_once_setup(n: int) -> tuple[nn.Linear, torch.Tensor]:
    """Zero weights and the bias 1..HIDDEN; x is one rank's slice of the input (any values do)."""
    dense = nn.Linear(FFN, HIDDEN)
    with torch.no_grad():
        dense.weight.zero_()
        dense.bias.copy_(torch.arange(1.0, HIDDEN + 1))
    return dense, torch.randn(BATCH, SEQ, FFN // n, generator=torch.Generator().manual_seed(5))


def undivisible(which: str, n: int) -> tuple[int, str]:
    """(the size n does not divide, the call that must raise ValueError, as the learner would write it)."""
    bad = 2 * n + 1  # never divisible by n >= 2
    return bad, {"column": f"ColumnParallelLinear({HIDDEN}, {bad})", "row": f"RowParallelLinear({bad}, {HIDDEN})",
                 "mlp": f"ParallelMLP({HIDDEN}, {bad})"}[which]


# --- the plan: the same list in every rank and in the grader process ---------------------------------
def specs(world: int) -> list[tuple[str, str, str, dict]]:
    """(case, group, kind, options) in the order they run on `world` ranks."""
    out = []
    for bias in (True, False):
        for gather in (False, True):
            out.append((f"column-{'bias' if bias else 'nobias'}-{'gather' if gather else 'split'}", "column",
                        "column", {"bias": bias, "gather": gather}))
    for bias in (True, False):
        for par in (True, False):
            out.append((f"row-{'bias' if bias else 'nobias'}-{'parallel' if par else 'full'}-input", "row", "row",
                        {"bias": bias, "parallel_input": par}))
    out.append(("row-bias-once", "bias-once", "bias-once", {}))
    out.append(("mlp", "mlp", "mlp", {"seed": 31}))
    if world > 1:
        out += [(f"divisible-{which}", "divisible", "divisible", {"which": which})
                for which in ("column", "row", "mlp")]
    if world == 4:
        out.append(("groups", "groups", "mlp", {"seed": 41}))  # + the group's index: each group its own MLP
    return out


def spec(world: int, case: str) -> tuple[str, dict]:
    """(kind, options) of `case` on `world` ranks."""
    for name, _, kind, options in specs(world):
        if name == case:
            return kind, options
    raise KeyError(f"ex06 plans no case {case!r} on {world} rank(s)")


def tensor_parallel(world: int, rank: int, case: str) -> tuple[int, int, int]:
    """(size of the rank's tensor-parallel group, its rank in it, the group's index) in `case`: the whole world,
    or (groups, 4 ranks) one of two groups of 2."""
    return (2, rank % 2, rank // 2) if case == "groups" else (world, rank, 0)


# --- what the dense layers give: computed in the grader process, never in a rank ---------------------
def expected(world: int, rank: int, case: str) -> list[tuple[str, torch.Tensor, str]]:
    """[(what, the dense layers' value of it, the hint if the submission's differs)] for one rank of `case`,
    in the order a learner should fix them; what names the rank's raw result it is compared with."""
    kind, opt = spec(world, case)
    n, tp_rank, group_index = tensor_parallel(world, rank, case)
    mine = rows(n, tp_rank, FFN)
    if kind == "column":
        dense, x, gy = dense_linear(11, HIDDEN, FFN, opt["bias"]), inputs(11, HIDDEN), upstream(11, (BATCH, SEQ, FFN))
        xd = x.clone().requires_grad_()
        yd = dense(xd)
        yd.backward(gy)
        part = "" if opt["gather"] else f"[..., {mine.start}:{mine.stop}]"
        pairs = [("the output", yd if opt["gather"] else yd[..., mine],
                  f"expected dense(x){part}" + ("; all-gather the slices in rank order" if opt["gather"]
                                                else ", this rank's output features")),
                 ("x.grad", xd.grad, "in backward, all-reduce (sum) the partial input gradients (f)"),
                 ("weight.grad", dense.weight.grad[mine],
                  f"expected rows {mine.start}:{mine.stop} of the dense weight's gradient")]
        if opt["bias"]:
            pairs.append(("bias.grad", dense.bias.grad[mine],
                          f"expected elements {mine.start}:{mine.stop} of the dense bias's gradient"))
        return pairs
    if kind == "row":
        dense, x, gy = dense_linear(21, FFN, HIDDEN, opt["bias"]), inputs(21, FFN), upstream(21, (BATCH, SEQ, HIDDEN))
        xd = x.clone().requires_grad_()
        yd = dense(xd)
        yd.backward(gy)
        par = opt["parallel_input"]
        pairs = [("the output", yd, "expected dense(x) on every rank: all-reduce (sum) the partial products, "
                                    "then add the bias once"),
                 ("x.grad", xd.grad[..., mine] if par else xd.grad,
                  f"expected the dense input gradient's features {mine.start}:{mine.stop}" if par else
                  "expected the full dense input gradient: all-gather the slices' gradients in backward"),
                 ("weight.grad", dense.weight.grad[:, mine],
                  f"expected columns {mine.start}:{mine.stop} of the dense weight's gradient")]
        if opt["bias"]:
            pairs.append(("bias.grad", dense.bias.grad, "expected the whole dense bias's gradient (the bias is not "
                                                        "split)"))
        return pairs
    if kind == "bias-once":
        dense, _ = bias_once_setup(n)
        return [("the output", dense.bias.detach().expand(BATCH, SEQ, HIDDEN),
                 "with zero weights it must equal the bias, added once after the reduction")]
    if kind == "mlp":
        fc1, fc2, x, gy = mlp_setup(opt["seed"] + group_index)
        xd = x.clone().requires_grad_()
        fc2(nn.functional.gelu(fc1(xd))).backward(gy)
        return [("the output", fc2(nn.functional.gelu(fc1(x))).detach(), "expected fc2(gelu(fc1(x))) on every rank"),
                ("x.grad", xd.grad, "all-reduce the input gradient in backward (f before fc1)"),
                ("fc1.weight.grad", fc1.weight.grad[mine],
                 f"expected rows {mine.start}:{mine.stop} of fc1's weight gradient"),
                ("fc1.bias.grad", fc1.bias.grad[mine], f"expected elements {mine.start}:{mine.stop} of fc1's bias "
                                                       "gradient"),
                ("fc2.weight.grad", fc2.weight.grad[:, mine],
                 f"expected columns {mine.start}:{mine.stop} of fc2's weight gradient"),
                ("fc2.bias.grad", fc2.bias.grad, "expected fc2's whole bias gradient")]
    raise KeyError(f"ex06's {kind} cases have no dense values (case {case!r})")


def compare(label: str, got, want: torch.Tensor, hint: str) -> str | None:
    """None when got equals want (within TOLERANCE), else one line saying how it differs and what to try.
    got: the rank's raw result (a tensor, None, or the name of what the submission gave instead)."""
    if got is None:
        return f"{label} is None (expected a tensor of shape {tuple(want.shape)}): {hint}"
    if not isinstance(got, torch.Tensor):
        return f"{label} is a {got}, not a tensor"
    if got.shape != want.shape:
        return f"{label} has shape {tuple(got.shape)}, expected {tuple(want.shape)}: {hint}"
    diff = (got.double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    if not diff <= TOLERANCE:  # NaN is wrong too
        return f"{label} differs from the dense layer's by {diff:.2g} (tolerance {TOLERANCE:g}): {hint}"
    return None


# --- the cases, as each rank runs them: the submission's results, saved raw --------------------------
def kept(value):
    """A result as the grader process can load it: a tensor or None as is, anything else by its type's name."""
    return value if value is None or isinstance(value, torch.Tensor) else type(value).__name__


def grad_of(module, name: str):
    """module.<name>.grad, kept; the AttributeError of a module without that parameter is the learner's."""
    return kept(getattr(getattr(module, name), "grad", None))


def case_column(sub, guard, tp, bias: bool, gather: bool):
    group, n, rank = tp
    dense, x, gy = dense_linear(11, HIDDEN, FFN, bias), inputs(11, HIDDEN), upstream(11, (BATCH, SEQ, FFN))
    xs = x.clone().requires_grad_()
    with guard.watching("forward"):
        layer = sub.ColumnParallelLinear.from_dense(dense, gather_output=gather, group=group)
        y = layer(xs)
    with guard.watching("backward"):
        # gather_output=False: this rank's slice of Y gets its slice of the upstream gradient
        y.backward(gy if gather else gy[..., rows(n, rank, FFN)])
    got = {"the output": kept(y), "x.grad": kept(xs.grad), "weight.grad": grad_of(layer, "weight")}
    has_bias = getattr(layer, "bias", None) is not None
    if bias:
        got["bias.grad"] = grad_of(layer, "bias")
    return {"raw": got, "has_bias": has_bias}


def case_row(sub, guard, tp, bias: bool, parallel_input: bool):
    group, n, rank = tp
    dense, x, gy = dense_linear(21, FFN, HIDDEN, bias), inputs(21, FFN), upstream(21, (BATCH, SEQ, HIDDEN))
    xs = (x[..., rows(n, rank, FFN)] if parallel_input else x).clone().requires_grad_()
    with guard.watching("forward"):
        layer = sub.RowParallelLinear.from_dense(dense, input_is_parallel=parallel_input, group=group)
        y = layer(xs)
    with guard.watching("backward"):
        y.backward(gy)
    got = {"the output": kept(y), "x.grad": kept(xs.grad), "weight.grad": grad_of(layer, "weight")}
    has_bias = getattr(layer, "bias", None) is not None
    if bias:
        got["bias.grad"] = grad_of(layer, "bias")
    return {"raw": got, "has_bias": has_bias}


def case_bias_once(sub, guard, tp):
    """Zero weights and a known bias: the output must be the bias, not world size × bias."""
    group, n, _ = tp
    dense, x = bias_once_setup(n)
    with guard.watching("forward"):
        y = sub.RowParallelLinear.from_dense(dense, input_is_parallel=True, group=group)(x)
    return {"raw": {"the output": kept(y)}}


def case_mlp(sub, guard, tp, seed: int):
    group, n, rank = tp
    fc1, fc2, x, gy = mlp_setup(seed)
    xs = x.clone().requires_grad_()
    with guard.watching("setup"):
        mlp = sub.ParallelMLP.from_dense(fc1, fc2, group=group)
    guard.calls = []
    with guard.watching("forward"):
        y = mlp(xs)
    with guard.watching("backward"):
        y.backward(gy)
    got = {"the output": kept(y), "x.grad": kept(xs.grad), "fc1.weight.grad": grad_of(mlp.fc1, "weight"),
           "fc1.bias.grad": grad_of(mlp.fc1, "bias"), "fc2.weight.grad": grad_of(mlp.fc2, "weight"),
           "fc2.bias.grad": grad_of(mlp.fc2, "bias")}
    return {"raw": got, "calls": list(guard.calls)}


def case_divisible(sub, guard, tp, which: str):
    """Which exception creating a layer the group does not divide raised (None: it was created), and its text."""
    group, n, _ = tp
    bad, _ = undivisible(which, n)
    build = {"column": lambda: sub.ColumnParallelLinear(HIDDEN, bad, group=group),
             "row": lambda: sub.RowParallelLinear(bad, HIDDEN, group=group),
             "mlp": lambda: sub.ParallelMLP(HIDDEN, bad, group=group)}[which]
    try:
        with guard.watching("setup"):
            build()
    except Exception as err:  # noqa: BLE001 - which exception it is, is what this case records
        return {"raised": type(err).__name__, "value_error": isinstance(err, ValueError), "message": str(err)[:300],
                "line": guard.one_line(err)}
    return {"raised": None}


RUN = {"column": case_column, "row": case_row, "bias-once": case_bias_once, "mlp": case_mlp,
       "divisible": case_divisible}


class Ex06Job(jobkit.GradingJob):
    """ex06's grading job: every case of one world size (and, on 4 ranks, two tensor-parallel groups of 2)."""

    name, wanted = "ex06", ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP")
    case_limit = 20.0
    barrier_between_cases = True  # a rank that failed before a collective must not meet its peers' next one
    reason = "a deadlock (a collective that the other ranks never matched), an endless loop, or far too slow"

    def prepare(self) -> None:
        # Every rank takes part in creating every group (torch.distributed's rule), before the guard is on.
        world = self.ctx.world_size
        self.halves = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None

    def make_guard(self, comm) -> Guard:
        return Guard(comm, self.submission)

    def watching(self):
        return self.guard.watching("import")

    def plan(self) -> list[tuple]:
        world, rank = self.ctx.world_size, self.ctx.rank
        cases = []
        for case, group, kind, options in specs(world):
            n, tp_rank, index = tensor_parallel(world, rank, case)
            tp = (self.halves[index] if case == "groups" else None, n, tp_rank)
            if case == "groups":
                options = {**options, "seed": options["seed"] + index}
            cases.append((case, group, functools.partial(RUN[kind], tp=tp, **options)))
        return cases


if __name__ == "__main__":
    jobkit.main(Ex06Job)
