"""Every grader catches the mistakes it exists for, and only those: its mutants lose exactly the points they should.

A mutant, tests/graders/mutants/<exercise>/<name>.py, is the exercise's solution with one plausible learner's
mistake (the changed lines marked `# MUTANT:`). Its docstring's first line says what is wrong; its MUST_FAIL
names the grader tests that must lose their points (as GradeReport names them, parametrized ids included).
Graded with timed criteria reported, not scored (GPUCOURSE_GRADE_TIMING=report, as in the rest of the suite),
the tests that lose points must be exactly MUST_FAIL: each named test is proven to catch that mistake, and
every other test to keep its points for a submission that is otherwise right.

The quick tests check the mutants' form (and that they are still the current solution plus their marked
changes); the slow one grades each mutant (20-90 s each).
"""
import ast
import difflib
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from gpucourse import exercises, grading
from tests.graders.conftest import TIMING_ENV

MUTANTS_DIR = Path(__file__).resolve().parent / "graders" / "mutants"
MUTANTS = sorted(MUTANTS_DIR.glob("*/*.py"))
MARK = "# MUTANT:"
MIN_MUTANTS = 3


def mutant_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def must_fail(path: Path) -> tuple:
    """The mutant's MUST_FAIL, read from its source (the mutant is never imported here)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MUST_FAIL" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{mutant_id(path)} defines no MUST_FAIL = ('test_name', ...)")


@lru_cache(maxsize=None)
def grader_tests() -> dict[str, frozenset]:
    """{exercise: the names of its grader's tests}, as pytest collects them (parametrized ids included)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *map(str, exercises.grader_files().values())],
                          capture_output=True, text=True, cwd=exercises.course_root(), timeout=120,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    names: dict[str, set] = {}
    for line in done.stdout.splitlines():
        if "::" in line:
            path, name = line.strip().split("::", 1)
            names.setdefault(Path(path).stem.removeprefix("test_"), set()).add(name)
    assert names, done.stdout + done.stderr
    return {exercise: frozenset(tests) for exercise, tests in names.items()}


def code_lines(path: Path) -> list[str]:
    """The file's lines without its module docstring and its MUST_FAIL assignment."""
    text = path.read_text()
    tree = ast.parse(text)
    drop = set()
    for i, node in enumerate(tree.body):
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)
        declared = isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MUST_FAIL" for t in node.targets)
        if docstring or declared:
            drop.update(range(node.lineno - 1, node.end_lineno))
    return [line for i, line in enumerate(text.splitlines()) if i not in drop]


# --- quick: the mutants' form --------------------------------------------------------------------------
def test_every_exercise_has_mutants():
    graded = exercises.grader_files()
    counts = {name: len(list((MUTANTS_DIR / name).glob("*.py"))) for name in graded}
    assert all(n >= MIN_MUTANTS for n in counts.values()), f"mutants per exercise (at least {MIN_MUTANTS}): {counts}"
    strays = sorted(p.name for p in MUTANTS_DIR.iterdir() if p.is_dir() and p.name not in graded)
    assert not strays, f"mutant folders without a grader: {strays} (a folder is named after the exercise's file stem)"


@pytest.mark.parametrize("path", MUTANTS, ids=mutant_id)
def test_mutant_is_the_solution_with_one_declared_mistake(path):
    exercise = path.parent.name
    assert not path.name.startswith("test_") and not path.stem.endswith("_test"), \
        f"{mutant_id(path)}: a name pytest would collect as a test file"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert doc.strip() and doc.splitlines()[0].strip(), f"{mutant_id(path)}: the docstring's first line says what is wrong"
    declared = must_fail(path)
    tests = grader_tests()[exercise]
    assert isinstance(declared, tuple) and declared and len(set(declared)) == len(declared), \
        f"{mutant_id(path)}: MUST_FAIL must be a non-empty tuple of distinct test names"
    unknown = sorted(set(declared) - tests)
    assert not unknown, f"{mutant_id(path)}: MUST_FAIL names {unknown}, not tests of {exercise}'s grader: {sorted(tests)}"
    assert set(declared) != tests, f"{mutant_id(path)}: a mutant that fails every test proves nothing in particular"
    solution, mutant = code_lines(exercises.solution_files()[exercise]), code_lines(path)
    hunks = [op for op in difflib.SequenceMatcher(None, solution, mutant, autojunk=False).get_opcodes()
             if op[0] != "equal"]
    assert hunks, f"{mutant_id(path)} is the solution itself"
    for _, i1, i2, j1, j2 in hunks:
        assert any(MARK in line for line in mutant[j1:j2]), (
            f"{mutant_id(path)}: lines {j1 + 1}-{j2} of its code differ from solutions/{exercise}.py lines {i1 + 1}-{i2} "
            f"without a `{MARK}` mark (the solution changed since? then redo the mutant on the new solution):\n"
            + "\n".join(difflib.unified_diff(solution[i1:i2], mutant[j1:j2], lineterm="")))


# --- slow: the graders catch them -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("path", MUTANTS, ids=mutant_id)
def test_grader_catches_exactly_the_mutants_mistake(path, monkeypatch):
    monkeypatch.setenv(TIMING_ENV, "report")  # a timed criterion never decides (the suite's busy machines)
    exercise = path.parent.name
    report = grading.grade(exercise, path)
    table = report.table()
    assert not report.problems and {t.name for t in report.tests} == grader_tests()[exercise], table
    lost = {t.name for t in report.tests if t.score < t.max_score}
    declared = set(must_fail(path))
    assert lost == declared, (
        f"{mutant_id(path)}: should lose {sorted(declared - lost)} but kept their points; "
        f"should keep {sorted(lost - declared)} but lost them\n{table}")
