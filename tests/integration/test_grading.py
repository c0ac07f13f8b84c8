"""The grading system: exercises/ generated from solutions/, exercise ids, bad input, report formats, and
real grading runs (solutions get full marks, the untouched exercises zero, a class gets a CSV)."""
import ast
import json
import re
import textwrap
from pathlib import Path
from functools import partial
from types import SimpleNamespace

import psutil
import pytest

from gpucourse import exercises, grading
from gpucourse.tools.exercises import ExerciseError, generate_exercises, render_exercise, resolve
from gpucourse.tools.grading.plugin import BATCH_ENV, BATCH_FILE, TIMING_ENV, plain_name
from gpucourse.tools.grading.records import JobRecords, job_module, raw
from tests.conftest import BATCH_TIMEOUT_S, graded, run_cli

SOLUTION = exercises.solutions_dir() / "ex01_ring_allreduce.py"
EXERCISE = exercises.exercises_dir() / "ex01_ring_allreduce.py"


@pytest.fixture(autouse=True)
def _timing_reported_not_scored(monkeypatch):
    """CI must not depend on how busy its machine is: the grading runs here still measure the graders' timed
    criteria and show the figures, but do not score them; the functional checks decide every point.
    Learners' `gpucourse grade` scores timing too (the default)."""
    monkeypatch.setenv(TIMING_ENV, "report")


# `gpucourse ARGS...` (cli.py wires grading.add_cli) from the course root, with room for a grading's launches
cli = partial(run_cli, timeout=600, cwd=exercises.course_root())


# --- exercises/ from solutions/ -------------------------------------------------------------------
SOURCE = textwrap.dedent('''\
    """Task: add things. Rules: no cheating."""


    def add(a, b):
        """Return a + b."""
        ### BEGIN SOLUTION
        ### HINT: use the + operator
        return a + b
        ### END SOLUTION


    class Box:
        def size(self):
            if True:
                ### BEGIN SOLUTION
                return 3
                ### END SOLUTION
            return 0
    ''')


def test_blocks_become_stubs_at_their_indentation_with_their_hint():
    out = render_exercise(SOURCE)
    lines = out.splitlines()
    assert '    # YOUR CODE HERE' in lines and '    raise NotImplementedError("use the + operator")' in lines
    assert '            # YOUR CODE HERE' in lines
    assert f'            raise NotImplementedError("{exercises.DEFAULT_HINT}")' in lines
    assert "return a + b" not in out and "return 3" not in out and "SOLUTION" not in out and "HINT" not in out
    assert '"""Task: add things. Rules: no cheating."""' in out and '"""Return a + b."""' in out
    assert "        return 0" in lines  # code after a block is kept
    namespace = {}
    exec(compile(out, "<exercise>", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^use the \+ operator$"):
        namespace["add"](1, 2)


def test_hint_quotes_are_escaped():
    src = 'def f():\n    ### BEGIN SOLUTION\n    ### HINT: say "hi" \\ bye\n    pass\n    ### END SOLUTION\n'
    namespace = {}
    exec(render_exercise(src), namespace)
    with pytest.raises(NotImplementedError) as err:
        namespace["f"]()
    assert str(err.value) == 'say "hi" \\ bye'


def test_buggy_blocks_hand_out_their_code_unmarked():
    """A "fix the bug" exercise (ex09): the block's ### BUGGY: lines, at the block's indentation plus their own,
    replace the fixed code; no stub, no marker says where the bug is."""
    src = textwrap.dedent('''\
        def rows(rank, group, per):
            start = 0
            ### BEGIN SOLUTION
            ### BUGGY: if rank:
            ### BUGGY:     start = rank * per
            start = group * per
            ### END SOLUTION
            return slice(start, start + per)
        ''')
    out = render_exercise(src)
    assert out == ("def rows(rank, group, per):\n    start = 0\n    if rank:\n        start = rank * per\n"
                   "    return slice(start, start + per)\n")
    namespace = {}
    exec(compile(out, "<exercise>", "exec"), namespace)
    assert namespace["rows"](3, 1, 2) == slice(6, 8)  # the bug runs
    with pytest.raises(ExerciseError, match="x.py:2: a block with ### BUGGY: lines hands out code, not a stub"):
        render_exercise("def f():\n    ### BEGIN SOLUTION\n    ### HINT: h\n    ### BUGGY: return 1\n"
                        "    return 2\n    ### END SOLUTION\n", "x.py")


def test_the_generated_header_says_what_to_do():
    texts = {name: (exercises.exercises_dir() / f"{name}.py").read_text() for name in exercises.solution_files()}
    assert "find and fix what the docstring describes" in texts["ex09_fix_2d"]
    assert "fill in every `# YOUR CODE HERE`" in texts["ex03_predict_scaling"]


@pytest.mark.parametrize("src, where", [
    ("def f():\n    ### BEGIN SOLUTION\n    pass\n", "x.py:2: BEGIN SOLUTION is never closed"),
    ("def f():\n    ### END SOLUTION\n", "x.py:2: END SOLUTION without a BEGIN"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n",
     "x.py:3: BEGIN SOLUTION inside the block opened at line 2"),
])
def test_broken_markers_name_file_and_line(src, where):
    with pytest.raises(ExerciseError, match=where):
        render_exercise(src, "x.py")


def test_generate_writes_then_detects_stale_and_orphans(tmp_path):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    (sol / "ex07_add.py").write_text(SOURCE)
    (sol / "helper.py").write_text("x = 1\n")  # not an exercise: ignored
    assert generate_exercises(check=True, solutions=sol, exercises=ex) == [ex / "ex07_add.py"]
    assert not ex.exists()  # check changes nothing
    assert generate_exercises(solutions=sol, exercises=ex) == [ex / "ex07_add.py"]
    assert sorted(p.name for p in ex.iterdir()) == ["ex07_add.py"]
    assert generate_exercises(check=True, solutions=sol, exercises=ex) == []
    (sol / "ex07_add.py").write_text(SOURCE.replace("a + b", "b + a"))
    assert generate_exercises(check=True, solutions=sol, exercises=ex) == [ex / "ex07_add.py"]
    generate_exercises(solutions=sol, exercises=ex)
    (ex / "ex08_mine.py").write_text("# a learner's own file: not generated, so never deleted\n")
    (sol / "ex07_add.py").rename(sol / "ex07_plus.py")
    stale = generate_exercises(solutions=sol, exercises=ex)
    assert set(stale) == {ex / "ex07_plus.py", ex / "ex07_add.py"}
    assert sorted(p.name for p in ex.iterdir()) == ["ex07_plus.py", "ex08_mine.py"]


def test_exercises_folder_is_up_to_date_with_solutions():
    stale = generate_exercises(check=True)
    assert stale == [], f"stale: {stale}; run `gpucourse make-exercises` and commit exercises/"


def test_ex01_exercise_keeps_the_task_and_raises_the_hint():
    sol, ex = ast.parse(SOLUTION.read_text()), ast.parse(EXERCISE.read_text())
    assert ast.get_docstring(ex) == ast.get_docstring(sol) and "Rules" in ast.get_docstring(ex)
    fn = {n.name: n for n in ex.body if isinstance(n, ast.FunctionDef)}["ring_all_reduce"]
    assert "in place" in ast.get_docstring(fn)
    assert isinstance(fn.body[-1], ast.Raise) and "reduce-scatter" in ast.unparse(fn.body[-1])


def test_make_exercises_check_cli_lists_what_is_stale():
    stale = generate_exercises(check=True)  # others may be mid-way through a chapter: compare, don't assume
    done = cli("make-exercises", "--check")
    assert done.returncode == (1 if stale else 0), done.stderr
    assert all(f"stale: exercises/{p.name}" in done.stdout for p in stale)
    assert ("up to date" in done.stdout) == (not stale)


# --- exercise ids and targets ---------------------------------------------------------------------
@pytest.mark.parametrize("given", ["ex01", "EX01", "ex1", "ex01_ring_allreduce", "ex01_ring_allreduce.py"])
def test_ids_resolve_to_the_chapter_exercises(given):
    assert resolve(given) == ["ex01_ring_allreduce"]


@pytest.mark.parametrize("given", ["ex99", "ring", "ex01_ring", ""])
def test_unknown_id_names_the_known_ones(given):
    with pytest.raises(ExerciseError, match="unknown exercise .*known exercises: .*ex01_ring_allreduce"):
        resolve(given)


def test_required_names_come_from_the_solution():
    assert exercises.required_names("ex01_ring_allreduce") == ["ring_all_reduce"]


def test_target_checks(tmp_path):
    assert exercises.check_target("solutions", ["ex01_ring_allreduce"]) == {"ex01_ring_allreduce": SOLUTION}
    with pytest.raises(ExerciseError, match="does not exist"):
        exercises.check_target(tmp_path / "nowhere", ["ex01_ring_allreduce"])
    with pytest.raises(ExerciseError, match="ex01_ring_allreduce.py not found"):
        exercises.check_target(tmp_path, ["ex01_ring_allreduce"])
    wrong = tmp_path / "ex01_ring_allreduce.py"
    wrong.write_text("def ring_allreduce(t):\n    return t\n")
    with pytest.raises(ExerciseError, match="does not define ring_all_reduce"):
        exercises.check_target(tmp_path, ["ex01_ring_allreduce"])
    wrong.write_text("def ring_all_reduce(t)\n")  # a syntax error is graded (zero), not refused
    assert exercises.check_target(wrong, ["ex01_ring_allreduce"]) == {"ex01_ring_allreduce": wrong}


@pytest.mark.parametrize("args, message", [
    (["grade", "ex99"], "unknown exercise 'ex99'"),
    (["grade", "ex01", "--target", "/no/such/dir"], "target /no/such/dir does not exist"),
    (["grade", "ex01", "--class", "/no/such/dir"], "--class needs --csv"),
    (["grade", "ex01", "--class", "/no/such/dir", "--csv", "/tmp/x.csv"],
     "submissions folder /no/such/dir does not exist"),
    # {tmp} holds keep.txt, an empty folder empty/, a class class/alice/ and done-details/alice.json
    (["grade", "ex01", "--class", "{tmp}/empty", "--csv", "{tmp}/g.csv"], "{tmp}/empty has no learner folders"),
    (["grade", "ex01", "--class", "{tmp}/keep.txt", "--csv", "{tmp}/g.csv"], "keep.txt is a file, not a folder"),
    (["grade", "ex01", "--class", "{tmp}/class", "--csv", "{tmp}/nodir/g.csv"],
     "--csv {tmp}/nodir/g.csv: the folder {tmp}/nodir does not exist: create it, or choose another"),
    (["grade", "ex01", "--class", "{tmp}/class", "--csv", "{tmp}/keep.txt"],
     "--csv {tmp}/keep.txt already exists: choose a new file name, or move the old file away"),
    (["grade", "ex01", "--class", "{tmp}/class", "--csv", "{tmp}/done.csv"],
     "{tmp}/done-details already exists (an earlier grading?)"),
    (["grade", "ex01", "--class", "{tmp}/class", "--csv", "{tmp}/g.csv", "--json", "{tmp}/r.json"],
     "--class grades every learner's folder: leave out --target, --json and --gradescope"),
    (["grade", "ex01", "--csv", "{tmp}/g.csv"], "--csv goes with --class SUBMISSIONS_DIR"),
    (["grade", "ex01", "--json", "{tmp}/keep.txt"], "--json {tmp}/keep.txt already exists"),
    (["grade", "ex01", "--gradescope", "{tmp}/nodir/results.json"], "the folder {tmp}/nodir does not exist"),
    (["grade", "ex01", "--json", "{tmp}/r.json", "--gradescope", "{tmp}/r.json"], "name the same file"),
    (["grade", "ex01", "--bogus"], "unrecognized arguments: --bogus"),
    (["grade", "ex08_read_the_dumps", "--seed", "-1"], "--seed -1: give a whole number >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "keep.txt").write_text("keep me")
    for folder in ("empty", "class/alice", "done-details"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "done-details" / "alice.json").write_text("{}")
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    done = cli(*(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr
    message = message.format(tmp=tmp_path)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before  # nothing written


@pytest.mark.parametrize("kwargs, message", [
    ({"exercise": None}, "exercise must be an id like 'ex01' or a full name, not None"),
    ({"exercise": "ex01", "target": None}, "target must be 'exercises', 'solutions' or a path, not None"),
    ({"exercise": "ex01", "timeout": 0}, "timeout must be a positive number of seconds, not 0"),
    ({"exercise": "ex01", "timeout": "1h"}, "timeout must be a positive number of seconds, not '1h'"),
])
def test_bad_grade_calls_raise_before_grading(kwargs, message):
    with pytest.raises(ExerciseError, match=re.escape(message)):
        grading.grade(**kwargs)


# --- the pytest plugin and the report formats ------------------------------------------------------
def test_plugin_scores_points_and_keeps_one_line_reasons(tmp_path):
    (tmp_path / "conftest.py").write_text("def pytest_configure(config):\n"
                                          "    config.addinivalue_line('markers', 'points(n): points')\n")
    (tmp_path / "test_demo.py").write_text(textwrap.dedent('''\
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture broke")

        @pytest.mark.points(3)
        def test_ok():
            pass

        @pytest.mark.points(2)
        def test_assert():
            assert 1 == 2, "one is not two\\nsecond line"

        def test_fail():
            pytest.fail("short reason", pytrace=False)

        def test_error(broken):
            pass

        def test_skip():
            pytest.skip("not today")
        '''))
    data, output = grading.run_pytest([tmp_path / "test_demo.py"], {}, timeout=120)
    assert data is not None, output
    got = {t["name"]: (t["outcome"], t["max_score"], t["reason"]) for t in data["tests"]}
    assert got == {"test_ok": ("passed", 3.0, ""), "test_assert": ("failed", 2.0, "one is not two"),
                   "test_fail": ("failed", 1.0, "short reason"),
                   "test_error": ("error", 1.0, "RuntimeError: fixture broke"),
                   "test_skip": ("skipped", 1.0, "not today")}


def test_timed_criteria_are_scored_by_default_and_only_reported_in_ci(tmp_path, monkeypatch):
    """The graders' `timing` fixture: a missed bound fails the test by default; with timing=report the figure
    is still shown, and the points follow the functional checks alone (a wrong result still loses them)."""
    (tmp_path / "test_timed.py").write_text(textwrap.dedent('''\
        def test_slow(timing):
            timing.check(False, "0.10x gloo's, needs >= 0.25x", "no Python loops")

        def test_fast(timing):
            timing.check(True, "0.80x gloo's, needs >= 0.25x")

        def test_wrong_and_slow(timing):
            assert 1 == 2, "wrong sum"
            timing.check(False, "0.10x gloo's, needs >= 0.25x")
        '''))
    got = {}
    for mode in ("score", "report"):
        monkeypatch.setenv(TIMING_ENV, mode)
        data, output = grading.run_pytest([tmp_path / "test_timed.py"], {}, timeout=120)
        assert data is not None, output
        got[mode] = {t["name"]: (t["outcome"], t["reason"] or t["note"]) for t in data["tests"]}
    assert got["score"] == {"test_slow": ("failed", "0.10x gloo's, needs >= 0.25x; no Python loops"),
                            "test_fast": ("passed", "timing: 0.80x gloo's, needs >= 0.25x"),
                            "test_wrong_and_slow": ("failed", "wrong sum")}
    note = "timing: reported, not scored: {}x gloo's, needs >= 0.25x"
    assert got["report"] == {"test_slow": ("passed", note.format("0.10")), "test_fast": ("passed", note.format("0.80")),
                             "test_wrong_and_slow": ("failed", "wrong sum")}


def make_report():
    report = grading.GradeReport("ex01", "solutions", {"ex01_ring_allreduce": "x.py"}, duration=12.5)
    report.tests = [grading.TestOutcome("ex01_ring_allreduce", "test_a", 2, "passed"),
                    grading.TestOutcome("ex01_ring_allreduce", "test_b[3]", 1, "failed", "wrong <sum>")]
    return report


def test_gradescope_format():
    out = json.loads(json.dumps(make_report().to_gradescope()))
    assert out["score"] == 2 and out["max_score"] == 3 and out["execution_time"] == 12.5
    assert out["tests"] == [
        {"name": "ex01_ring_allreduce: test_a", "score": 2, "max_score": 2, "status": "passed", "output": ""},
        {"name": "ex01_ring_allreduce: test_b[3]", "score": 0, "max_score": 1, "status": "failed",
         "output": "wrong <sum>"}]


def test_table_and_html_show_points_and_reasons():
    report = make_report()
    table = report.table()
    assert "test_b[3]" in table and "0/1" in table and "wrong <sum>" in table and "2/3" in table
    html = report._repr_html_()
    assert "<table>" in html and "wrong &lt;sum&gt;" in html and "2 / 3 points" in html


def test_a_syntax_error_is_graded_zero_with_the_error(tmp_path, monkeypatch):
    """Also: the caller's own pytest options (PYTEST_ADDOPTS, PYTEST_PLUGINS: an instructor's shell, a test run
    measuring itself) do not reach the graders' pytest: a plugin it cannot import would stop every grading."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no_such_plugin_of_the_caller")
    monkeypatch.setenv("PYTEST_PLUGINS", "no_such_plugin_of_the_caller")
    bad = tmp_path / "ex01_ring_allreduce.py"
    bad.write_text("def ring_all_reduce(tensor)\n    return tensor\n")
    report = grading.grade("ex01", bad)
    assert not report.problems, report.problems
    assert report.tests and report.score == 0 and report.max_score > 0
    assert all("syntax error at line 1" in t.reason for t in report.tests)


def test_job_records_carry_the_graders_own_facts(tmp_path):
    """Every record, made-up ones included, carries the run folder, the rank and the world size the grader
    launched, whatever the rank wrote: the tests judge with them (ex04's plan, ex07's and ex10's byte limits)."""
    plan = {"case": "plan", "cases": {"a": "a"}, "sub": 1}
    forged = {"case": "a", "rank": 5, "world": 99, "run_dir": "/elsewhere", "error": None, "sub": 1}
    other = {"case": "a", "error": "another submission's record", "sub": 0}
    killed = {"case": "exit", "code": -9, "sub": 1}  # how rank 1's process for submission 1 ended
    result = SimpleNamespace(run_dir=tmp_path, metrics={0: [other, plan, forged], 1: [plan, other, killed]},
                             returncodes={1: 0}, error=None, status="ok")
    job = JobRecords(result, 3, sub=1)
    first, killed, silent = job.ranks("a")
    assert (first["rank"], first["world"], first["run_dir"], first["sub"]) == (0, 3, tmp_path, 1)
    assert first["error"] is None
    assert (killed["rank"], killed["world"], killed["peer_lost"]) == (1, 3, True)
    assert (silent["rank"], silent["world"], silent["ended"]) == (2, 3, True)
    assert [(rec["world"], rec["error"].startswith("not run")) for rec in job.ranks("b")] == [(3, True)]


# --- real grading runs ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", [pytest.param("ex01_ring_allreduce", marks=graded("ex01_ring_allreduce"))])
def test_solutions_get_full_marks_and_gradescope_file(name, tmp_path, grade_batch, monkeypatch):
    monkeypatch.setenv(BATCH_ENV, str(grade_batch(name)))
    gs, js = tmp_path / "results.json", tmp_path / "grade.json"
    done = cli("grade", "ex01", "--target", "solutions", "--gradescope", str(gs), "--json", str(js),
               timeout=BATCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(gs.read_text())
    assert results["max_score"] > 0 and results["score"] == results["max_score"], done.stdout
    assert len(results["tests"]) >= 10 and all(t["score"] == t["max_score"] for t in results["tests"])
    assert json.loads(js.read_text())["passed"] == len(results["tests"])
    assert "test_bus_bandwidth_vs_gloo" in done.stdout
    assert "timing: reported, not scored: busbw" in done.stdout  # measured and shown, not scored (see above)


@pytest.mark.parametrize("name", [pytest.param("ex01_ring_allreduce", marks=graded("ex01_ring_allreduce"))])
def test_untouched_exercises_get_zero_on_every_test(name, graded_batch):
    report = graded_batch(name)["exercises"]
    assert report.max_score > 0 and report.tests and not report.problems
    assert [t.name for t in report.tests if t.score] == []
    hint = "NotImplementedError: split tensor.view(-1)"
    assert sum(hint in t.reason for t in report.tests) >= len(report.tests) - 1, report.table()


def job_processes(run_dir) -> list:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("GPUCOURSE_RUN_DIR", "") == str(run_dir):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("name", [pytest.param("ex01_ring_allreduce", marks=graded("ex01_ring_allreduce"))])
def test_misbehaving_code_is_graded_in_bounded_time_and_leaves_nothing(name, grade_batch, graded_batch):
    """tests/submissions/ex01_ring_allreduce/misbehaving.py, graded in ex01's batch after the mutants: what it did (a
    flood, a deadlock, a rank that leaves, an exception) costs its own points, each case stopped at its limit, and
    nothing of the next one's (test_mutants: the solution graded after it keeps full marks)."""
    report = graded_batch(name)["misbehaving"]
    reasons = {t.name: t.reason for t in report.tests}
    assert report.score == 0 and report.tests, report.table()
    assert "did not finish within" in reasons["test_matches_all_reduce[1]"]
    assert "did not finish within" in reasons["test_matches_all_reduce[2]"]
    assert "ended during this case" in reasons["test_matches_all_reduce[3]"]
    assert "ValueError: boom" in reasons["test_matches_all_reduce[4]"]
    launched = [json.loads(f.read_text()) for f in grade_batch(name).glob("*.json")]  # Batch.once's records
    runs = [Path(rec["run_dir"]) for rec in launched if isinstance(rec, dict) and set(rec) == {"run_dir"}]
    [flood_log] = [r / "logs" / "attempt0" / "rank0.stdout" for r in runs if r.name.startswith("grade-ex01-w1-")]
    assert flood_log.stat().st_size < 50_000  # the print loop was capped
    assert [p for r in runs for p in job_processes(r)] == []


OTHER_GRADED = [name for name in exercises.grader_files() if name != "ex01_ring_allreduce"]  # ex01: tests above


@pytest.mark.parametrize("name", [pytest.param(n, marks=graded(n)) for n in OTHER_GRADED])
def test_every_grader_gives_solutions_full_marks_and_untouched_exercises_zero(name, graded_batch):
    solved, untouched = (graded_batch(name)[target] for target in ("solutions", "exercises"))
    assert solved.max_score > 0 and solved.score == solved.max_score, solved.table()
    assert untouched.tests and [t.name for t in untouched.tests if t.score] == [], untouched.table()


@pytest.mark.parametrize("name", [pytest.param("ex09_fix_2d", marks=graded("ex09_fix_2d"))])
def test_ex09_untouched_shows_what_its_docstring_says(name, grade_batch, graded_batch):
    """ex09 hands out a buggy step, not a stub: what its docstring says the learner will see is what its jobs record.
    The losses differ from one process at step 0 on every mesh, far beyond rounding; the two tp ranks of a group
    return different losses (2x2, 1x2); the embedding and head differ between tp ranks (the init case)."""
    report = graded_batch(name)["exercises"]  # read from ex09's batch: its records of the untouched exercise
    assert report.tests and report.score == 0, report.table()
    batch = grade_batch(name)
    untouched = [Path(s).parent.name for s in json.loads((batch / BATCH_FILE).read_text())["submissions"]].index(
        "exercises")
    job = job_module(exercises.grader_files()[name])
    reference = job.reference(job.course_model())  # the grader's one process, as the grader computes it
    records = {}
    for run in batch.glob("runs/grade-ex09-*"):
        mesh = run.name.split("-")[2]
        tp = int(mesh.split("x")[1])  # ranks lie on the (dp, tp) mesh row by row
        for path in (run / "metrics").glob("rank*.jsonl"):
            for rec in map(json.loads, path.read_text().splitlines()):
                if rec.get("case") in ("init", "train") and rec.get("sub") == untouched:
                    rec["run_dir"] = run
                    records.setdefault(mesh, {}).setdefault(rec["case"], {})[divmod(rec["rank"], tp)] = rec
    assert sorted(records) == ["1x2", "2x1", "2x2"], sorted(records)
    for mesh, cases in records.items():
        for rec in cases["train"].values():
            assert abs(rec["losses"][0] - reference["losses"][0]) > 1e-3, (mesh, rec)
        if mesh != "2x1":
            losses = {coords[1]: rec["losses"][0] for coords, rec in cases["train"].items() if coords[0] == 0}
            assert losses[0] != losses[1], (mesh, losses)
            init = job.compare(raw(cases["init"][(0, 1)])["params"], reference["init"])
            assert init["max_diff"] > 1e-3 and init["worst"] in ("tok.weight", "head.weight"), (mesh, init)


@pytest.mark.parametrize("name", [pytest.param("ex09_fix_2d", marks=graded("ex09_fix_2d"))])
def test_the_learners_ex09_class_body_runs_in_ranks_never_in_the_grader(name, grade_batch, graded_batch):
    """ex09's grader trains its one-process reference with its own model (_ex09_model.py), never with the classes of
    the learner's file (in a release, exercises/ holds the learner's TinyLM): the mutant class_body_attacks_the_grader
    keeps full marks (test_mutants), and its class body left marks in every rank of the 2x2, 2x1 and 1x2 meshes and
    none in a grader process."""
    graded_batch(name)  # the batch, graded
    marks = (grade_batch(name) / "class_body_attacks_the_grader").glob("mark-*")  # beside the submission's file
    where = sorted(p.name.split("-")[1] for p in marks)
    assert "grader" not in where, f"the learner's class body ran in the grader process: {where}"
    assert where == ["rank"] * (4 + 2 + 2), where  # it did run: once in each rank's process for this submission


@pytest.mark.parametrize("name, plain", [("test_a[gpucourse-sub3]", "test_a"), ("test_a[gpucourse-sub12-2]", "test_a[2]"),
                                         ("test_a[4-ranks-gpucourse-sub0]", "test_a[4-ranks]"), ("test_a[x]", "test_a[x]"),
                                         ("test_a", "test_a")])
def test_several_targets_keep_each_tests_own_name(name, plain):
    """Graded in one run, each target's tests carry its id (plugin.SUB_ID); the reports name them as one grading does."""
    assert plain_name(name) == plain
