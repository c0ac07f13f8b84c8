"""Grader of ex06: column- and row-parallel linear layers and the Megatron MLP (run it with `gpucourse grade ex06`).

One real job per world size (1, 2 and 4 ranks, through gpucourse.launch; ex06_tensor_parallel.py), side by side. Every
rank loads the same dense nn.Linear weights into the submission's layers (from_dense) and saves its outputs
and gradients raw; the tests below compare them, here in the grader process, with the dense layers' (or the
matching slices), recomputed from the job's own seeds. What is checked:
- ColumnParallelLinear (gather_output False/True) and RowParallelLinear (input_is_parallel True/False), with
  and without bias: output, input gradient, weight-shard and bias gradients;
- the row-parallel bias is added once, after the reduction;
- ParallelMLP equals nn.Sequential(fc1, GELU, fc2), and starts exactly one all_reduce (of the activations)
  in forward and one in backward, and no other collective (2 and 4 ranks; every torch.distributed
  collective is recorded);
- sizes the group does not divide raise ValueError naming both sizes;
- 4 ranks as two tensor-parallel groups of 2: the layers use their group, not the whole world.

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex06 (tensor-parallel
layers): every case for this job's world size, in one launch.

    ex06_tensor_parallel.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it on 1, 2 and 4 ranks. Every rank builds the same dense layers and
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
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
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


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
WORLD_SIZES = (1, 2, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: JobRecords}: the three jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex06-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- what makes one rank's record of a case wrong (None when it is right) ---------------------------
def equal_problem(rec, world) -> str | None:
    """The first of the rank's raw results that differs from the dense layers' (divisible cases: the error)."""
    kind, options = spec(world, rec["case"])
    if kind == "divisible":
        return divisible_problem(rec, world, options["which"])
    if options.get("bias") is False and rec.get("has_bias"):
        return "bias=False but the layer has a bias"
    got = raw(rec)
    pairs = expected(world, rec["rank"], rec["case"])
    if kind == "bias-once":
        n = tensor_parallel(world, rec["rank"], rec["case"])[0]
        y, want = got["the output"], pairs[0][1]
        if isinstance(y, torch.Tensor) and y.shape == want.shape and n > 1 and torch.allclose(y, want * n):
            return (f"with zero weights the output is {n} × the bias: the bias was added on every rank before the "
                    f"all-reduce; add it once, after the reduction")
    for label, want, hint in pairs:
        if why := compare(label, got.get(label), want, hint):
            return why
    return None


def divisible_problem(rec, world, which: str) -> str | None:
    """Creating the layer raised ValueError whose message names both sizes."""
    n = tensor_parallel(world, rec["rank"], rec["case"])[0]
    bad, call = undivisible(which, n)
    if rec.get("raised") is None:
        return f"{call} on {n} ranks was created: {bad} is not divisible by {n}; raise ValueError"
    if not rec.get("value_error"):
        return f"{call} on {n} ranks raised {rec.get('line')}, not ValueError"
    text = rec.get("message", "")
    if not all(re.search(rf"(?<!\d){v}(?!\d)", text) for v in (bad, n)):
        return f"{call} on {n} ranks raised ValueError({text[:150]!r}): name both sizes ({bad} and {n})"
    return None


def collectives_problem(rec, world) -> str | None:
    """Equal to the dense MLP, and exactly one all_reduce of the activations in forward, one in backward, nothing
    else."""
    if why := equal_problem(rec, world):
        return why
    size = ACTIVATION_BYTES
    for phase in ("forward", "backward"):
        calls = [c for c in rec["calls"] if c["phase"] == phase]
        ops = ", ".join(f"{c['op']} ({c['bytes']} B)" for c in calls) or "none"
        if len(calls) != 1 or calls[0]["op"] != "all_reduce":
            what = "the output of fc2 (g)" if phase == "forward" else "the input gradient (f)"
            return (f"ParallelMLP's {phase} started {len(calls)} collective(s): {ops}; expected exactly one "
                    f"all_reduce, of {what}")
        if calls[0]["bytes"] != size:
            return (f"ParallelMLP's {phase} all_reduce moved a {calls[0]['bytes']}-byte tensor; expected the "
                    f"activations, batch × seq × hidden × 4 = {size} bytes")
    return None


def judge(jobs, worlds, cases: str, problem) -> None:
    """job_records.check over these world sizes' jobs, each record judged by problem(rec, its job's world size)
    (known from the run folder the grader read the record from, not from anything the rank wrote)."""
    world_of = {str(jobs[w].result.run_dir): w for w in worlds}
    check({w: jobs[w] for w in worlds}, cases, lambda rec: problem(rec, world_of[str(rec["run_dir"])]))


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_column_parallel_equals_dense(jobs, world):
    """Output (split or gathered), x.grad, and the weight/bias shards' gradients equal the dense layer's slices."""
    judge(jobs, [world], "column", equal_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_row_parallel_equals_dense(jobs, world):
    """Input split or full: output on every rank, x.grad (slice or full), weight-column and bias gradients."""
    judge(jobs, [world], "row", equal_problem)


@pytest.mark.points(2)
def test_row_parallel_bias_added_once(jobs):
    """Zero weights: the output is the bias itself, not world size × bias (added after the all-reduce)."""
    judge(jobs, WORLD_SIZES, "bias-once", equal_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parallel_mlp_equals_dense(jobs, world):
    """ParallelMLP.from_dense(fc1, fc2): output, x.grad and every shard's gradient equal the dense MLP's."""
    judge(jobs, [world], "mlp", equal_problem)


@pytest.mark.points(3)
def test_parallel_mlp_one_all_reduce_forward_one_backward(jobs):
    """2 and 4 ranks: forward starts one all_reduce of batch×seq×hidden floats, backward one, nothing else."""
    judge(jobs, [2, 4], "mlp", collectives_problem)


@pytest.mark.points(1)
def test_sizes_not_divisible_raise_value_error(jobs):
    """ColumnParallelLinear(8, 5) on 2 ranks (and the row/MLP cases): ValueError naming 5 and 2."""
    judge(jobs, [2, 4], "divisible", equal_problem)


@pytest.mark.points(2)
def test_layers_use_their_process_group(jobs):
    """4 ranks as two tensor-parallel groups of 2 (group=...): each group's MLP equals its dense MLP."""
    def problem(rec, world):
        why = collectives_problem(rec, world)
        return why and (f"{why} — with group=..., use that group's size and rank (dist.get_world_size(group), "
                        f"dist.get_rank(group)) and pass group= to every collective")

    judge(jobs, [4], "groups", problem)


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex06Job)
