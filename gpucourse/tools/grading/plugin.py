"""The pytest plugin of a grading run (`-p gpucourse.tools.grading.plugin`, active in the grading subprocess only).

It gives the graders what they share: the `points(n)` marker, the `submission` under test and the `timing` fixture;
and it writes every test's outcome to the JSON file the runner reads back.

Graders run through `gpucourse grade EXERCISE [--target ...]`, which sets GPUCOURSE_GRADE_TARGET to
'exercises', 'solutions', a folder or a file.

Timed criteria (a bandwidth, an overlap measured with clocks) go through the `timing` fixture, and
nowhere else: GPUCOURSE_GRADE_TIMING=report (what the test suite sets) still measures them and shows the
figure, but leaves the points to the functional checks, so CI never depends on how busy its machine is.
Learners' grading scores them (the default, GPUCOURSE_GRADE_TIMING=score).
"""
import json
import os
import re
from pathlib import Path

import pytest

from gpucourse.tools.exercises import target_file

TARGET_ENV = "GPUCOURSE_GRADE_TARGET"
RESULTS_ENV = "GPUCOURSE_GRADE_RESULTS"
TIMING_ENV = "GPUCOURSE_GRADE_TIMING"  # "score" (default) or "report"
BATCH_ENV = "GPUCOURSE_GRADE_BATCH"  # gradings that share their jobs' launches (records.Batch)
BATCH_FILE = "batch.json"  # in the batch folder: {"submissions": [absolute paths]}
SEED_ENV = "GPUCOURSE_GRADE_SEED"  # a grader that draws its cases at random (ex08_read_the_dumps) draws these
TARGETS_ENV = "GPUCOURSE_GRADE_TARGETS"  # several targets in one session, a JSON list (runner.grade_targets)
SUB_ID = "gpucourse-sub{}"  # the id of target number n in a test's name; taken out again in the outcomes
_SUB_IN_ID = re.compile(r"gpucourse-sub\d+-?|-?gpucourse-sub\d+")
REASON_CHARS = 300


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what a grader test is worth; `gpucourse grade` adds them up")


def _targets() -> list[str]:
    """What this session grades: GPUCOURSE_GRADE_TARGETS' list, else GPUCOURSE_GRADE_TARGET."""
    if os.environ.get(TARGETS_ENV):
        return json.loads(os.environ[TARGETS_ENV])
    return [os.environ[TARGET_ENV]] if os.environ.get(TARGET_ENV) else []


def pytest_generate_tests(metafunc):
    """Several targets: every test that grades a submission runs once per target (module-scoped, so a grader's
    module fixtures, its jobs among them, are set up once per target)."""
    if os.environ.get(TARGETS_ENV) and "submission" in metafunc.fixturenames:
        n = len(_targets())
        metafunc.parametrize("submission", range(n), indirect=True, scope="module", ids=map(SUB_ID.format, range(n)))


@pytest.fixture(scope="module")
def submission(request) -> Path:
    """The file under test for this grader's exercise (graders/ex01_ring_allreduce.py grades ex01_ring_allreduce).

    A missing file or a syntax error fails every test at once, with the reason, and launches nothing.
    """
    name = Path(request.module.__file__).stem
    targets = _targets()
    if not targets:
        pytest.fail("nothing to grade: run the graders with `gpucourse grade EXERCISE`", pytrace=False)
    path = target_file(targets[getattr(request, "param", 0)], name)
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
    the test's `note`, which gpucourse.tools.grading shows beside the result), scored or not."""

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


_outcomes: dict[str, dict] = {}
_collect_errors: list[str] = []


def _reason(report) -> str:
    """One line saying why a test did not pass."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        text = longrepr[2]
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr or "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else "failed"
    for prefix in ("Failed: ", "AssertionError: ", "Skipped: "):
        line = line.removeprefix(prefix)
    return line[:REASON_CHARS]


def plain_name(name: str) -> str:
    """The test's name without the target's id: test_x[gpucourse-sub3-2] -> test_x[2]."""
    base, bracket, params = name.partition("[")
    params = _SUB_IN_ID.sub("", params[:-1], count=1) if bracket else ""
    return f"{base}[{params}]" if params else base


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        marker = item.get_closest_marker("points")
        callspec = getattr(item, "callspec", None)
        _outcomes[item.nodeid] = {"file": str(item.path), "name": plain_name(item.name), "outcome": "not run",
                                  "reason": "", "max_score": float(marker.args[0]) if marker else 1.0,
                                  "duration": 0.0, "note": "",
                                  "sub": callspec.params.get("submission") if callspec else None}


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append(f"the grader {report.nodeid or 'session'} could not be collected: {_reason(report)}")


def pytest_runtest_logreport(report):
    rec = _outcomes.get(report.nodeid)
    if rec is None:
        return
    rec["duration"] += report.duration
    rec["note"] = dict(report.user_properties).get("note", rec["note"])  # a grader's record_property("note", ...)
    if rec["outcome"] in ("failed", "error", "skipped"):
        return  # the first thing that went wrong is the reason
    if report.failed:
        rec.update(outcome="failed" if report.when == "call" else "error", reason=_reason(report))
    elif report.skipped:
        rec.update(outcome="skipped", reason=_reason(report))
    elif report.when == "call":
        rec["outcome"] = "passed"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps({"tests": list(_outcomes.values()), "collect_errors": _collect_errors,
                                          "exitstatus": int(exitstatus)}, indent=1))


