"""Every grader catches the mistakes it exists for, and only those: its mutants lose exactly the points they should.

A mutant (tests/mutants/<exercise>.diff; tests/mutants/__init__.py describes the format) is the exercise's solution
with one plausible learner's mistake, written as a patch; its `must fail:` names the grader tests that must lose
their points (as GradeReport names them, parametrized ids included). Graded with timed criteria reported, not
scored (GPUCOURSE_GRADE_TIMING=report, as in the rest of the suite), the tests that lose points must be exactly
those: each named test is proven to catch that mistake, and every other test to keep its points for a submission
that is otherwise right.

The quick tests check the mutants' form and that each still applies to the current solution; the slow ones grade
them, all mutants of an exercise in one launch per job and one grading run (the `graded_batch` fixture). The last
ones test the judges without a run: on the solution's recorded results with the tensors the ranks saved forged.
"""
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from gpucourse import exercises, grading
from gpucourse.tools.grading.plugin import BATCH_ENV, BATCH_FILE, TIMING_ENV
from tests.conftest import BATCH_TIMEOUT_S, graded
from tests.mutants import HERE, all_mutants

MUTANTS = [m for ms in all_mutants().values() for m in ms]
MIN_MUTANTS = 3


@lru_cache(maxsize=None)
def grader_tests() -> dict[str, frozenset]:
    """{exercise: the names of its grader's tests}, as pytest collects them (parametrized ids included)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "gpucourse.tools.grading.plugin", *map(str, exercises.grader_files().values())],
                          capture_output=True, text=True, cwd=exercises.course_root(), timeout=120,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    names: dict[str, set] = {}
    for line in done.stdout.splitlines():
        if "::" in line:
            path, name = line.strip().split("::", 1)
            names.setdefault(Path(path).stem, set()).add(name)
    assert names, done.stdout + done.stderr
    return {exercise: frozenset(tests) for exercise, tests in names.items()}


# --- quick: the mutants' form --------------------------------------------------------------------------
def test_every_exercise_has_mutants():
    graders = exercises.grader_files()
    counts = {name: len(all_mutants().get(name, [])) for name in graders}
    assert all(n >= MIN_MUTANTS for n in counts.values()), f"mutants per exercise (at least {MIN_MUTANTS}): {counts}"
    strays = sorted(p.name for p in HERE.glob("*.diff") if p.stem not in graders)
    assert not strays, f"mutant files without a grader: {strays} (a file is named after the exercise's file stem)"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_mutant_is_the_solution_with_one_declared_mistake(mutant):
    tests = grader_tests()[mutant.exercise]
    assert len(set(mutant.must_fail)) == len(mutant.must_fail), f"{mutant.id}: `must fail:` names a test twice"
    unknown = sorted(set(mutant.must_fail) - tests)
    assert not unknown, f"{mutant.id}: `must fail:` names {unknown}, not tests of its grader: {sorted(tests)}"
    assert set(mutant.must_fail) != tests, f"{mutant.id}: a mutant that fails every test proves nothing in particular"
    solution = exercises.solution_files()[mutant.exercise].read_text()
    changed = mutant.apply(solution)  # MutantError, naming the hunk, when the solution no longer has its lines
    assert changed != solution, f"{mutant.id} is the solution itself"
    compile(changed, mutant.id, "exec")


# --- slow: the graders catch them -------------------------------------------------------------------------
@pytest.mark.parametrize("mutant", [pytest.param(m, id=m.id, marks=graded(m.exercise)) for m in MUTANTS])
def test_grader_catches_exactly_the_mutants_mistake(mutant, graded_batch, monkeypatch):
    monkeypatch.setenv(TIMING_ENV, "report")  # a timed criterion never decides (the suite's busy machines)
    report = graded_batch(mutant.exercise)[mutant.name]
    table = report.table()
    assert not report.problems and {t.name for t in report.tests} == grader_tests()[mutant.exercise], table
    lost = {t.name for t in report.tests if t.score < t.max_score}
    declared = set(mutant.must_fail)
    assert lost == declared, (
        f"{mutant.id}: should lose {sorted(declared - lost)} but kept their points; "
        f"should keep {sorted(lost - declared)} but lost them\n{table}")


@pytest.mark.parametrize("name", [pytest.param(n, marks=graded(n)) for n in exercises.grader_files()])
def test_the_solution_graded_after_its_mutants_keeps_full_marks(name, graded_batch, monkeypatch):
    """Each submission of a batch is graded in a process of its own: nothing a mutant did reaches the next one."""
    monkeypatch.setenv(TIMING_ENV, "report")
    report = graded_batch(name)["solution_after_the_mutants"]
    assert report.max_score > 0 and report.score == report.max_score, report.table()


# --- the judges, on recorded results: no run -------------------------------------------------------------------------
SAVE_NO_RAW = {"ex03_predict_scaling", "ex04_lr_schedule",  # their ranks record plain values, no tensors
               "ex12_plan_at_scale",
               "ex08_read_the_dumps", "ex13_silent_bugs"}  # run no learner's code in the ranks: no answer in a file


def _forged_copy(batch: Path, into: Path) -> int:
    """A copy of `batch` whose runs serve its gradings as they are, except that the raw results every rank saved for
    the batch's first submission (the solution) are forged: each floating-point tensor t becomes 1.5 t + 0.25.
    Returns how many files were forged."""
    def only_the_first_submission(folder, names):  # raw/rank<r>/<sub>/: the other submissions are not read
        return [n for n in names if n != "0"] if Path(folder).parent.name == "raw" else []

    shutil.copytree(batch, into, ignore=only_the_first_submission)
    for key in into.glob("*.json"):
        if key.name != BATCH_FILE:
            key.write_text(key.read_text().replace(str(batch), str(into)))
    def forge(value):  # the tensors inside lists and dicts too (a model's parameters, step by step)
        if isinstance(value, torch.Tensor):
            return value * 1.5 + 0.25 if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(map(forge, value))
        return {k: forge(v) for k, v in value.items()} if isinstance(value, dict) else value

    forged = 0
    for path in into.glob("runs/*/raw/rank*/0/*.pt"):
        torch.save(forge(torch.load(path, weights_only=True)), path)
        forged += 1
    return forged


@pytest.mark.parametrize("name", [pytest.param(n, marks=graded(n)) for n in exercises.grader_files()])
def test_judges_read_what_the_ranks_saved_not_what_they_claim(name, grade_batch, graded_batch, tmp_path, monkeypatch):
    """The judges run in the grader process on the tensors the ranks saved: graded again from a copy of the
    solution's recorded runs in which only the tensors the ranks saved differ, it loses points, and no job runs."""
    monkeypatch.setenv(TIMING_ENV, "report")
    solved = graded_batch(name)["solutions"]  # the batch's runs exist after it
    assert solved.score == solved.max_score > 0, solved.table()
    forged = _forged_copy(grade_batch(name), copy := tmp_path / "forged")
    if name in SAVE_NO_RAW:
        assert forged == 0, f"{name}'s ranks now save raw results: take it out of SAVE_NO_RAW"
        return
    assert forged, f"{name}'s solution saved no raw results: add it to SAVE_NO_RAW if it never does"
    runs = sorted(copy.glob("runs/*"))
    monkeypatch.setenv(BATCH_ENV, str(copy))
    report = grading.grade(name, "solutions", timeout=BATCH_TIMEOUT_S)
    assert sorted(copy.glob("runs/*")) == runs, "the grading of the forged copy launched a job of its own"
    assert not report.problems and report.tests, report.table()
    assert report.score < report.max_score, f"forged tensors kept full marks:\n{report.table()}"
