"""Grader of ex09: fix a training step on a 2D mesh (run it with `gpucourse grade ex09`).

Three real jobs side by side (ex09_job.py through gpucourse.launch), on a 2x2 mesh (4 ranks), a 2x1 mesh (data
parallel only) and a 1x2 mesh (tensor parallel only). Graded by equality with one process training the same
TinyLM on the whole global batch:
- build_model starts every rank from the one process's weights, whatever its random state before;
- the ranks of a tp group train on the same rows, and dp group g on rows g*B/dp ... (g+1)*B/dp;
- each step's returned loss and the final parameters equal the one process's, on every mesh.
"""
from pathlib import Path

import pytest

from .job_records import check, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex09_job.py")
MESHES = {"2x2": (4, ["--dp", "2", "--tp", "2"]), "2x1": (2, ["--dp", "2", "--tp", "1"]),
          "1x2": (2, ["--dp", "1", "--tp", "2"])}
CASE_LIMIT_S = 30
JOB_TIMEOUT_S = 180
TOLERANCE = 1e-5  # float32, 3 steps; the tp all-reduces' order of summation moves the solution by ~1e-7
BATCH = 8  # ex09_job.BATCH: the global batch's rows


@pytest.fixture(scope="module")
def jobs(submission) -> dict:
    return launch_jobs(JOB, submission, MESHES, name="grade-ex09-{key}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


def where(rec) -> str:
    dp_rank, tp_rank = rec["coords"]
    return f"(dp group {dp_rank}, tp rank {tp_rank})"


# --- what makes one rank's record wrong (None when right) --------------------------------------------
def init_problem(rec) -> str | None:
    if not rec["max_diff"] <= TOLERANCE:  # NaN is wrong too
        return (f"{where(rec)} after build_model, {rec['worst']} differs from one process's "
                f"`torch.manual_seed(seed); TinyLM(vocab)` by {rec['max_diff']:.2g}: every rank must build the model "
                f"from the same seed, whatever its own random state")
    return None


def slice_problem(rec) -> str | None:
    dp, dp_rank = rec["dp"], rec["coords"][0]
    per = BATCH // dp
    want = list(range(dp_rank * per, (dp_rank + 1) * per))
    for step, rows in enumerate(rec["rows"]):
        if rows != want:
            return (f"{where(rec)} step {step}: the model was fed rows {rows} of the global batch of {BATCH}; dp "
                    f"group {dp_rank} of {dp} trains on rows {want[0]}..{want[-1]} (-1: a row that is not in it)")
    return None


def tp_rows_problem(job) -> str | None:
    """The ranks of each tp group (one model replica) fed the model the same rows at every step."""
    records = job.ranks("train")
    for rec in records:
        if rec.get("error"):
            return f"rank {rec.get('rank', 0)}: {rec['error']}"
    groups: dict[int, list] = {}
    for rec in records:
        groups.setdefault(rec["coords"][0], []).append(rec)
    for dp_rank, members in sorted(groups.items()):
        for step in range(len(members[0]["rows"])):
            seen = {rec["rank"]: rec["rows"][step] for rec in members}
            if len({tuple(r) for r in seen.values()}) > 1:
                return (f"step {step}: the tp ranks of dp group {dp_rank} fed the model different rows "
                        f"({', '.join(f'rank {r}: {rows}' for r, rows in seen.items())}): the ranks of a tp group "
                        f"hold shards of one model, so they must all compute on the same rows")
    return None


def losses_problem(rec) -> str | None:
    got, want = rec["losses"], rec["expected_losses"]
    for step, (a, b) in enumerate(zip(got, want)):
        if not isinstance(a, float) or not abs(a - b) <= TOLERANCE:
            shown = f"{a:.6f}" if isinstance(a, float) else a
            return (f"{where(rec)} step {step}: train_step returned loss {shown}; one process on the whole batch "
                    f"has {b:.6f}: return the global batch's mean loss, after training on the right rows")
    return None


def params_problem(rec) -> str | None:
    if not rec["max_diff"] <= TOLERANCE:
        return (f"{where(rec)} after the last step, {rec['worst']} differs from one process's by "
                f"{rec['max_diff']:.2g} (tolerance {TOLERANCE:g})")
    return None


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
def test_model_starts_as_one_process(jobs):
    """Every mesh: after build_model, every parameter (shards gathered) equals one process's initial weights."""
    check(jobs, "init", init_problem)


@pytest.mark.points(2)
def test_tp_ranks_train_on_the_same_rows(jobs):
    """Every mesh: the ranks of a tp group fed the model the same rows of the global batch at every step."""
    failures = [f"{key} mesh, {why}" for key, job in jobs.items() if (why := tp_rows_problem(job))]
    if failures:
        pytest.fail(failures[0] + (f" (and {len(failures) - 1} more mesh(es))" if len(failures) > 1 else ""),
                    pytrace=False)


@pytest.mark.points(1)
def test_dp_groups_split_the_global_batch(jobs):
    """Every mesh: dp group g trains on rows g*B/dp ... (g+1)*B/dp, no more and no less."""
    check(jobs, "train", slice_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_losses_match_one_process(jobs, mesh):
    """Each step's returned loss equals one process's loss on the whole batch, on every rank."""
    check(jobs, "train", losses_problem, [mesh])


@pytest.mark.points(2)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_parameters_match_one_process(jobs, mesh):
    """After the last step, every parameter (shards gathered) equals one process's."""
    check(jobs, "train", params_problem, [mesh])
