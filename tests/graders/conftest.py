"""What every exercise grader shares: the `points` marker, the code under test, and "only when grading".

Graders run through `gpucourse grade EXERCISE [--target ...]`, which sets GPUCOURSE_GRADE_TARGET to
'exercises', 'solutions', a folder or a file. A plain `pytest tests/` skips them: the untouched
exercises are meant to fail.

Timed criteria (a bandwidth, an overlap measured with clocks) go through the `timing` fixture, and
nowhere else: GPUCOURSE_GRADE_TIMING=report (what the test suite sets) still measures them and shows the
figure, but leaves the points to the functional checks, so CI never depends on how busy its machine is.
Learners' grading scores them (the default, GPUCOURSE_GRADE_TIMING=score).
"""
import os
from pathlib import Path

import pytest

from gpucourse.exercises import target_file

TARGET_ENV = "GPUCOURSE_GRADE_TARGET"
TIMING_ENV = "GPUCOURSE_GRADE_TIMING"  # "score" (default) or "report"
collect_ignore_glob = ["mutants"]  # wrong submissions graded by tests/test_mutants.py, never test files


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what a grader test is worth; `gpucourse grade` adds them up")


@pytest.fixture(scope="session", autouse=True)
def _only_when_grading():
    if not os.environ.get(TARGET_ENV):
        pytest.skip("exercise graders run through `gpucourse grade EXERCISE` (which sets GPUCOURSE_GRADE_TARGET)")


@pytest.fixture(scope="module")
def submission(request) -> Path:
    """The file under test for this grader's exercise (test_ex01_ring_allreduce.py grades ex01_ring_allreduce).

    A missing file or a syntax error fails every test at once, with the reason, and launches nothing.
    """
    name = Path(request.module.__file__).stem.removeprefix("test_")
    path = target_file(os.environ[TARGET_ENV], name)
    if not path.is_file():
        pytest.fail(f"nothing to grade: {path} not found", pytrace=False)
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as err:
        pytest.fail(f"{path.name} has a syntax error at line {err.lineno}: {err.msg}", pytrace=False)
    except ValueError as err:  # e.g. null bytes
        pytest.fail(f"{path.name} cannot be compiled: {err}", pytrace=False)
    return path


class Timing:
    """Judges one test's timed criterion; see the module docstring. The figure always reaches the report (as
    the test's `note`, which gpucourse.grading shows beside the result), scored or not."""

    def __init__(self, record_property, mode: str):
        self.record, self.scored = record_property, mode != "report"

    def check(self, ok: bool, figure: str, hint: str = "") -> None:
        """`figure`: what was measured against what bound. Fails the test when it misses and timing is scored.

        Call it after the functional checks of the same test: those always decide, in either mode."""
        self.record("note", f"timing: {figure}" if self.scored else f"timing: reported, not scored: {figure}")
        if self.scored and not ok:
            pytest.fail(f"{figure}; {hint}" if hint else figure, pytrace=False)


@pytest.fixture
def timing(record_property) -> Timing:
    return Timing(record_property, os.environ.get(TIMING_ENV, "score"))
