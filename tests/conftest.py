"""Fixtures every test shares, and the guarantee that no test leaves a process behind, even when it fails.

Every process a test starts inherits PYTEST_PROCESS_OWNER="<session token>/<test number>" (the launcher's
agents and ranks, kernels, servers, `gpucourse grade`'s pytest and its jobs: all copy os.environ). After
each test its survivors are killed; on a passing test they are an error. At the end of the session (of
each xdist worker) nothing it started may be running any more.
"""
import fcntl
import itertools
import json
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from gpucourse.run.contract import RUN_DIR_ENV, RUNS_ENV
from gpucourse.tools.grading.plugin import RESULTS_ENV
from gpucourse.run.procs import terminate

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Every test writes its runs into its own folder (parallel tests never share one)."""
    path = tmp_path / "runs"
    monkeypatch.setenv(RUNS_ENV, str(path))
    return path


def run_processes(run_dir) -> list[psutil.Process]:
    """Live processes belonging to a run: the launcher puts GPUCOURSE_RUN_DIR in the agent's and workers' env."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(RUN_DIR_ENV) == str(run_dir) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def listening_ports(pids) -> list:
    pids = set(pids)
    return [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


@pytest.fixture
def python():
    return sys.executable


# --- no process outlives its test -------------------------------------------------------------------
OWNER_ENV = "PYTEST_PROCESS_OWNER"
EXIT_GRACE_S = 5  # a process the test has just stopped may need a moment to go; only leaks ever wait for it
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")  # live as long as this process
_test_numbers = itertools.count()


def _owned(env: dict, token: str, dirs) -> bool:
    """Started under `token` (or a token below it), or running a run, or serving runs, under one of `dirs`."""
    owner = env.get(OWNER_ENV, "")
    if owner == token or owner.startswith(token + "/"):
        return True
    runs = [env[k] for k in (RUN_DIR_ENV, RUNS_ENV) if env.get(k)]
    return any(Path(r).is_relative_to(d) for r in runs for d in dirs)


def survivors(token: str, since: float, dirs=(), extra=()) -> list[psutil.Process]:
    """Live processes started since `since` that are `token`'s by their environment (see _owned), and `extra`;
    never this process, nor multiprocessing's helpers (they end with it).

    A longer-scoped fixture's processes (a server kept for a module) are safe: they started before the test,
    under the session's token, and what they start later inherits theirs."""
    found = list(extra)
    for proc in psutil.process_iter(["create_time"]):
        if proc.pid == os.getpid() or (proc.info["create_time"] or 0) < since - 2:  # create times: to the second
            continue
        try:
            if _owned(proc.environ(), token, dirs):
                found.append(proc)
        except psutil.Error:
            continue
    alive = []
    for proc in {p.pid: p for p in found}.values():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(proc.cmdline()) for h in HELPERS):
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def _kill_survivors(procs: list[psutil.Process]) -> str:
    """Give `procs` EXIT_GRACE_S to end by themselves, kill the rest; describe what had to be killed."""
    _, procs = psutil.wait_procs(procs, timeout=EXIT_GRACE_S)
    lines = []
    for proc in procs:
        try:
            lines.append(f"pid {proc.pid}: {' '.join(' '.join(proc.cmdline()).split())[:160]}")
        except psutil.Error:
            continue
    terminate(procs)
    return "; ".join(lines)


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_session(tmp_path_factory):
    """This pytest process's token. At the end (each xdist worker checks its own), its descendants, processes
    with its token and runs under its temp dir must all be gone: any left are killed and fail the session.

    Inside `gpucourse grade`'s own pytest nothing is checked: the test that started the grading owns its jobs."""
    if os.environ.get(RESULTS_ENV):
        yield None
        return
    parent = os.environ.get(OWNER_ENV)
    token = f"{parent + '/' if parent else ''}pytest-{os.getpid()}-{time.time_ns()}"
    base, start = tmp_path_factory.getbasetemp(), time.time()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(OWNER_ENV, token)
        yield token
    left = survivors(token, start, [base], extra=psutil.Process().children(recursive=True))
    if left and (listing := _kill_survivors(left)):
        pytest.fail(f"processes of this test session were still running at its end (killed now): {listing}",
                    pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.passed_call = report.passed  # read by _no_process_outlives_its_test
    return report


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(request, _no_process_outlives_the_session):
    """Kill what this test (or its function-scoped fixtures) started that still runs once they have all ended.

    A leak after a passing test is an error; after a failing one, a warning (the failure says what went wrong)."""
    session = _no_process_outlives_the_session
    if session is None:
        yield
        return
    token, start = f"{session}/{next(_test_numbers)}", time.time()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(OWNER_ENV, token)
        yield
    tmp = request.node.funcargs.get("tmp_path")
    left = survivors(token, start, [tmp] if tmp else [])
    if left and (listing := _kill_survivors(left)):
        message = f"processes this test started outlived it (killed now): {listing}"
        if getattr(request.node, "passed_call", False):
            pytest.fail(message, pytrace=False)
        warnings.warn(pytest.PytestWarning(message))


# --- gradings that share their launches ---------------------------------------------------------------------
BATCH_TIMEOUT_S = 3600  # the first grading of an exercise launches its whole batch
# Other submissions an exercise's batch grades, after its mutants: tests/submissions/<exercise>/<name>.py, whose
# report is graded_batch(exercise)[name]
SUBMISSIONS = Path(__file__).resolve().parent / "submissions"


# Graders whose launches a chapter's smoke run makes anyway, at the grader's sizes: CI grades the batch on that
# chapter's records (the same xdist worker runs both) instead of launching them again.
CHAPTER_RECORDS = {"ex13_silent_bugs": "13_3d_parallel_and_silent_bugs"}


def graded(exercise: str) -> list:
    """The marks of a slow test that grades `exercise` through its batch: the batch's xdist group (its chapter's,
    where the batch reads the chapter's records), and room for the batch's launch."""
    group = chapter(CHAPTER_RECORDS[exercise]) if exercise in CHAPTER_RECORDS else [
        pytest.mark.xdist_group(f"grade-{exercise}")]
    return [pytest.mark.slow, *group, pytest.mark.timeout(BATCH_TIMEOUT_S)]


def ex13_records_from_chapter(folder: Path, smoke_chapter) -> None:
    """Give ex13's batch chapter 13's five launches' records: the 3-D run and the three 1-D controls, each checked
    to have the grader's arguments (the same sizes, layout and bugs; the data seed the script's default, 0)."""
    import importlib.util

    from gpucourse.tools.grading.graders import ex13_silent_bugs as grader

    result, runs = smoke_chapter(ROOT / "notebooks" / f"{CHAPTER_RECORDS['ex13_silent_bugs']}.ipynb")
    assert result.status == "ok", f"chapter 13 failed in cell {result.failing_cell}: {result.error}"
    spec = importlib.util.spec_from_file_location("gpt_3d", grader.SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def meaning(argv):
        args = vars(script.parse_args(argv))
        return {**{k: v for k, v in args.items() if k != "record"}, "bug": sorted(args["bug"])}

    records = folder / "ex13"
    records.mkdir()
    for layout in grader.LAYOUTS:
        run = chapter_run(runs, "13-gpt-3d" if layout == "3d" else f"13-control-{layout}")
        given = json.loads((run.run_dir / "manifest.json").read_text())["args"]
        assert run.ok and meaning(given) == meaning(grader.job(layout, records, 0)["args"]), (
            f"chapter 13's {run.run_dir.name} is not what ex13's grader launches: {given}")
        (records / layout).symlink_to(run.run_dir / "records")
    (folder / f"{grader.RECORDS_KEY}.json").write_text(json.dumps({"seed": 0, "folder": str(records), "error": None}))


@pytest.fixture(scope="session")
def grade_batch(tmp_path_factory, smoke_chapter):
    """batch(exercise) -> a folder for $GPUCOURSE_GRADE_BATCH: every grading of that exercise in this session
    (its solution, its untouched exercise, each mutant, any of SUBMISSIONS, and the solution again after them)
    shares one launch per job (gpucourse/tools/grading/records.py, Batch). Tests that use it run in the xdist
    group `grade-<exercise>` (or its chapter's: CHAPTER_RECORDS), so one worker launches each batch; the folder is
    shared by the session's workers."""
    from gpucourse import exercises
    from gpucourse.tools.grading.plugin import BATCH_FILE
    from tests.mutants import all_mutants

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "grade-batches"
    root.mkdir(exist_ok=True)

    def batch(exercise: str) -> Path:
        folder = root / exercise
        with open(root / f"{exercise}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / BATCH_FILE).exists():
                folder.mkdir(exist_ok=True)
                solution = exercises.solution_files()[exercise]
                files = [solution, exercises.exercises_dir() / solution.name]
                for mutant in all_mutants().get(exercise, []):
                    path = folder / mutant.name / solution.name
                    path.parent.mkdir()
                    path.write_text(mutant.apply(solution.read_text()))
                    files.append(path)
                for extra in sorted((SUBMISSIONS / exercise).glob("*.py")):
                    path = folder / extra.stem / solution.name
                    path.parent.mkdir()
                    path.write_text(extra.read_text())
                    files.append(path)
                again = folder / "solution_after_the_mutants" / solution.name
                again.parent.mkdir()
                again.write_text(solution.read_text())
                files.append(again)
                if exercise in CHAPTER_RECORDS:
                    ex13_records_from_chapter(folder, smoke_chapter)
                (folder / BATCH_FILE).write_text(json.dumps({"submissions": [str(f.resolve()) for f in files]}))
        return folder

    return batch


@pytest.fixture(scope="session")
def graded_batch(grade_batch):
    """graded_batch(exercise) -> {submission: GradeReport} for every submission of the exercise's batch, named by
    its folder ("solutions", "exercises", each mutant's name, "solution_after_the_mutants"): all graded in one
    pytest run (runner.grade_targets) over the batch's shared launches, the reports kept in the batch's folder for
    every worker. Call it with GPUCOURSE_GRADE_TIMING=report set, as every grading of the suite is."""
    from gpucourse.tools.grading.plugin import BATCH_FILE
    from gpucourse.tools.grading.runner import GradeReport, grade_targets

    def reports(exercise: str) -> dict:
        folder = grade_batch(exercise)
        done = folder / "reports.json"
        with open(folder.parent / f"{exercise}.reports.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                subs = [Path(s) for s in json.loads((folder / BATCH_FILE).read_text())["submissions"]]
                got = grade_targets(exercise, [exercise], [(s, {exercise: s}) for s in subs],
                                    timeout=BATCH_TIMEOUT_S, batch=folder)
                done.write_text(json.dumps({s.parent.name: r.to_dict() for s, r in zip(subs, got)}))
        return {name: GradeReport.from_dict(d) for name, d in json.loads(done.read_text()).items()}

    return reports


# --- the `gpucourse` command --------------------------------------------------------------------------------
def run_cli(*args, timeout=120, env=None, cwd=None) -> subprocess.CompletedProcess:
    """`gpucourse ARGS...` as a learner types it (python -m gpucourse.tools.cli), its output captured as UTF-8 text.
    `env` is added to this process's environment (which holds $GPUCOURSE_RUNS_DIR under the runs_dir fixture)."""
    return subprocess.run([sys.executable, "-m", "gpucourse.tools.cli", *map(str, args)], capture_output=True,
                          text=True, encoding="utf-8", env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout)


# --- launches that several tests read -----------------------------------------------------------------------
def chapter(stem: str) -> list:
    """Marks for a test that reads chapter `stem`'s smoke run (`smoke_chapter`): one xdist worker runs them all,
    so the chapter is executed once."""
    from gpucourse.tools.course import chapter_key

    return [pytest.mark.xdist_group(f"chapter-{chapter_key(stem + '.ipynb')}")]


def chapter_run(folder: Path, name: str):
    """The run `name` (a launch's name=) of a chapter's smoke run, loaded: exactly one must be in `folder`."""
    import re

    from gpucourse.run.result import load_run

    found = [d for d in folder.glob(f"{name}-*") if re.fullmatch(rf"{name}-\d{{8}}-\d{{6}}(-\d+)?", d.name)]
    assert len(found) == 1, f"the chapter's smoke run made {len(found)} runs named {name} (see its smoke test)"
    return load_run(found[0])


@pytest.fixture(scope="session")
def smoke_chapter(tmp_path_factory):
    """smoke_chapter(path) -> (NotebookRun, runs folder): the chapter executed at its smoke sizes from a learner's
    copy (`gpucourse workspace`, what `make lab` opens: a folder beside notebooks/), once per session; its runs
    are in the folder for every test that reads them (mark those tests `chapter(...)`)."""
    import shutil

    from gpucourse.tools.course import chapter_key, execute_notebook
    from gpucourse.tools.workspace import sync

    done = {}

    def run(path: Path):
        if path not in done:
            folder = tmp_path_factory.mktemp(f"chapter-{chapter_key(path)}")
            mywork = ROOT / f"mywork-test-{os.getpid()}"
            try:
                with pytest.MonkeyPatch.context() as env:
                    env.setenv(RUNS_ENV, str(folder / "runs"))  # the kernel, and so its launches, inherit it
                    sync(mywork, [path])
                    done[path] = (execute_notebook(mywork / path.name, folder / "executed", smoke=True,
                                                   cell_timeout=600), folder / "runs")
            finally:
                shutil.rmtree(mywork, ignore_errors=True)
        return done[path]

    return run


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """launched(start, *jobs, parallel=1) -> [start(job) for job in jobs], each job started once per session.

    `start` is a module-level function that launches `job` (gpucourse.launch) and returns its result; its name
    and the job are the key. The first test that needs a job launches it (the missing ones `parallel` at a time),
    later tests read its result. The runs go to one folder in the session's temp dir, and none may leave a
    process behind once launch() has returned (checked here).

    A launch belongs to the test that asks for it (_no_process_outlives_its_test checks what it started), or to
    the session when a module-scoped fixture asks (_no_process_outlives_the_session). Under pytest-xdist a
    session fixture is set up once per worker: a job that tests on two workers need is launched on each."""
    runs, results = tmp_path_factory.mktemp("launched"), {}

    def launched(start, *jobs, parallel=1) -> list:
        assert "<" not in start.__qualname__, f"{start.__qualname__}: give a module-level function (it is the key)"
        keys = {job: (start.__module__, start.__qualname__, job) for job in jobs}
        missing = [job for job in dict.fromkeys(jobs) if keys[job] not in results]
        with pytest.MonkeyPatch.context() as env, ThreadPoolExecutor(parallel) as pool:
            env.setenv(RUNS_ENV, str(runs))  # os.environ is the process's: launch() reads it in the pool's threads
            for job, res in zip(missing, pool.map(start, missing)):
                results[keys[job]] = res
                assert run_processes(res.run_dir) == [], f"{res.run_dir.name} left processes behind"
        return [results[keys[job]] for job in jobs]

    return launched
