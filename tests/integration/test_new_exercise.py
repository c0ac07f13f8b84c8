"""A new exercise is five files (docs/architecture.md, "Where to change what"): its solution, its grader, its mutants,
the chapter's notebook and the chapter's rows in the README and docs/chapters.md. Nothing else lists exercises: they
are found by their files.

Shown here by adding one, ex99, to a copy of the course with nothing but the first three (the notebook and the docs
are prose) and grading it as CI grades every exercise: in one batch, the solution gets full marks, the generated
exercise zero, and each mutant loses exactly the tests its `must fail:` names.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SOLUTION = '''\
"""Exercise 99: the mean of a tensor over every rank, in place."""
import torch.distributed as dist


def all_mean(tensor):
    """Replace `tensor` on every rank by its mean over the ranks, in its own memory; return it."""
    ### BEGIN SOLUTION
    ### HINT: all_reduce, then divide by the world size
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()
    return tensor
    ### END SOLUTION
'''

GRADER = '''\
"""Grader of ex99: each rank calls all_mean on its own tensor; the grader recomputes the mean."""
import functools
from pathlib import Path

import pytest
import torch

from gpucourse import runtime
from gpucourse.tools.grading import jobkit
from gpucourse.tools.grading.records import check, launch_jobs, raw

CASES = 2


def make_input(case: int, rank: int) -> torch.Tensor:
    return torch.arange(4.0) + 10 * rank + case


def run_case(case, module, guard) -> dict:
    tensor = make_input(case, runtime.context().rank)
    with guard.watching():
        out = module.all_mean(tensor)
    return {"raw": {"out": out, "after": tensor}}


class Ex99Job(jobkit.GradingJob):
    name, wanted, preload = "ex99", ("all_mean",), jobkit.PRELOAD_BASE

    def plan(self) -> list[tuple]:
        return [(f"case{c}", "mean", functools.partial(run_case, c)) for c in range(CASES)]


pytestmark = pytest.mark.grader
WORLD_SIZES = (1, 2)


@pytest.fixture(scope="module")
def jobs(submission):
    return launch_jobs(Path(__file__), submission, WORLD_SIZES, name="grade-ex99-w{world}", case_limit=15,
                       timeout=90, stall_timeout=90)


def problem(rec, world, which):
    want = sum(make_input(int(rec["case"][4:]), r) for r in range(world)) / world
    got = raw(rec)[which]
    return None if isinstance(got, torch.Tensor) and torch.equal(got, want) else f"{which}: {got}, not {want}"


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mean(jobs, world):
    check(jobs[world], "mean", lambda rec: problem(rec, world, "out"))


@pytest.mark.points(1)
def test_in_place(jobs):
    for world in WORLD_SIZES:
        check(jobs[world], "mean", lambda rec, w=world: problem(rec, w, "after"))


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex99Job)
'''

MUTANTS = '''\
== sum_not_mean
all_mean sums over the ranks and never divides.
must fail: test_mean[2], test_in_place
@@
-    tensor /= dist.get_world_size()

== out_of_place
all_mean returns the right mean in a new tensor; the caller's tensor keeps the sum.
must fail: test_in_place
@@
-    tensor /= dist.get_world_size()
+    tensor = tensor / dist.get_world_size()

== max_not_sum
all_mean reduces with MAX, not SUM.
must fail: test_mean[2], test_in_place
@@
-    dist.all_reduce(tensor)
+    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
'''

# In the copy: grade every submission of ex99's batch, print {submission: {test: points lost?}}.
GRADE_THE_BATCH = '''\
import json, os, sys
from pathlib import Path
from gpucourse import exercises, grading
from tests.mutants import all_mutants

solution = exercises.solution_files()["ex99_mean"]
batch = Path(sys.argv[1])
subs = {"solution": solution, "exercise": exercises.exercises_dir() / solution.name}
for mutant in all_mutants()["ex99_mean"]:
    path = batch / mutant.name / solution.name
    path.parent.mkdir(parents=True)
    path.write_text(mutant.apply(solution.read_text()))
    subs[mutant.name] = path
(batch / "batch.json").write_text(json.dumps({"submissions": [str(p.resolve()) for p in subs.values()]}))
os.environ["GPUCOURSE_GRADE_BATCH"] = str(batch)
lost = {}
for name, path in subs.items():
    report = grading.grade("ex99", path)
    assert not report.problems and report.tests, report.table()
    lost[name] = sorted(t.name for t in report.tests if t.score < t.max_score)
must_fail = {m.name: sorted(m.must_fail) for m in all_mutants()["ex99_mean"]}
print(json.dumps({"lost": lost, "must_fail": must_fail}))
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_new_exercise_needs_only_its_own_files(tmp_path, runs_dir):
    course = tmp_path / "course"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("gpucourse", "solutions", "exercises", "tests/mutants"):
        shutil.copytree(ROOT / folder, course / folder, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", course)
    shutil.copy(ROOT / "tests" / "__init__.py", course / "tests")
    (course / "notebooks").mkdir()  # how the package knows its checkout (paths.project_root)
    # The new exercise's own files, and nothing else.
    (course / "solutions" / "ex99_mean.py").write_text(SOLUTION)
    (course / "gpucourse" / "tools" / "grading" / "graders" / "ex99_mean.py").write_text(GRADER)
    (course / "tests" / "mutants" / "ex99_mean.diff").write_text(MUTANTS)

    env = {**os.environ, "PYTHONPATH": str(course), "GPUCOURSE_GRADE_TIMING": "report"}

    def run(*args):
        done = subprocess.run([sys.executable, *args], cwd=course, env=env, capture_output=True, text=True,
                              timeout=540)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    run("-m", "gpucourse.tools.cli", "make-exercises")
    exercise = (course / "exercises" / "ex99_mean.py").read_text()
    assert 'raise NotImplementedError("all_reduce, then divide by the world size")' in exercise
    listed = run("-c", "from gpucourse import exercises; print(exercises.resolve('ex99'))")
    assert listed.strip() == "['ex99_mean']"

    graded = json.loads(run("-c", GRADE_THE_BATCH, str(tmp_path / "batch")).splitlines()[-1])
    lost, must_fail = graded["lost"], graded["must_fail"]
    assert lost["solution"] == [], lost
    assert lost["exercise"] == ["test_in_place", "test_mean[1]", "test_mean[2]"], lost
    assert set(must_fail) == {"sum_not_mean", "out_of_place", "max_not_sum"}
    for name, tests in must_fail.items():
        assert lost[name] == tests, f"{name}: lost {lost[name]}, must fail {tests}"
    runs = sorted(p.name.rsplit("-", 2)[0] for p in runs_dir.iterdir())
    assert runs == ["grade-ex99-w1", "grade-ex99-w2"], runs  # one launch per world size for all five
