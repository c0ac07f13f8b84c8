"""`gpucourse release DIR`: the learners' copy of the course holds no solution code, and grading works in it.

The release is built once per module from this checkout (through the CLI). Everything run inside it runs with
cwd=release and PYTHONPATH=release, so it imports the release's own gpucourse, never the checkout's; every
process those runs start carries a marker in its environment, and whatever still carries it afterwards is
killed, whether the test passed or not.
"""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from gpucourse.tools import exercises, release as release_module
from gpucourse.run.contract import RUNS_ENV

ROOT = exercises.course_root()
SOLUTIONS = exercises.solution_files()
FAST = "ex04_lr_schedule"  # one of the cheapest graders: 3 small jobs (1, 2, 4 ranks), no training to speak of
CLASS = "ex12_plan_at_scale"  # the cheapest grading: one 1-rank job (and, for a right plan, a 2-rank dry run)
MARK = "GPUCOURSE_TEST_RELEASE"


# --- running things, and leaving nothing behind ----------------------------------------------------
def _leftovers(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARK) == mark:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def run(args, *, cwd, env=None, timeout=60) -> subprocess.CompletedProcess:
    """`args` in a session of its own; afterwards (even on a timeout or an interrupt) every process that
    inherited this run's marker is killed: the grader's pytest, torchrun agents (sessions of their own), ranks."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([str(a) for a in args], cwd=cwd, env={**(env or os.environ), MARK: mark},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for left in _leftovers(mark):
            try:
                left.kill()
            except psutil.Error:
                pass


def checkout_cli(*args, timeout=120):
    return run([sys.executable, "-m", "gpucourse.tools.cli", *args], cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("release") / "course"
    done = checkout_cli("release", dest)
    assert done.returncode == 0, done.stderr
    assert (dest / "RELEASE.txt").is_file() and str(dest) in done.stdout
    return dest


def release_env(release: Path, tmp_path: Path) -> dict:
    """A learner's environment for the release: none of this process's GPUCOURSE_ variables (a runs_dir
    fixture's included), its runs in `tmp_path`/runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOURSE_")}
    return {**env, "PYTHONPATH": str(release), "OMP_NUM_THREADS": "1", RUNS_ENV: str(tmp_path / "runs"),
            "GPUCOURSE_GRADE_TIMING": "report"}  # as in the rest of the suite: timings shown, not scored


def release_cli(release: Path, tmp_path: Path, *args, timeout=120):
    return run([sys.executable, "-m", "gpucourse.tools.cli", *args], cwd=release, env=release_env(release, tmp_path),
               timeout=timeout)


# --- no solutions ------------------------------------------------------------------------------------
def give_aways(name: str) -> list[str]:
    """Lines of solutions/<name>.py that its exercise replaced with a stub: inside the BEGIN/END SOLUTION
    fences, not comments, not stated by the exercise (the line, or the expression it returns or assigns:
    release.stated), and long enough (>= 40 characters) not to be a common idiom."""
    exercise = (ROOT / "exercises" / f"{name}.py").read_text()
    lines, inside = [], False
    for line in SOLUTIONS[name].read_text().splitlines():
        text = line.strip()
        if text.startswith(exercises.BEGIN) or text.startswith(exercises.END):
            inside = text.startswith(exercises.BEGIN)
        elif inside and len(text) >= 40 and not text.startswith("#") and not release_module.stated(text, exercise):
            lines.append(text)
    return lines


def strings(item):
    if isinstance(item, str):
        yield item
    for value in item.values() if isinstance(item, dict) else item if isinstance(item, list) else ():
        yield from strings(value)


def readable(path: Path) -> str:
    """A file's text; for a notebook, every string in it (sources, outputs, metadata), JSON's escapes undone."""
    text = path.read_text(errors="replace")
    return "\n".join(strings(json.loads(text))) if path.suffix == ".ipynb" else text


def test_the_release_holds_no_solution(release):
    assert SOLUTIONS, "no solutions in the checkout: nothing to check"
    assert not (release / "solutions").exists()
    files = [p for p in release.rglob("*") if p.is_file()]
    assert not [p for p in files if "solutions" in p.relative_to(release).parts]
    assert not (release / "tests").exists()  # the course's tests, the mutants (near-solutions) among them
    texts = {p.relative_to(release).as_posix(): readable(p) for p in files}
    solution_texts = {path.read_text() for path in SOLUTIONS.values()}
    assert not [rel for rel, text in texts.items() if text in solution_texts]
    for name in SOLUTIONS:
        lines = give_aways(name)
        assert len(lines) >= 3, f"{name}: too few distinctive lines to check ({lines})"
        # The graders too, the exercise's own included (ex04's restates the formulas its docstring states).
        found = [(rel, line) for rel, text in texts.items() for line in lines if line in text]
        assert not found, f"solution code of {name} in the release: {found[:3]}"
    fenced = [rel for rel, text in texts.items() if exercises.BEGIN in text and rel != "gpucourse/tools/exercises.py"]
    assert fenced == [], "files with solution fences"


def test_the_release_ships_the_course_and_says_what_it_left_out(release):
    for entry in ("gpucourse/tools/cli.py", "gpucourse/tools/release.py", "gpucourse/tools/grading/plugin.py",
                  "gpucourse/tools/grading/jobkit.py", "README.md", "docs/setup.md", "docs/grading.md", "pyproject.toml", "Makefile", "environment.yml", "data/macbeth.txt",
                  f"exercises/{FAST}.py", f"gpucourse/tools/grading/graders/{FAST}.py", "notebooks/04_large_batch.ipynb",
                  "scripts/04_large_batch.py", "gpucourse/tools/grading/graders/_ex09_model.py"):  # ex09's grader trains its own model
        assert (release / entry).is_file(), entry
    assert (release / f"exercises/{FAST}.py").read_text() == (ROOT / f"exercises/{FAST}.py").read_text()
    assert not [p for p in release.rglob("*") if p.name == "__pycache__" or p.suffix == ".pyc"]
    manifest = (release / "RELEASE.txt").read_text()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert head and f"commit: {head}" in manifest
    assert f"solutions/ ({len(SOLUTIONS)} files" in manifest
    assert "tests/" in manifest.split("left out:")[1]
    required = json.loads((release / "gpucourse/tools/grading/graders/required_names.json").read_text())
    assert required == {name: exercises.required_names(name) for name in SOLUTIONS}


def test_notebooks_and_scripts_of_the_release_use_no_solution(release):
    for nb in sorted((release / "notebooks").glob("*.ipynb")):
        smoke = json.loads(nb.read_text()).get("metadata", {}).get("gpucourse", {}).get("smoke", {})
        for key, value in smoke.items():
            if isinstance(value, str) and value.endswith(".py"):
                assert "solutions" not in value and (nb.parent / value).resolve().is_file(), (nb.name, key, value)
    for script in sorted((release / "scripts").glob("*.py")):
        for line in script.read_text().splitlines():  # a script may fall back on a solution only where one exists
            if "solutions" in line and "default=" in line:
                pytest.fail(f"{script.name} defaults to a solution: {line.strip()}")


# --- renamed copies of a solution ------------------------------------------------------------------
# ex11's kept_assignments with every name, the docstring, the comments and the annotations changed: the verbatim
# lines miss it (none of its lines is the solution's), and a learner reading it has the answer.
RENAMED_COPY = """\
import torch


def which_to_keep(choices, n_experts, room):
    \"\"\"Keep an assignment while its expert has room.\"\"\"
    queue_of = choices.reshape(-1)
    if room is None:  # unlimited
        return torch.ones_like(choices, dtype=torch.bool)
    position = torch.nn.functional.one_hot(queue_of, n_experts).cumsum(0).gather(1, queue_of[:, None]).squeeze(1) - 1
    return (position < room).reshape(choices.shape)
"""
# The same shape and size, doing something else (a running count per bucket, from 1): not flagged.
UNRELATED = """\
import torch


def bucket_counts(values, n_buckets, limit):
    flat = values.reshape(-1)
    if limit is None:
        return torch.zeros_like(values, dtype=torch.long)
    counts = torch.nn.functional.one_hot(flat, n_buckets).cumsum(1).sum(1).clamp(0, limit) + 1
    return (counts > limit).reshape(values.shape)
"""


def course_copy(dest: Path) -> Path:
    """What a release is made from: the shipped files and solutions/ (no .git: the commit reads "unknown")."""
    for entry in (*release_module.SHIPPED, "solutions"):
        source = ROOT / entry
        if source.is_dir():
            shutil.copytree(source, dest / entry, ignore=shutil.ignore_patterns("__pycache__", ".*"))
        else:
            shutil.copy(source, dest / entry)
    return dest


def test_a_renamed_copy_of_a_solution_is_refused(tmp_path):
    course = course_copy(tmp_path / "course")
    (course / "scripts" / "99_planted.py").write_text(RENAMED_COPY)
    with pytest.raises(release_module.ReleaseError) as refused:
        release_module.make_release(tmp_path / "out", root=course)
    message = str(refused.value)
    assert "nothing written: renamed copies of solution code" in message, message
    assert "scripts/99_planted.py:4 `which_to_keep`" in message, message
    assert "solutions/ex11_expert_parallel.py `kept_assignments`" in message, message
    assert not (tmp_path / "out").exists()


# The search ex12's grader held before it stored the best MFU per case: the exercise's answer, shipped.
GRADER_SEARCH = """

def best_plan(case):
    model, gpus, system, seq, global_batch = CASES[case]
    shape, best = planner.shape_of(model), None
    for tp in (1, 2, 4, 8):
        if shape["heads"] % tp or shape["kv_heads"] % tp and tp % shape["kv_heads"]:
            continue
        for pp in (1, 2, 4, 8, 16):
            dp = gpus // (tp * pp)
            if pp > shape["layers"] or global_batch % dp:
                continue
            for micro_batch in divisors(global_batch // dp):
                if global_batch // (dp * micro_batch) < pp:
                    continue
                best = max(best or 0, modelled(case, {"dp": dp, "tp": tp, "pp": pp, "micro_batch": micro_batch})["mfu"])
    return best
"""


def test_a_grader_holding_its_exercises_answer_is_refused(tmp_path):
    """An exercise's own grader is searched too: ex12's with its old search planted in it is a leak."""
    course = course_copy(tmp_path / "course")
    grader = course / release_module.GRADERS / "ex12_plan_at_scale.py"
    grader.write_text(grader.read_text() + GRADER_SEARCH)
    with pytest.raises(release_module.ReleaseError) as refused:
        release_module.make_release(tmp_path / "out", root=course)
    message = str(refused.value)
    assert "nothing written: 4 line(s) of solution code would ship" in message, message
    assert f"{release_module.GRADERS}/ex12_plan_at_scale.py: " in message, message
    assert "(solutions/ex12_plan_at_scale.py)" in message, message
    assert not (tmp_path / "out").exists()
    leaks, _ = release_module.find_leaks({"a.py": GRADER_SEARCH.encode()}, {"ex04_lr_schedule": SOLUTIONS[FAST]})
    assert leaks == []  # another exercise's lines: none of them


def test_an_unrelated_function_of_the_same_size_is_not_flagged():
    copies, looked_for = release_module.find_renamed_copies({"scripts/a.py": UNRELATED.encode(),
                                                             "scripts/b.py": RENAMED_COPY.encode()}, SOLUTIONS)
    assert looked_for > 20 and [c.split(" `")[0] for c in copies] == ["scripts/b.py:4"], copies
    (_, _, _, unrelated), = release_module.shipped_units("scripts/a.py", UNRELATED.encode())  # large enough to count
    (_, _, _, copied), = release_module.shipped_units("scripts/b.py", RENAMED_COPY.encode())
    assert unrelated != copied


# --- refusals ------------------------------------------------------------------------------------------
def test_refuses_a_folder_that_is_not_empty_and_deletes_nothing(tmp_path):
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine\n")
    done = checkout_cli("release", dest)
    assert done.returncode == 2 and "not empty" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert [p.name for p in dest.iterdir()] == ["notes.txt"] and (dest / "notes.txt").read_text() == "mine\n"


def test_refuses_a_folder_inside_the_checkout():
    dest = ROOT / "runs" / f"release-test-{uuid.uuid4().hex}"
    done = checkout_cli("release", dest)
    assert done.returncode == 2 and "inside the course checkout" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not dest.exists()


# --- the release at work -----------------------------------------------------------------------------
def test_the_release_imports_its_own_package_and_its_commands_answer(release, tmp_path):
    done = run([sys.executable, "-c", "import gpucourse, gpucourse.tools.grading, gpucourse.tools.exercises as e; "
                                      "print(gpucourse.__file__); print(e.course_root())"],
               cwd=release, env=release_env(release, tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(release / "gpucourse" / "__init__.py"), str(release)]
    for command in (["course", "--help"], ["grade", "--help"]):
        done = release_cli(release, tmp_path, *command)
        assert done.returncode == 0 and done.stdout.startswith(f"usage: gpucourse {command[0]}"), done.stderr
    before = {p.name: p.read_text() for p in (release / "exercises").iterdir()}
    done = release_cli(release, tmp_path, "make-exercises")  # nothing to generate from: must not touch exercises/
    assert done.returncode == 2 and "solutions are not part of this release" in done.stderr, done.stderr
    assert {p.name: p.read_text() for p in (release / "exercises").iterdir()} == before
    for args in (["grade", "ex04", "--target", "solutions"], ["release", tmp_path / "again"]):
        done = release_cli(release, tmp_path, *args)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    wrong = tmp_path / f"{FAST}.py"  # a file that lacks the exercise's functions: refused, as in the checkout
    wrong.write_text("def scaled_lr(base_lr, base_batch, global_batch):\n    return base_lr\n")
    done = release_cli(release, tmp_path, "grade", "ex04", "--target", wrong)
    assert done.returncode == 2 and "does not define warmup_lr, warmup_scheduler" in done.stderr, done.stderr


def test_a_target_file_is_graded_in_the_release(release, tmp_path):
    """--target FILE, cheaply: a syntax error fails every test at once and launches no job."""
    bad = tmp_path / f"{FAST}.py"
    bad.write_text("def scaled_lr(base_lr, base_batch, global_batch)\n    return base_lr\n")
    out = tmp_path / "grade.json"
    done = release_cli(release, tmp_path, "grade", "ex04", "--target", bad, "--json", out)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["files"] == {FAST: str(bad)} and not report["problems"]
    assert report["tests"] and report["score"] == 0 and report["max_score"] > 0
    assert all("syntax error at line 1" in t["reason"] for t in report["tests"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_class_grading_in_the_release(release, tmp_path):
    """A class graded in the release (no solutions/ there): the solution gets full marks, the untouched exercise 0 on
    every test (each stopped by the exercise's NotImplementedError), and the class is one batch: ex12's job is
    launched once for both learners."""
    subs = tmp_path / "submissions"
    for learner, source in (("alice", SOLUTIONS[CLASS]), ("bob", release / "exercises" / f"{CLASS}.py")):
        (subs / learner).mkdir(parents=True)
        shutil.copy(source, subs / learner / f"{CLASS}.py")  # alice: the checkout's solution proves full marks
    grades = tmp_path / "grades.csv"
    done = release_cli(release, tmp_path, "grade", "ex12", "--class", subs, "--csv", grades, timeout=800)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["learner"]: row for row in csv.DictReader(grades.open())}
    assert set(rows) == {"alice", "bob"}
    assert float(rows["alice"]["max_score"]) > 0 and rows["alice"]["score"] == rows["alice"]["max_score"], rows
    assert rows["alice"]["tests_passed"] == rows["alice"]["tests_total"] != "0"
    assert rows["bob"]["score"] == "0" and rows["bob"]["tests_total"] == rows["alice"]["tests_total"]
    for learner in rows:
        details = json.loads((tmp_path / "grades-details" / f"{learner}.json").read_text())
        assert details["problems"] == [] and details["files"] == {CLASS: str(subs / learner / f"{CLASS}.py")}
    bob = json.loads((tmp_path / "grades-details" / "bob.json").read_text())
    assert len(bob["tests"]) >= 10 and all(
        t["outcome"] == "failed" and "NotImplementedError" in t["reason"] for t in bob["tests"]), bob
    launched = sorted(run.name.rsplit("-", 2)[0] for run in (tmp_path / "runs").iterdir())
    assert launched == ["grade-ex12"], launched

