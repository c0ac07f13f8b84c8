"""Grader of ex13: find where a 3-D run parts from one process (run it with `gpucourse grade ex13_silent_bugs`).

Chapter 13's scripts/13_gpt_3d.py is launched four times for every grading (once for all the submissions of a
grading batch): pipeline x FSDP x tensor parallel at 2 x 2 x 2 (8 ranks) and the three 1-D controls (pp 2, dp 2,
tp 2 alone: 2 ranks each), each launch training the right model and then each of the script's silent bugs
(`--bug none,tp_same_seed,...`), recording every rank's shards and the one process's tensors (`--record`). The
data of a grading comes from a seed: random per grading, shown in every test's note, replayed by
`gpucourse grade ex13_silent_bugs --seed N`.

Each bug's place is known by construction, not computed here (the script's BUGS says what each one does):
tp_same_seed re-draws the tensor-parallel weights, so block 0's q weight (the first of them) differs before any
step; norm_grad_not_reduced leaves block 0's first norm's gradient a partial sum; micro_loss_scale multiplies every
gradient, the token embedding's first; dp_same_batch and vocab_parallel_lse change the loss; clip_norm_per_stage
leaves step 0's loss and gradients right and clips them by each stage's own norm, so every parameter of the first
stage with a gradient, the token embedding first, differs from step 1 on (Adam divides most of the clip's scale
away: about 1e-8, far above the tolerance). Each breaks one 1-D control only (its dimension's). The right run
must be left alone (None).

Threat model: the submission runs in a Python process of its own (`python -I`: no PYTHON* variables, no user
site), in an empty folder with an almost empty environment, given the records (loaded here) on its standard
input, shuffled and without the bugs' names; it cannot import gpucourse. Each case has a time limit.
"""
import atexit
import functools
import os
import random
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from gpucourse.run.contract import DEVICE_ENV
from gpucourse.run.launcher import launch_all
from gpucourse.tools.exercises import course_root
from gpucourse.tools.grading.graders._child import answers_in_child
from gpucourse.tools.grading.plugin import SEED_ENV, TIMING_ENV
from gpucourse.tools.grading.records import REPORT_SLACK, Batch

pytestmark = pytest.mark.grader

SCRIPT = course_root() / "scripts" / "13_gpt_3d.py"
# The model of tests/integration/test_capstone_3d.py: 2 layers (one a stage), d_model 32, 2 heads, context 16.
SIZES = ["--layers", "2", "--d-model", "32", "--heads", "2", "--context", "16", "--batch", "8", "--steps", "2",
         "--schedule", "1f1b", "--clip-norm", "1.0"]
# name: (pp, dp, tp, micro-batches). Micro-batches belong to the pipeline: the dp and tp controls take one.
LAYOUTS = {"3d": (2, 2, 2, 2), "pp": (2, 1, 1, 2), "dp": (1, 2, 1, 1), "tp": (1, 1, 2, 1)}
# bug: (step, what, name, dim), known by construction (the module's docstring)
TRUTH = {
    "none": None,
    "tp_same_seed": (0, "param", "blocks.0.attn.q.weight", "tp"),
    "norm_grad_not_reduced": (0, "grad", "blocks.0.ln1.weight", "tp"),
    "micro_loss_scale": (0, "grad", "embed.tok.weight", "pp"),
    "dp_same_batch": (0, "loss", None, "dp"),
    "vocab_parallel_lse": (0, "loss", None, "tp"),
    "clip_norm_per_stage": (1, "param", "embed.tok.weight", "pp"),
}
BUGS = [b for b in TRUTH if b != "none"]
TOL = 1e-10
JOB_TIMEOUT_S = 300
RECORDS_KEY = "ex13-silent-bugs"  # the batch's record of the four launches (records.Batch.once)
CALL_LIMIT_S = 20  # one call of first_divergence; well under a second is enough


def job(layout: str, folder: Path, seed: int) -> dict:
    pp, dp, tp, micro = LAYOUTS[layout]
    args = ["--pp", pp, "--dp", dp, "--tp", tp, "--micro", micro, *SIZES, "--seed", seed,
            "--bug", ",".join(TRUTH), "--record", folder / layout]
    return {"script": SCRIPT, "nproc": pp * dp * tp, "args": [str(a) for a in args], "backend": "gloo",
            "name": f"grade-ex13-{layout}", "timeout": JOB_TIMEOUT_S, "check": False,
            "env": {DEVICE_ENV: "cpu", "OMP_NUM_THREADS": "1"}}


def record(folder: Path, seed: int) -> dict:
    """Run the four layouts (two at a time) into `folder`: {"seed", "folder"}, or the first failure's summary."""
    results = launch_all([job(name, folder, seed) for name in LAYOUTS], parallel=2)
    failed = [(name, r) for name, r in zip(LAYOUTS, results) if not r.ok]
    return {"seed": seed, "folder": str(folder),
            "error": (f"{failed[0][1].run_dir.name}: {failed[0][1].error.summary if failed[0][1].error else ''}"
                      if failed else None)}


@functools.lru_cache(maxsize=None)
def recorded(batch_folder: str | None) -> dict:
    """This grading's records, made once: in a batch of gradings, by the first that asks, for all of them."""
    seed = int(os.environ[SEED_ENV]) if os.environ.get(SEED_ENV) else secrets.randbelow(1000)
    if batch_folder is None:
        folder = Path(tempfile.mkdtemp(prefix="ex13-records-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        return record(folder, seed)
    return Batch(Path(batch_folder), []).once(RECORDS_KEY, lambda: record(Path(batch_folder) / "ex13", seed))


def cases(folder: Path) -> tuple[dict, dict]:
    """(the one process's record, {bug: {layout: {rank: record}}}), read as data (weights_only)."""
    def load(path):
        return torch.load(path, weights_only=True)

    reference = load(folder / "3d" / "reference.pt")
    runs = {bug: {layout: {r: load(folder / layout / bug / f"rank{r}.pt") for r in range(pp * dp * tp)}
                  for layout, (pp, dp, tp, _) in LAYOUTS.items()} for bug in TRUTH}
    return reference, runs


# --- the submission, in a process of its own -----------------------------------------------------------------
def answers_of(submission: Path, folder: Path, seed: int) -> dict:
    """{bug: {"answer": ...} or {"error": one line}}: the submission's first_divergence on every case, in a fresh
    `python -I` process (_child.py), the cases in the seed's order."""
    reference, runs = cases(folder)
    order = list(TRUTH)
    random.Random(seed).shuffle(order)
    limit = CALL_LIMIT_S * (REPORT_SLACK if os.environ.get(TIMING_ENV) == "report" else 1)
    got = answers_in_child(submission, "first_divergence", [(reference, runs[b], TOL) for b in order], limit,
                           slack_s=30)  # the child imports torch to read the tensors
    return dict(zip(order, got))


@pytest.fixture(scope="module")
def graded(submission) -> dict:
    """{"seed", "answers": {bug: ...}}; fails every test if the script's runs failed."""
    batch = Batch.of(submission)
    runs = recorded(str(batch.folder) if batch else None)
    if runs["error"]:
        pytest.fail(f"the grader's runs of scripts/13_gpt_3d.py failed (not your code): {runs['error']}",
                    pytrace=False)
    return {**runs, "answers": answers_of(submission, Path(runs["folder"]), runs["seed"])}


def answer_of(got: dict, bug: str):
    """The answer as a tuple, or pytest.fail with what was wrong."""
    if "error" in got:
        pytest.fail(f"{bug}: {got['error']}", pytrace=False)
    answer = got["answer"]
    if answer is not None and not (isinstance(answer, list) and len(answer) == 4):
        pytest.fail(f"{bug}: first_divergence returned {answer!r}: return None or (step, what, name, dim)",
                    pytrace=False)
    return None if answer is None else tuple(answer)


@pytest.mark.points(1)
def test_leaves_the_right_run_alone(graded, record_property):
    """The 3-D run without a bug equals one process (to ~1e-15): None."""
    record_property("note", f"records of seed {graded['seed']} (replay: --seed {graded['seed']})")
    answer = answer_of(graded["answers"]["none"], "the right run")
    if answer is not None:
        pytest.fail(f"the right run (no bug; it equals one process to ~1e-15, under tol {TOL:g}): you answered "
                    f"{answer}", pytrace=False)


@pytest.mark.points(1)
@pytest.mark.parametrize("bug", BUGS)
def test_finds_where_the_run_parts(graded, bug, record_property):
    """The first step, kind (param, loss, grad) and parameter where the 3-D run with `bug` parts from one process."""
    record_property("note", f"records of seed {graded['seed']} (replay: --seed {graded['seed']})")
    answer, truth = answer_of(graded["answers"][bug], bug), TRUTH[bug]
    if answer is None or answer[:3] != truth[:3]:
        pytest.fail(f"bug {bug}: you answered {answer}; it first parts at step {truth[0]}, {truth[1]} "
                    f"{truth[2] or ''}".rstrip(), pytrace=False)


@pytest.mark.points(1)
@pytest.mark.parametrize("bug", BUGS)
def test_names_the_dimension(graded, bug, record_property):
    """The mesh dimension whose 1-D control also breaks."""
    record_property("note", f"records of seed {graded['seed']} (replay: --seed {graded['seed']})")
    answer, truth = answer_of(graded["answers"][bug], bug), TRUTH[bug]
    if answer is None or answer[3] != truth[3]:
        pytest.fail(f"bug {bug}: you answered dimension {answer[3] if answer else None!r}; only the "
                    f"{truth[3]} control parts from one process", pytrace=False)
