"""Grader of ex09: fix a training step on a 2D mesh (run it with `gpucourse grade ex09`).

Three real jobs side by side (ex09_fix_2d.py through gpucourse.launch), on a 2x2 mesh (4 ranks), a 2x1 mesh (data
parallel only) and a 1x2 mesh (tensor parallel only). The ranks save what the submission produced, raw (its
parameters, what its model was fed); graded here, in the grader process, by equality with one process training the
course's TinyLM (the graders' copy, _ex09_model.py) on the whole global batch, from the job's own batches and seed:
- build_model starts every rank from the one process's weights, whatever its random state before;
- the ranks of a tp group train on the same rows, and dp group g on rows g*B/dp ... (g+1)*B/dp;
- each step's returned loss and the final parameters equal the one process's, on every mesh.

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex09 (fix a 2D-mesh training
step): every case on one (dp, tp) mesh, in one launch.

    ex09_fix_2d.py SUBMISSION.py --dp D --tp T [--case-limit SECONDS]

The checks below launch it on a 2x2, a 2x1 and a 1x2 mesh. The grader makes the mesh before the submission
is imported; each rank logs one record per case (jobkit.record_writer) and saves what the submission produced,
raw: every parameter whole (DTensors gathered with full_tensor(), a collective of the grader's, on every rank)
and, in train, the inputs each forward of the model was fed. E.g.

    {"case": "train", "group": "train", "error": None, "raw": ["fed", "params"], "losses": [3.61, 3.52, 3.41]}

Cases:
  init   build_model(mesh, vocab, seed), called with a different random state on every rank: its parameters.
  train  a fresh build_model, then STEPS train_step calls on global batches that are the same on every rank; SGD
         with momentum (which, unlike Adam, notices gradients that are summed instead of averaged). Saved: what
         each forward of the model was fed, each step's returned loss, and the final parameters.

The rank judges nothing. The grader process trains one process on the whole batch (`reference`: the course's
TinyLM, which the exercise gives and does not grade, from the graders' own copy _ex09_model.py, never from the
learner's file: `course_model`; no process group) and compares the parameters (`compare`) and losses; it finds
which rows of the global batch each forward was fed (`rows_of`).
What the submission does is watched (comm_recorder, capped output); a case that runs past --case-limit (a
collective some ranks never call) is reported and ends the rank.
"""
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from gpucourse.run import runtime
from gpucourse.tools.grading import jobkit  # what every grading job shares
# the model the exercise gives, the grader's own copy
from gpucourse.tools.grading.graders import _ex09_model as ex09_model
from gpucourse.tools.grading.records import RawResultsError, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
VOCAB, SEED, BATCH, CONTEXT, STEPS, LR = 32, 5, 8, 8, 3, 0.2
FUNCTIONS = ("build_model", "train_step", "TinyLM")


# --- the inputs: the same in every rank and in the grader process ------------------------------------
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step`: random token ids and next-token targets, the same on every rank. Row 0's first token
    is 0, row 1's 1, ...: every row is distinct, so a row fed to the model names its index."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(VOCAB, (BATCH, CONTEXT + 1), generator=gen)
    ids[:, 0] = torch.arange(BATCH)
    return ids[:, :-1], ids[:, 1:]


def optimizer(model) -> torch.optim.Optimizer:
    # foreach=False: the per-tensor path, which takes any mix of plain tensors and DTensors
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)


# --- the reference and the comparisons: the grader process's, never a rank's --------------------------
def course_model() -> type:
    """The TinyLM class the course gives (the exercise's model: it is not what is graded), for the one-process
    reference: the graders' own copy (_ex09_model.py), so that nothing of the learner's file (its class bodies, its
    module-level code) ever runs in the grader process, in the checkout or in a release (which has no solutions/).
    tests/unit/tools/test_ex09_model.py keeps the copy and the solution's classes the same model."""
    return ex09_model.TinyLM


def reference(model_class) -> dict:
    """One process, the whole batch: initial parameters, losses, final parameters."""
    torch.manual_seed(SEED)
    model = model_class(VOCAB)
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt, losses = optimizer(model), []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"init": init, "losses": losses, "final": {n: p.detach().clone() for n, p in model.named_parameters()}}


def compare(got: dict, reference: dict) -> dict:
    """The largest difference of the submission's parameters (whole) from the reference's, and where it is;
    {"names": ...} when the names or shapes differ from TinyLM(vocab)'s."""
    odd = sorted(set(got) ^ set(reference)) or sorted(n for n in reference if got[n].shape != reference[n].shape)
    if odd:
        return {"names": odd[:3]}
    diffs = {name: (got[name].double() - ref.double()).abs().max().item() for name, ref in reference.items()}
    worst = max(diffs, key=lambda n: diffs[n] if diffs[n] == diffs[n] else float("inf"))  # NaN is the worst
    return {"max_diff": diffs[worst], "worst": worst}


def rows_of(fed: torch.Tensor, x: torch.Tensor) -> list[int]:
    """The global batch's row index of every row fed to the model (-1 for a row that is none of them)."""
    fed = fed.reshape(-1, fed.shape[-1]) if fed.dim() > 1 else fed.view(1, -1)
    return [next((j for j in range(x.shape[0]) if fed.shape[-1] == x.shape[1] and torch.equal(row, x[j])), -1)
            for row in fed]


# --- the cases, as each rank runs them: what the submission produced, saved raw ----------------------
def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole: DTensors gathered over their mesh (a collective of the grader's, on every rank)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def plain(fed) -> torch.Tensor:
    """What a forward was fed, as a plain tensor (a DTensor: this rank's part; not a tensor: empty)."""
    if isinstance(fed, DTensor):
        fed = fed.to_local()
    return fed.detach().clone() if isinstance(fed, torch.Tensor) else torch.empty(0)


def case_init(module, mesh, guard) -> dict:
    torch.manual_seed(100 + dist.get_rank())  # a different random state on every rank, as after other work
    with guard.watching():
        model = module.build_model(mesh, vocab=VOCAB, seed=SEED)
    return {"raw": {"params": full_params(model)}}


def case_train(module, mesh, guard) -> dict:
    torch.manual_seed(200 + dist.get_rank())
    with guard.watching():
        model = module.build_model(mesh, vocab=VOCAB, seed=SEED)
    opt, fed, losses, calls = optimizer(model), [], [], []
    model.register_forward_pre_hook(lambda _, args: calls.append(plain(args[0]) if args else torch.empty(0)))
    for step in range(STEPS):
        x, y = batch(step)
        calls.clear()
        with guard.watching():
            loss = module.train_step(model, opt, x.clone(), y.clone(), mesh)
        fed.append(list(calls))
        losses.append(float(loss) if isinstance(loss, (float, int, torch.Tensor)) and not isinstance(loss, bool)
                      and (not isinstance(loss, torch.Tensor) or loss.numel() == 1) else repr(loss)[:80])
    return {"raw": {"fed": fed, "params": full_params(model)}, "losses": losses}


class Ex09Job(jobkit.GradingJob):
    """ex09's grading job: the init and train cases on one (dp, tp) mesh, made before the submission is imported."""

    name, wanted = "ex09", FUNCTIONS
    case_limit = 20.0
    reason = ("a collective some ranks call and others do not (a different group, a different number of steps), "
              "an endless loop, or far too slow")

    def options(self, parser) -> None:
        parser.add_argument("--dp", type=int, required=True)
        parser.add_argument("--tp", type=int, required=True)

    def setup(self):
        return runtime.setup(timeout_s=3 * self.args.case_limit)  # a collective that never completes raises then

    def prepare(self) -> None:
        torch.set_num_threads(1)
        self.mesh = init_device_mesh("cpu", (self.args.dp, self.args.tp), mesh_dim_names=("dp", "tp"))

    def plan(self) -> list[tuple]:
        return [("init", "init", case_init), ("train", "train", case_train)]

    def plan_fields(self) -> dict:
        return {"dp": self.args.dp, "tp": self.args.tp, "batch": BATCH}

    def case_args(self, module) -> tuple:
        return module, self.mesh, self.guard


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
SHAPES = {"2x2": (2, 2), "2x1": (2, 1), "1x2": (1, 2)}  # (dp, tp)
MESHES = {key: (dp * tp, ["--dp", str(dp), "--tp", str(tp)]) for key, (dp, tp) in SHAPES.items()}
CASE_LIMIT_S = 30
JOB_TIMEOUT_S = 180
TOLERANCE = 1e-5  # float32, 3 steps; the tp all-reduces' order of summation moves the solution by ~1e-7


@functools.lru_cache(maxsize=None)
def cached_reference() -> dict:
    """One process training the course's TinyLM (course_model: the graders' own copy, _ex09_model.py, never
    the learner's file) on the whole batch: initial parameters, losses, final ones."""
    return reference(course_model())


@pytest.fixture(scope="module")
def jobs(submission) -> dict:
    return launch_jobs(JOB, submission, MESHES, name="grade-ex09-{key}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


def judged(jobs, problem):
    """problem(rec, mesh), each record with its mesh key, known from the run folder the grader read it from (not
    from anything the rank wrote)."""
    key_of = {str(job.result.run_dir): key for key, job in jobs.items()}
    return lambda rec: problem(rec, key_of[str(rec["run_dir"])])


def coords(rec, mesh) -> tuple[int, int]:
    """(dp group, tp rank) of the record's rank: init_device_mesh lays the ranks out row by row."""
    return divmod(rec["rank"], SHAPES[mesh][1])


def where(rec, mesh) -> str:
    dp_rank, tp_rank = coords(rec, mesh)
    return f"(dp group {dp_rank}, tp rank {tp_rank})"


def params_difference(rec, mesh, which: str) -> dict:
    """compare() of the rank's parameters (whole) with the one process's ("init" or "final")."""
    return compare(raw(rec)["params"], cached_reference()[which])


# --- what makes one rank's record wrong (None when right) --------------------------------------------
def init_problem(rec, mesh) -> str | None:
    diff = params_difference(rec, mesh, "init")
    if "names" in diff:
        return (f"{where(rec, mesh)} build_model's model has parameters {diff['names']} that TinyLM(vocab) has not, "
                "lacks them, or has them in another shape: return the TinyLM it built, parallelized in place")
    if not diff["max_diff"] <= TOLERANCE:  # NaN is wrong too
        return (f"{where(rec, mesh)} after build_model, {diff['worst']} differs from one process's "
                f"`torch.manual_seed(seed); TinyLM(vocab)` by {diff['max_diff']:.2g}: every rank must build the model "
                f"from the same seed, whatever its own random state")
    return None


def fed_rows(rec) -> list[list[int]]:
    """For each step, the global batch's row index of every row the model was fed (-1: none of them)."""
    return [[r for inputs in step_fed for r in rows_of(inputs, batch(step)[0])]
            for step, step_fed in enumerate(raw(rec)["fed"])]


def slice_problem(rec, mesh) -> str | None:
    dp, dp_rank = SHAPES[mesh][0], coords(rec, mesh)[0]
    per = BATCH // dp
    want = list(range(dp_rank * per, (dp_rank + 1) * per))
    for step, rows in enumerate(fed_rows(rec)):
        if rows != want:
            return (f"{where(rec, mesh)} step {step}: the model was fed rows {rows} of the global batch of {BATCH}; dp "
                    f"group {dp_rank} of {dp} trains on rows {want[0]}..{want[-1]} (-1: a row that is not in it)")
    return None


def tp_rows_problem(job, mesh) -> str | None:
    """The ranks of each tp group (one model replica) fed the model the same rows at every step."""
    records = job.ranks("train")
    for rec in records:
        if rec.get("error"):
            return f"rank {rec.get('rank', 0)}: {rec['error']}"
    groups: dict[int, list] = {}
    for rec in records:
        try:
            rows = fed_rows(rec)
        except RawResultsError as err:
            return f"rank {rec['rank']}: {err}"
        groups.setdefault(coords(rec, mesh)[0], []).append((rec["rank"], rows))
    for dp_rank, members in sorted(groups.items()):
        for step in range(len(members[0][1])):
            seen = {rank: rows[step] if step < len(rows) else [] for rank, rows in members}
            if len({tuple(r) for r in seen.values()}) > 1:
                return (f"step {step}: the tp ranks of dp group {dp_rank} fed the model different rows "
                        f"({', '.join(f'rank {r}: {rows}' for r, rows in seen.items())}): the ranks of a tp group "
                        f"hold shards of one model, so they must all compute on the same rows")
    return None


def losses_problem(rec, mesh) -> str | None:
    got, want = rec["losses"], cached_reference()["losses"]
    for step, (a, b) in enumerate(zip(got, want)):
        if not isinstance(a, float) or not abs(a - b) <= TOLERANCE:
            shown = f"{a:.6f}" if isinstance(a, float) else a
            return (f"{where(rec, mesh)} step {step}: train_step returned loss {shown}; one process on the whole batch "
                    f"has {b:.6f}: return the global batch's mean loss, after training on the right rows")
    return None


def params_problem(rec, mesh) -> str | None:
    diff = params_difference(rec, mesh, "final")
    if "names" in diff:
        return f"{where(rec, mesh)} after the last step, the model's parameters {diff['names']} are not TinyLM(vocab)'s"
    if not diff["max_diff"] <= TOLERANCE:
        return (f"{where(rec, mesh)} after the last step, {diff['worst']} differs from one process's by "
                f"{diff['max_diff']:.2g} (tolerance {TOLERANCE:g})")
    return None


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
def test_model_starts_as_one_process(jobs):
    """Every mesh: after build_model, every parameter (shards gathered) equals one process's initial weights."""
    check(jobs, "init", judged(jobs, init_problem))


@pytest.mark.points(2)
def test_tp_ranks_train_on_the_same_rows(jobs):
    """Every mesh: the ranks of a tp group fed the model the same rows of the global batch at every step."""
    failures = [f"{key} mesh, {why}" for key, job in jobs.items() if (why := tp_rows_problem(job, key))]
    if failures:
        pytest.fail(failures[0] + (f" (and {len(failures) - 1} more mesh(es))" if len(failures) > 1 else ""),
                    pytrace=False)


@pytest.mark.points(1)
def test_dp_groups_split_the_global_batch(jobs):
    """Every mesh: dp group g trains on rows g*B/dp ... (g+1)*B/dp, no more and no less."""
    check(jobs, "train", judged(jobs, slice_problem))


@pytest.mark.points(2)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_losses_match_one_process(jobs, mesh):
    """Each step's returned loss equals one process's loss on the whole batch, on every rank."""
    check(jobs, "train", judged(jobs, losses_problem), [mesh])


@pytest.mark.points(2)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_parameters_match_one_process(jobs, mesh):
    """After the last step, every parameter (shards gathered) equals one process's."""
    check(jobs, "train", judged(jobs, params_problem), [mesh])


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex09Job)
