"""Grader of ex09: fix a training step on a 2D mesh (run it with `gpucourse grade ex09`).

Three real jobs side by side (ex09_job.py through gpucourse.launch), on a 2x2 mesh (4 ranks), a 2x1 mesh (data
parallel only) and a 1x2 mesh (tensor parallel only). The ranks save what the submission produced, raw (its
parameters, what its model was fed); graded here, in the grader process, by equality with one process training the
course's TinyLM (the graders' copy, ex09_model.py) on the whole global batch, from the job's own batches and seed:
- build_model starts every rank from the one process's weights, whatever its random state before;
- the ranks of a tp group train on the same rows, and dp group g on rows g*B/dp ... (g+1)*B/dp;
- each step's returned loss and the final parameters equal the one process's, on every mesh.
"""
import functools
from pathlib import Path

import pytest

from gpucourse.grading.records import RawResultsError, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex09_job.py")
CASES = job_module(JOB)  # its batches, seed and optimizer: the one-process training is run here
SHAPES = {"2x2": (2, 2), "2x1": (2, 1), "1x2": (1, 2)}  # (dp, tp)
MESHES = {key: (dp * tp, ["--dp", str(dp), "--tp", str(tp)]) for key, (dp, tp) in SHAPES.items()}
CASE_LIMIT_S = 30
JOB_TIMEOUT_S = 180
TOLERANCE = 1e-5  # float32, 3 steps; the tp all-reduces' order of summation moves the solution by ~1e-7
BATCH = CASES.BATCH  # the global batch's rows


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """One process training the course's TinyLM (CASES.course_model: the graders' own copy, ex09_model.py, never
    the learner's file) on the whole batch: initial parameters, losses, final ones."""
    return CASES.reference(CASES.course_model())


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
    """CASES.compare of the rank's parameters (whole) with the one process's ("init" or "final")."""
    return CASES.compare(raw(rec)["params"], reference()[which])


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
    return [[r for inputs in step_fed for r in CASES.rows_of(inputs, CASES.batch(step)[0])]
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
    got, want = rec["losses"], reference()["losses"]
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
