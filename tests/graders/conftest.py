"""What every exercise grader shares: the `points` marker, the code under test, and "only when grading".

Graders run through `gpucourse grade EXERCISE [--target ...]`, which sets GPUCOURSE_GRADE_TARGET to
'exercises', 'solutions', a folder or a file. A plain `pytest tests/` skips them: the untouched
exercises are meant to fail.
"""
import os
from pathlib import Path

import pytest

from gpucourse.exercises import target_file

TARGET_ENV = "GPUCOURSE_GRADE_TARGET"


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
