"""Grading: run an exercise's graders on a learner's code and report points, in a table, JSON or Gradescope's format.

    gpucourse grade ex01                        # your exercises/ (the default target)
    gpucourse grade ex01 --target solutions     # or a folder, or one file
    gpucourse grade ex01 --class SUBMISSIONS --csv grades.csv   # one folder per learner
    gpucourse make-exercises [--check]          # regenerate exercises/ from solutions/

    report = gpucourse.grading.grade("ex01")    # in a notebook: shows as an HTML table

The graders are pytest files, gpucourse/tools/grading/graders/exNN_<name>.py, whose tests carry
`@pytest.mark.points(n)`. They run in a pytest subprocess (with `-p gpucourse.tools.grading.plugin`, which writes each
test's outcome to a JSON file), so a submission that crashes, hangs or floods its output can cost its own points
but never the grader. Each test launches its real multi-rank jobs through gpucourse.launch, with time limits.
"""
from __future__ import annotations

import csv
import html
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path

from .. import exercises
from ..exercises import ExerciseError
from .plugin import BATCH_ENV, BATCH_FILE, RESULTS_ENV, SEED_ENV, TARGET_ENV, TARGETS_ENV

GRADE_TIMEOUT_S = 900  # the whole pytest run; each job inside has its own, much shorter, limits
REASON_CHARS = 300


# --- results -------------------------------------------------------------------------------------
@dataclass
class TestOutcome:
    exercise: str
    name: str
    max_score: float
    outcome: str  # passed | failed | error | skipped | not run
    reason: str = ""
    duration: float = 0.0
    note: str = ""  # shown whatever the outcome: a timed criterion's figure, and whether it was scored

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"

    @property
    def score(self) -> float:
        return self.max_score if self.passed else 0.0

    @property
    def why(self) -> str:
        """What the report shows beside the result: the reason it did not pass, else the note (if any)."""
        return self.reason if not self.passed else self.note


@dataclass
class GradeReport:
    """The points of one grading run. `problems` are reasons the graders could not run at all."""

    exercise_id: str
    target: str
    files: dict[str, str]
    tests: list[TestOutcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    duration: float = 0.0

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_score for t in self.tests)

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    def table(self) -> str:
        width = max([len(t.name) for t in self.tests] + [20])
        lines = [f"{self.exercise_id} — target {self.target}"]
        for name, path in self.files.items():
            lines.append(f"  {name}: {path}")
        lines += [f"  problem: {p}" for p in self.problems]
        lines.append(f"  {'test'.ljust(width)}  points  result")
        for t in self.tests:
            mark = "ok" if t.passed else t.outcome.upper()
            reason = f"  {t.why}" if t.why else ""
            lines.append(f"  {t.name.ljust(width)}  {_num(t.score):>2}/{_num(t.max_score):<3}  {mark}{reason}")
        lines.append(f"  {'total'.ljust(width)}  {_num(self.score):>2}/{_num(self.max_score):<3}  "
                     f"{self.passed} of {len(self.tests)} tests passed in {self.duration:.0f} s")
        return "\n".join(lines)

    __str__ = table

    def _repr_html_(self) -> str:
        rows = []
        for t in self.tests:
            colour = "#2e7d32" if t.passed else "#c62828"
            rows.append(f"<tr><td><code>{html.escape(t.name)}</code></td><td>{_num(t.score)}/{_num(t.max_score)}</td>"
                        f"<td style='color:{colour}'>{'passed' if t.passed else html.escape(t.outcome)}</td>"
                        f"<td>{html.escape(t.why)}</td></tr>")
        problems = "".join(f"<p style='color:#c62828'>{html.escape(p)}</p>" for p in self.problems)
        return (f"<div><b>{html.escape(self.exercise_id)}: {_num(self.score)} / {_num(self.max_score)} points</b> "
                f"({self.passed} of {len(self.tests)} tests passed, target {html.escape(self.target)}){problems}"
                f"<table><tr><th>test</th><th>points</th><th>result</th><th>why</th></tr>{''.join(rows)}</table></div>")

    def to_dict(self) -> dict:
        return {"exercise": self.exercise_id, "target": self.target, "files": self.files, "score": self.score,
                "max_score": self.max_score, "passed": self.passed, "problems": self.problems,
                "duration": round(self.duration, 3),
                "tests": [{**asdict(t), "score": t.score} for t in self.tests]}

    @classmethod
    def from_dict(cls, data: dict) -> "GradeReport":
        """The report to_dict() wrote."""
        tests = [TestOutcome(**{k: v for k, v in t.items() if k != "score"}) for t in data["tests"]]
        return cls(data["exercise"], data["target"], data["files"], tests, data["problems"], data["duration"])

    def to_gradescope(self) -> dict:
        """Gradescope autograder results.json: score, max_score, and one entry per test."""
        return {"score": self.score, "max_score": self.max_score, "execution_time": round(self.duration, 1),
                "output": "\n".join(self.problems) or f"{self.passed} of {len(self.tests)} tests passed",
                "tests": [{"name": f"{t.exercise}: {t.name}", "score": t.score, "max_score": t.max_score,
                           "status": "passed" if t.passed else "failed", "output": t.why} for t in self.tests]}


def _num(x: float) -> str:
    return f"{x:g}"


# --- running the graders -------------------------------------------------------------------------
def _graders_for(names: list[str]) -> list[Path]:
    graders = exercises.grader_files()
    missing = [n for n in names if n not in graders]
    if missing:
        raise ExerciseError(f"no grader for {', '.join(missing)}: "
                            f"expected gpucourse/tools/grading/graders/{missing[0]}.py")
    return [graders[n] for n in names]


def _target_arg(target) -> str:
    """What the graders get in GPUCOURSE_GRADE_TARGET: a keyword, or an absolute path (they run elsewhere)."""
    target = str(target)
    return target if target in exercises.KEYWORD_TARGETS else str(Path(target).expanduser().resolve())


def _require_pytest() -> None:
    if find_spec("pytest") is None:
        raise ExerciseError("grading runs the graders with pytest, which is not installed: pip install pytest")


def _resolve(exercise) -> list[str]:
    if not isinstance(exercise, str):
        raise ExerciseError(f"exercise must be an id like 'ex01' or a full name, not {exercise!r}")
    return exercises.resolve(exercise)


def _new_file(option: str, path) -> Path:
    """A file grading will create: its folder must exist and nothing may be there yet (we never overwrite)."""
    path = Path(path).expanduser()
    if path.exists() or path.is_symlink():
        raise ExerciseError(f"{option} {path} already exists: choose a new file name, or move the old file away")
    if not path.parent.is_dir():
        raise ExerciseError(f"{option} {path}: the folder {path.parent} does not exist: create it, or choose another")
    return path


def grade(exercise: str, target: str | Path = "exercises", *, timeout: float = GRADE_TIMEOUT_S,
          seed: int | None = None) -> GradeReport:
    """Grade `exercise` ('ex01' or a full name) on `target`: 'exercises' (default), 'solutions', a folder or a file.
    `seed`: the draw of a grader whose cases are random (its report names the seed it drew; default: a new one).

    Raises ExerciseError for an unknown exercise or a target that cannot be graded (missing, or not
    defining the exercise's functions). A submission that fails in any other way is graded.
    """
    names = _resolve(exercise)
    if not isinstance(target, (str, os.PathLike)):
        raise ExerciseError(f"target must be 'exercises', 'solutions' or a path, not {target!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ExerciseError(f"timeout must be a positive number of seconds, not {timeout!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ExerciseError(f"seed must be a whole number >= 0, not {seed!r}")
    files = exercises.check_target(target, names)
    return run_graders(exercise, names, target, files, timeout=timeout, seed=seed)


def run_graders(exercise: str, names: list[str], target, files: dict[str, Path], *,
                timeout: float = GRADE_TIMEOUT_S, batch: Path | None = None, seed: int | None = None) -> GradeReport:
    """Run the graders of `names` on `target` and read back every test's outcome as a GradeReport."""
    return grade_targets(exercise, names, [(target, files)], timeout=timeout, batch=batch, seed=seed)[0]


def grade_targets(exercise: str, names: list[str], targets: list[tuple], *, timeout: float = GRADE_TIMEOUT_S,
                  batch: Path | None = None, seed: int | None = None) -> list[GradeReport]:
    """The graders of `names` on each of `targets`, [(target, {name: file})], in one pytest run (the plugin runs
    every test once per target): one GradeReport per target. `batch`: a folder of gradings that share their jobs'
    launches (records.Batch), so that the targets also share one launch per job."""
    graders = _graders_for(names)
    _require_pytest()
    reports = [GradeReport(exercise, str(target), {n: str(p) for n, p in files.items()}) for target, files in targets]
    listed = [_target_arg(target) for target, _ in targets]
    env = {TARGET_ENV: listed[0]} if len(listed) == 1 else {TARGETS_ENV: json.dumps(listed)}
    if batch:
        env[BATCH_ENV] = str(batch)
    if seed is not None:
        env[SEED_ENV] = str(seed)
    start = time.monotonic()
    data, output = run_pytest(graders, env, timeout if batch or len(listed) == 1 else timeout * len(listed))
    elapsed = time.monotonic() - start
    if data is None:
        tail = " | ".join(output.strip().splitlines()[-3:]) or "no output"
        for report in reports:
            report.problems.append(f"the graders did not finish (pytest output ends: {tail[-REASON_CHARS:]})")
            report.duration = elapsed
        return reports
    for rec in data["tests"]:  # a test that grades no submission ("sub" None) counts for every target
        for report in reports if rec.get("sub") is None else [reports[rec["sub"]]]:
            report.tests.append(TestOutcome(Path(rec["file"]).stem, rec["name"], rec["max_score"], rec["outcome"],
                                            rec["reason"], round(rec["duration"], 3), rec["note"]))
    for report in reports:
        report.problems += data["collect_errors"]
        report.duration = elapsed if len(reports) == 1 else sum(t.duration for t in report.tests)
    return reports


def run_pytest(paths, env: dict, timeout: float = GRADE_TIMEOUT_S) -> tuple[dict | None, str]:
    """Run pytest on `paths` in a subprocess with the grading plugin: ({"tests": [...], ...} or None, output).

    The jobs the tests launch write their runs to a temporary folder unless GPUCOURSE_RUNS_DIR is set (or a batch
    of gradings shares them: records.BATCH_ENV).
    """
    with tempfile.TemporaryDirectory(prefix="gpucourse-grade-") as tmp:
        results = Path(tmp) / "results.json"
        # Plugin autoload off: nbval, papermill & co. cost seconds to import and graders need none of them. The
        # caller's own pytest options (PYTEST_ADDOPTS, PYTEST_PLUGINS) are not the graders': they are left out.
        caller = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
        full_env = {**caller, **env, RESULTS_ENV: str(results), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        batch = full_env.get(BATCH_ENV)  # a batch's runs serve all its gradings: they stay in its folder
        full_env.setdefault("GPUCOURSE_RUNS_DIR", str(Path(batch or tmp) / "runs"))
        if batch:  # the first grading of a batch launches every submission's jobs
            timeout *= max(1, len(_read_json(Path(batch) / BATCH_FILE)["submissions"]))
        # Each job has its own time limits; pytest-timeout only backs them up (the first test starts all jobs).
        plugins = ["-p", "gpucourse.tools.grading.plugin"] + (["-p", "pytest_timeout", "-o", "timeout=600"]
                                                 if find_spec("pytest_timeout") else [])
        cmd = [sys.executable, "-m", "pytest", *map(str, paths), *plugins, "-q", "-p", "no:cacheprovider",
               "--no-header", "-rN"]
        output = _run_pytest(cmd, full_env, timeout)
        return _read_json(results), output


def _run_pytest(cmd: list[str], env: dict, timeout: float) -> str:
    """Run pytest in a session of its own; past `timeout`, kill it and everything in its session."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, cwd=exercises.course_root(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:  # timed out, or we were interrupted
                # The jobs' agents live in sessions of their own and stop when pytest, their parent, dies.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        return out.read().decode(errors="replace")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- a class of learners -------------------------------------------------------------------------
CSV_FIELDS = ["learner", "exercise", "tests_passed", "tests_total", "score", "max_score"]


def grade_class(exercise: str, submissions: str | Path, csv_path: str | Path, *, progress=print,
                seed: int | None = None) -> Path:
    """Grade every learner folder of `submissions`; write one CSV row per learner and exercise.

    The class is graded in one pytest run, as one batch (records.Batch): each grading job is launched once for
    every learner's file, each graded in a process of its own, so a class costs about one grading, not one per
    learner. Each learner's full report (every test and reason) goes to `<csv stem>-details/<learner>.json` next
    to the CSV, and the CSV is written, once all are graded. A learner whose file is missing
    or broken is graded zero, with the reason. Existing files are never overwritten: an existing CSV or
    details folder is refused before anything runs. Returns the details folder.
    """
    names = _resolve(exercise)
    submissions = Path(submissions).expanduser()
    if not submissions.is_dir():
        what = "is a file, not a folder" if submissions.exists() else "does not exist"
        raise ExerciseError(f"submissions folder {submissions} {what}: give a folder holding one folder per learner")
    learners = sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    if not learners:
        raise ExerciseError(f"{submissions} has no learner folders: put each learner's files in a folder of its own")
    csv_path = _new_file("--csv", csv_path)
    details = csv_path.with_name(f"{csv_path.stem}-details")
    if details.exists() and (not details.is_dir() or any(details.iterdir())):
        raise ExerciseError(f"{details} already exists (an earlier grading?): choose another --csv name, "
                            "or move that folder away")
    _graders_for(names)
    details.mkdir(exist_ok=True)
    files = {learner: {n: exercises.target_file(learner, n) for n in names} for learner in learners}
    if progress:
        progress(f"grading {len(learners)} learners' {', '.join(names)} in one run: each job is launched once for "
                 "the whole class (every file in a process of its own); the results come when all have run")
    with tempfile.TemporaryDirectory(prefix="gpucourse-class-") as batch:
        listed = [str(f.resolve()) for own in files.values() for f in own.values() if f.is_file()]
        (Path(batch) / BATCH_FILE).write_text(json.dumps({"submissions": listed}))
        reports = grade_targets(exercise, names, [(learner, files[learner]) for learner in learners],
                                batch=Path(batch), seed=seed)
    rows = []
    for learner, report in zip(learners, reports):
        (details / f"{learner.name}.json").write_text(json.dumps(report.to_dict(), indent=1))
        for name in names:
            tests = [t for t in report.tests if t.exercise == name]
            rows.append({"learner": learner.name, "exercise": name,
                         "tests_passed": sum(t.passed for t in tests), "tests_total": len(tests),
                         "score": _num(sum(t.score for t in tests)),
                         "max_score": _num(sum(t.max_score for t in tests))})
        if progress:
            progress(f"{learner.name}: {_num(report.score)}/{_num(report.max_score)}")
    with open(csv_path, "x", newline="") as f:  # "x": never over a file that appeared meanwhile
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return details


# --- command line ------------------------------------------------------------------------------------
def _cmd_grade(args) -> int:
    """Bad input raises ExerciseError; the CLI (cli.main) prints it as one line and exits 2."""
    if args.seed is not None and args.seed < 0:
        raise ExerciseError(f"--seed {args.seed}: give a whole number >= 0")
    if args.class_dir:
        if not args.csv:
            raise ExerciseError("--class needs --csv FILE: where to write the class's grades")
        if args.json or args.gradescope or args.target != "exercises":
            raise ExerciseError("--class grades every learner's folder: leave out --target, --json and --gradescope")
        details = grade_class(args.exercise, args.class_dir, args.csv, seed=args.seed)
        print(f"grades: {args.csv}; each learner's details: {details}/")
        return 0
    if args.csv:
        raise ExerciseError("--csv goes with --class SUBMISSIONS_DIR; for one target use --json FILE")
    outputs = [(_new_file(opt, path), data) for opt, path, data in (
        ("--json", args.json, GradeReport.to_dict), ("--gradescope", args.gradescope, GradeReport.to_gradescope))
        if path]
    if len({p.resolve() for p, _ in outputs}) < len(outputs):
        raise ExerciseError("--json and --gradescope name the same file: give two different files")
    names = _resolve(args.exercise)
    files = exercises.check_target(args.target, names)
    print(f"grading {', '.join(names)} on {args.target} (real multi-rank jobs: about a minute)...", flush=True)
    report = run_graders(args.exercise, names, args.target, files, seed=args.seed)
    print(report.table())
    for path, data in outputs:
        with open(path, "x") as f:  # "x": never over a file that appeared while grading
            json.dump(data(report), f, indent=1)
    return 0 if report.tests and not report.problems else 1


def _cmd_make_exercises(args) -> int:
    stale = exercises.generate_exercises(check=args.check)
    root = exercises.course_root()
    for path in stale:
        shown = path.relative_to(root) if path.is_relative_to(root) else path
        print(f"{'stale' if args.check else 'wrote'}: {shown}")
    if args.check and stale:
        print("exercises/ is out of date with solutions/: run `gpucourse make-exercises`", file=sys.stderr)
        return 1
    if not stale:
        print("exercises/ is up to date")
    return 0


def add_cli(subparsers) -> None:
    """Register `grade` and `make-exercises` on an argparse subparsers object (func(args) -> exit code)."""
    g = subparsers.add_parser("grade", help="grade an exercise: its graders on your code (or a class's)",
                              description="Exit code: 0 when grading ran (whatever the score), 1 when the "
                                          "graders could not run, 2 for bad input.")
    g.add_argument("exercise", help="ex01 (every exercise of chapter 01) or a full name like ex01_ring_allreduce")
    g.add_argument("--target", default="exercises",
                   help="what to grade: 'exercises' (default), 'solutions', a folder holding exNN_<name>.py, or a file")
    g.add_argument("--json", metavar="FILE", help="also write every test's outcome as JSON")
    g.add_argument("--gradescope", metavar="FILE", help="also write Gradescope's results.json")
    g.add_argument("--class", dest="class_dir", metavar="SUBMISSIONS_DIR",
                   help="grade one folder per learner in SUBMISSIONS_DIR (with --csv)")
    g.add_argument("--csv", metavar="FILE", help="with --class: one row per learner and exercise")
    g.add_argument("--seed", type=int, metavar="N", help="replay the draw of a grader whose cases are random "
                   "(ex08_read_the_dumps: its report names the seed it drew)")
    g.set_defaults(func=_cmd_grade)
    m = subparsers.add_parser("make-exercises", help="regenerate exercises/ from solutions/")
    m.add_argument("--check", action="store_true", help="change nothing; exit 1 if exercises/ is out of date")
    m.set_defaults(func=_cmd_make_exercises)
