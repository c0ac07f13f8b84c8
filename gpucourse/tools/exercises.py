"""The course's exercises: where they live, how `ex01` names them, and how `exercises/` is made from `solutions/`.

`solutions/exNN_<name>.py` is the single source. The learner's part of each function is fenced:

        ### BEGIN SOLUTION
        ### HINT: a short hint shown when the exercise is run unsolved (optional)
        ...reference code...
        ### END SOLUTION

`generate_exercises()` writes `exercises/exNN_<name>.py` with every fence replaced, at the same
indentation, by `# YOUR CODE HERE` and `raise NotImplementedError("<hint>")`; everything else
(docstrings stating the task and rules, imports, scaffolding) is kept as it is.

A "fix the bug" exercise hands out working code with a mistake in it, not a stub. Its fences say what the
learner gets instead of the fixed code, one `### BUGGY:` line per line of it (its indentation after the colon
and one space, relative to the fence's):

        ### BEGIN SOLUTION
        ### BUGGY: rows = slice(rank * per_rank, (rank + 1) * per_rank)
        rows = slice(group * per_group, (group + 1) * per_group)
        ### END SOLUTION

becomes `rows = slice(rank * per_rank, (rank + 1) * per_rank)` in the exercise, unmarked: finding it is the task.

Exercises are discovered by scanning `solutions/ex*.py` and `gpucourse/tools/grading/graders/ex*.py`: a new
chapter adds its files and needs no change here.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

from ..run.paths import project_root

BEGIN, END, HINT, BUGGY = "### BEGIN SOLUTION", "### END SOLUTION", "### HINT:", "### BUGGY:"
DEFAULT_HINT = "write this part of the exercise (see the docstring)"
NAME_RE = re.compile(r"^ex(\d{2})_\w+$")
KEYWORD_TARGETS = ("exercises", "solutions")
REQUIRED_NAMES = "required_names.json"  # beside the graders in a student release: {exercise: [names]}
NO_SOLUTIONS = "solutions are not part of this release (made by `gpucourse release`)"


class ExerciseError(ValueError):
    """A bad exercise id, target or solution file: the message says what was wrong and what to do."""


# --- where things are ------------------------------------------------------------------------------
def course_root() -> Path:
    """The checkout holding solutions/ and exercises/ (the current folder for a plain install)."""
    return project_root() or Path.cwd().resolve()


def solutions_dir() -> Path:
    return course_root() / "solutions"


def exercises_dir() -> Path:
    return course_root() / "exercises"


def graders_dir() -> Path:
    """The graders ship inside the package: gpucourse/tools/grading/graders/."""
    return Path(__file__).resolve().parent / "grading" / "graders"


def _named(paths, strip: str = "") -> dict[str, Path]:
    out = {}
    for path in paths:
        name = path.stem[len(strip):]
        if NAME_RE.match(name):
            out[name] = path
    return dict(sorted(out.items()))


def solution_files(folder: Path | None = None) -> dict[str, Path]:
    """{exercise name: solution file}, e.g. {'ex01_ring_allreduce': .../solutions/ex01_ring_allreduce.py}."""
    return _named((folder or solutions_dir()).glob("ex*.py"))


def grader_files() -> dict[str, Path]:
    """{exercise name: grader file}, from gpucourse/tools/grading/graders/exNN_<name>.py (one file per exercise)."""
    return _named(graders_dir().glob("ex*.py"))


def all_exercises() -> list[str]:
    return sorted(set(solution_files()) | set(grader_files()))


def resolve(exercise_id: str) -> list[str]:
    """'ex01' → every exercise of chapter 01; 'ex01_ring_allreduce' (or '...py') → that one exercise."""
    known = all_exercises()
    wanted = exercise_id.strip().lower().removesuffix(".py")
    chapter = re.fullmatch(r"ex(\d{1,2})", wanted)
    if chapter:
        prefix = f"ex{int(chapter.group(1)):02d}_"
        found = [name for name in known if name.startswith(prefix)]
    else:
        found = [name for name in known if name == wanted]
    if not found:
        listing = ", ".join(known) or "none (no solutions/ex*.py found)"
        raise ExerciseError(f"unknown exercise {exercise_id!r}: use a chapter id like ex01 or a full name; "
                            f"known exercises: {listing}")
    return found


# --- a chapter's script running the learner's code ------------------------------------------------------
def load_file(path: str | Path, name: str = "learner"):
    """The Python file at `path` as a module (named chapter_<name>): how a chapter's script runs a learner's file."""
    spec = importlib.util.spec_from_file_location(f"chapter_{name}", Path(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_for_chapter(path: str | Path, name: str, probe) -> tuple[object | None, str]:
    """(module, what runs): the learner's file at `path` (exercise `name`), for a chapter's script that runs the
    exercise's pieces instead of shipping its answer. `probe(module)` calls those pieces once; while one raises
    NotImplementedError, the reference solution stands in where the checkout has one. In a student release
    (no solutions/) the module is None and the text says what to write."""
    path = Path(path).resolve()
    shown = f"{path.parent.name}/{path.name}"  # exercises/... or, in CI's smoke runs, solutions/...
    module = load_file(path, name)
    try:
        probe(module)
        return module, shown
    except NotImplementedError as err:
        reference = solution_files().get(name)
        if reference is None:
            return None, f"not written yet in {shown} ({err}): write it, then rerun"
        return load_file(reference, name), f"the reference solution, {shown} is not written yet"


# --- what a submission must provide ---------------------------------------------------------------
def defined_names(tree: ast.Module) -> set[str]:
    """Top-level names a module defines (functions, classes, assignments, imports)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def required_names(name: str) -> list[str]:
    """The public functions and classes of the solution: what a submission of `name` must define.

    A student release (`gpucourse release`) has no solutions/: there they come from the graders'
    REQUIRED_NAMES file, which the release writes from the solutions (names only, no code).
    """
    path = solution_files().get(name)
    if path is None:
        shipped = graders_dir() / REQUIRED_NAMES
        try:
            return list(json.loads(shipped.read_text()).get(name, []))
        except (OSError, ValueError, AttributeError):
            return []
    return public_names(path)


def public_names(path: Path) -> list[str]:
    """The public top-level functions and classes a Python file defines, in order."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]


def target_file(target: str | Path, name: str) -> Path:
    """The file to grade for exercise `name`: 'exercises' | 'solutions' | a folder holding `<name>.py` | a file."""
    if str(target) in KEYWORD_TARGETS:
        return course_root() / str(target) / f"{name}.py"
    path = Path(target).expanduser().resolve()
    return path / f"{name}.py" if path.is_dir() else path


def check_target(target: str | Path, names: list[str]) -> dict[str, Path]:
    """{name: file to grade}, or ExerciseError when the target cannot be graded at all.

    A file with a syntax error passes this check on purpose: it is graded (zero, with the error shown).
    """
    if str(target) not in KEYWORD_TARGETS and not Path(target).expanduser().exists():
        raise ExerciseError(f"target {target} does not exist: use 'exercises', 'solutions', a folder or a file")
    if str(target) not in KEYWORD_TARGETS and Path(target).is_file() and len(names) > 1:
        raise ExerciseError(f"target {target} is one file but {len(names)} exercises were asked for "
                            f"({', '.join(names)}): give a folder, or one exercise's full name")
    if str(target) == "solutions" and not solutions_dir().is_dir():
        raise ExerciseError(f"there is no solutions/ folder in {course_root()}: {NO_SOLUTIONS}; "
                            "grade 'exercises' (the default), a folder or a file")
    files = {}
    for name in names:
        path = target_file(target, name)
        if not path.is_file():
            hint = " (run `gpucourse make-exercises`)" if str(target) == "exercises" else ""
            raise ExerciseError(f"{path} not found: the target must contain {name}.py{hint}")
        try:
            tree = ast.parse(path.read_text(errors="replace"), str(path))
        except SyntaxError:
            files[name] = path
            continue
        missing = [n for n in required_names(name) if n not in defined_names(tree)]
        if missing:
            raise ExerciseError(f"{path} does not define {', '.join(missing)}, which {name} asks for")
        files[name] = path
    return files


# --- exercises/ from solutions/ -------------------------------------------------------------------
def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_exercise(source: str, filename: str = "<solution>") -> str:
    """The exercise text of one solution: every BEGIN/END SOLUTION block replaced by a NotImplementedError stub,
    or, for a block with `### BUGGY:` lines, by those lines (the code with the mistake the learner fixes)."""
    out, block_start, hint, indent, buggy = [], None, None, "", []
    for lineno, line in enumerate(source.splitlines(keepends=True), 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if block_start is not None:
                raise ExerciseError(f"{filename}:{lineno}: BEGIN SOLUTION inside the block opened at line "
                                    f"{block_start}: close it with {END} first")
            block_start, hint, indent, buggy = lineno, None, line[: len(line) - len(line.lstrip())], []
        elif stripped.startswith(END):
            if block_start is None:
                raise ExerciseError(f"{filename}:{lineno}: END SOLUTION without a BEGIN SOLUTION before it")
            if buggy and hint is not None:
                raise ExerciseError(f"{filename}:{block_start}: a block with {BUGGY} lines hands out code, not a "
                                    f"stub: it takes no {HINT}")
            out += buggy or [f"{indent}# YOUR CODE HERE\n",
                             f"{indent}raise NotImplementedError({_quote(hint or DEFAULT_HINT)})\n"]
            block_start = None
        elif block_start is not None:
            if stripped.startswith(HINT) and hint is None:
                hint = stripped[len(HINT):].strip()
            elif stripped.startswith(BUGGY):
                code = stripped[len(BUGGY):].removeprefix(" ")
                buggy.append(f"{indent}{code}\n" if code.strip() else "\n")
        else:
            out.append(line)
    if block_start is not None:
        raise ExerciseError(f"{filename}:{block_start}: BEGIN SOLUTION is never closed with {END}")
    return "".join(out)


def _header(solution: Path, source: str) -> str:
    task = ("find and fix what the docstring describes" if BUGGY in source
            else "fill in every `# YOUR CODE HERE`")
    return (f"# Generated from solutions/{solution.name} by `gpucourse make-exercises`: course authors edit the\n"
            f"# solution, not this file. Learners: {task}, then `gpucourse grade "
            f"{solution.stem.split('_')[0]}`.\n")


def generate_exercises(check: bool = False, solutions: Path | None = None,
                       exercises: Path | None = None) -> list[Path]:
    """Regenerate exercises/ from solutions/. Returns the exercise files that were (check=True: that are) stale.

    Stale: missing, different from what the solution generates, or generated from a solution that is gone.
    check=True changes nothing.
    """
    solutions, exercises = solutions or solutions_dir(), exercises or exercises_dir()
    if not solutions.is_dir():  # a student release: without this, every generated exercise would look orphaned
        raise ExerciseError(f"there is no solutions folder {solutions}: exercises are generated from it, and "
                            f"{NO_SOLUTIONS}; exercises/ was left as it is")
    stale = []
    wanted = {}
    for name, src in solution_files(solutions).items():
        text = src.read_text()
        wanted[exercises / f"{name}.py"] = _header(src, text) + render_exercise(text, str(src))
    orphans = [p for p in solution_files(exercises).values()
               if p not in wanted and p.read_text(errors="replace").startswith("# Generated from solutions/")]
    for path, text in wanted.items():
        if not path.is_file() or path.read_text() != text:
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    for path in orphans:
        stale.append(path)
        if not check:
            path.unlink()
    return stale
