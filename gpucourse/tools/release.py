"""`gpucourse release DIR`: the learners' copy of the course, without its solutions.

Why: in the checkout, solutions/ (the single source of the exercises) sits beside exercises/, so learners
handed the checkout can read the answers, and a submission can load them from disk. A release is what
learners get instead: the package (the graders, gpucourse/tools/grading/graders/, included), exercises/, notebooks/,
scripts/, data/, docs/ and the project files — and nothing of solutions/ or tests/.

- Grading works there as in the checkout (`gpucourse grade EX`, `--target`, `--class`). The one thing the
  checkout reads from the solutions, the names a submission must define, ships as
  gpucourse/tools/grading/graders/required_names.json (names only, no code).
- Notebooks whose smoke parameters (metadata `gpucourse.smoke`, for CI) point into ../solutions/ point at
  the exercise instead; the scripts and notebooks fall back on a solution only where one exists.
- Before anything is written, every file of the release (the graders included, each exercise's own among
  them) is searched for the distinctive lines of every solution (the code its exercise replaces with a stub,
  less what the exercise states), and every function and class of its Python (the code
  cells of notebooks included) is compared, as a normalised syntax tree, with the solutions' functions,
  methods and classes that hold such code, so that a copy with other names and docstrings is found too: one
  found, and nothing is written.
- DIR must be new or empty and outside the checkout; nothing is ever deleted or overwritten. RELEASE.txt in
  DIR records the source commit and what was left out.
"""
from __future__ import annotations

import ast
import builtins
import datetime
import json
import re
import subprocess
from pathlib import Path

from . import colab, exercises
from .exercises import BEGIN, END, ExerciseError

# What learners get, relative to the checkout. The graders ship inside the package; the mutants (tests/mutants/:
# mistakes patched into the solutions, which test the graders themselves) stay home with the rest of tests/.
SHIPPED = ("gpucourse", "exercises", "notebooks", "scripts", "data", "docs",
           "README.md", "pyproject.toml", "Makefile", "environment.yml")
# Of docs/, only its pages (the README links to them): the GPU reports' raw output, which quotes solution code from
# the runs it logged, and the GPU run's scripts stay home.
SHIPPED_ONLY = {"docs": "*.md"}
SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache"}
GRADERS = "gpucourse/tools/grading/graders"
MANIFEST = "RELEASE.txt"
MIN_LINE_CHARS = 40  # a solution line this long, absent from its exercise, is distinctive (shorter ones are idioms)
# A function or class this large (nodes of its normalised tree: names, constants, operations) is compared with the
# solutions'; a smaller one is an idiom that unrelated code shares: ex06's ParallelMLP.forward,
# `return self.fc2(F.gelu(self.fc1(x)))`, 15 nodes, is also every dense MLP's forward in the chapters. A body of
# 3-5 short lines is about 20; the smallest solution methods (CopyToParallel's forward, 14) are checked as part
# of their class (51).
MIN_NODES = 20


class ReleaseError(ValueError):
    """A release that cannot be made as asked: the message says why and what to do."""


# --- what goes in ----------------------------------------------------------------------------------
def _shipped_files(root: Path) -> dict[str, bytes]:
    """{relative posix path: content} of every shipped file (no caches, no hidden files)."""
    files = {}
    for entry in SHIPPED:
        path = root / entry
        if path.is_file():
            files[entry] = path.read_bytes()
            continue
        if not path.is_dir():
            raise ReleaseError(f"{path} is missing: a release needs {', '.join(SHIPPED)}")
        for file in sorted(path.glob(SHIPPED_ONLY[entry]) if entry in SHIPPED_ONLY else path.rglob("*")):
            rel = file.relative_to(root)
            if (file.is_file() and not file.name.endswith(".pyc")
                    and not any(part in SKIPPED_DIRS or part.startswith(".") for part in rel.parts)):
                files[rel.as_posix()] = file.read_bytes()
    return files


def _point_smoke_at_exercises(files: dict[str, bytes]) -> list[str]:
    """Smoke parameters '../solutions/X' become '../exercises/X' (notebooks only). Returns what changed."""
    changed = []
    for rel in [r for r in files if r.startswith("notebooks/") and r.endswith(".ipynb")]:
        nb = json.loads(files[rel])
        smoke = nb.get("metadata", {}).get("gpucourse", {}).get("smoke", {})
        edits = {k: v.replace("/solutions/", "/exercises/") for k, v in smoke.items()
                 if isinstance(v, str) and "/solutions/" in v}
        for key, value in edits.items():
            if f"exercises/{Path(value).name}" not in files:
                raise ReleaseError(f"{rel}: smoke parameter {key}={smoke[key]!r} points to a solution whose "
                                   f"exercise {value} is not in the release")
            smoke[key] = value
            changed.append(f"{rel}: smoke parameter {key} now {value}")
        if edits:  # the notebooks' own format (a test keeps them so): one-space indent, sorted keys
            files[rel] = (json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n").encode()
    return changed


def _stamp_source(files: dict[str, bytes], source: str) -> list[str]:
    """The release's git URL into each chapter's Colab start cell (colab.stamp_notebook). Returns what changed."""
    changed = []
    for rel in [r for r in files if r.startswith("notebooks/") and r.endswith(".ipynb")]:
        nb = json.loads(files[rel])
        if colab.stamp_notebook(nb, Path(rel).name, source):
            files[rel] = (json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n").encode()
            changed.append(f"{rel}: its start cell fetches the course from {source}")
    return changed


def _readme_note(text: str, commit: str) -> str:
    note = (f"> **Student release** (`gpucourse release`, from commit {commit[:12]}): this copy has no `solutions/`, "
            f"none of the course's own tests and no benchmarks; where the text below mentions them, it describes "
            f"the full course. What was left out: `{MANIFEST}`.\n\n")
    first, sep, rest = text.partition("\n")
    return f"{first}\n\n{note}{rest.lstrip(chr(10))}" if first.startswith("# ") and sep else note + text


# --- what must not go in ---------------------------------------------------------------------------
def solution_blocks(source: str) -> list[str]:
    """The stripped lines inside BEGIN/END SOLUTION fences: the code an exercise replaces with a stub."""
    lines, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            inside = True
        elif stripped.startswith(END):
            inside = False
        elif inside and stripped:
            lines.append(stripped)
    return lines


# What a line returns or assigns: `return EXPR`, `name = EXPR`, `a.b, c[0] += EXPR` -> EXPR.
_RETURNED_OR_ASSIGNED = re.compile(r"^(?:return\s+|[\w.\[\]]+(?:\s*,\s*[\w.\[\]]+)*\s*[-+*/]?=(?!=)\s*)(?P<expr>.+)$")


def stated(line: str, exercise: str) -> bool:
    """Whether the exercise states a solution line: it holds the line, or the expression the line returns or
    assigns when that is as long as a distinctive line (ex04's docstring gives its warmup ramp,
    `start + (target - start) * step / warmup_steps`, which its grader's reference returns)."""
    if line in exercise:
        return True
    match = _RETURNED_OR_ASSIGNED.match(line)
    return bool(match) and len(match["expr"]) >= MIN_LINE_CHARS and match["expr"] in exercise


def distinctive_lines(solution: str, exercise: str) -> list[str]:
    """Lines of a solution's fenced code that would give it away: long, not comments, not stated by the exercise."""
    return sorted({line for line in solution_blocks(solution)
                   if len(line) >= MIN_LINE_CHARS and not line.startswith("#") and not stated(line, exercise)})


def _searchable(rel: str, data: bytes) -> str:
    """A file's text; a notebook's every string (sources, outputs, metadata), unescaped, one per line."""
    text = data.decode(errors="replace")
    if rel.endswith(".ipynb"):
        strings, stack = [], [json.loads(text)]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                strings.append(item)
            elif isinstance(item, dict):
                stack += item.values()
            elif isinstance(item, list):
                stack += item
        text = "\n".join(strings)
    return text


def find_leaks(files: dict[str, bytes], solutions: dict[str, Path]) -> tuple[list[str], int]:
    """(["path: line of solutions/X.py", ...], how many distinctive lines were looked for).

    Every shipped file is searched, an exercise's own grader (GRADERS/<name>.py) included: a grader may restate
    what its exercise states (ex04's restates the formulas of its docstring: those lines are not distinctive),
    never the code the learner is asked to write (ex12's grader once held the whole search).
    """
    texts = {rel: _searchable(rel, data) for rel, data in files.items()}
    leaks, looked_for = [], 0
    for name, path in solutions.items():
        exercise = texts.get(f"exercises/{name}.py", "")
        lines = distinctive_lines(path.read_text(), exercise)
        looked_for += len(lines)
        for rel, text in texts.items():
            leaks += [f"{rel}: {line!r} (solutions/{path.name})" for line in lines if line in text]
    return leaks, looked_for


# --- renamed copies: solution code compared as normalised syntax trees ------------------------------
_BUILTINS = frozenset(dir(builtins))  # kept as written: a copy calls the same len, range, sum
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_DROPPED_FIELDS = {"decorator_list", "returns", "annotation", "type_comment", "type_params", "ctx", "simple", "kind"}


def _definitions(tree: ast.AST) -> dict[ast.AST, tuple[int, set[str]]]:
    """{function or class: (its nodes, the attribute names it chooses itself)}, in one pass over the tree. Its own
    attributes: those it sets (`ctx.splits = ...`, `self.weight = ...`) and a class body's declared fields. The
    rest (`x.view_as`, `dist.all_reduce`, `t.shape`) are the API a copy must keep, so they stay as written."""
    found = {}

    def visit(node: ast.AST) -> tuple[int, set[str]]:
        size, attributes = 1, set()
        for child in ast.iter_child_nodes(node):
            child_size, child_attributes = visit(child)
            size, attributes = size + child_size, attributes | child_attributes
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            attributes = attributes | {node.attr}
        if isinstance(node, _DEFINITIONS):
            fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            found[node] = (size, attributes | fields if isinstance(node, ast.ClassDef) else attributes)
        return size, attributes

    visit(tree)
    return found


def _is_text(node: ast.AST) -> bool:
    """A statement that is only a string (a docstring, or a comment written as one) or a bare annotation."""
    if isinstance(node, ast.AnnAssign):
        return node.value is None
    return isinstance(node, ast.Expr) and (isinstance(node.value, ast.JoinedStr) or (
        isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)))


class _Fingerprint:
    """A function's or class's syntax tree as text, with what a renamed copy changes taken out: names (variables,
    arguments, functions, classes) and the unit's own attributes become placeholders numbered by first
    appearance; every string becomes the same empty string; docstrings, annotations and decorators go (comments
    never reach the tree). Numbers, operators, keyword names and the API's attributes stay: they are what
    unrelated code of the same size differs in. `size`: the nodes kept."""

    def __init__(self, unit: ast.AST, attributes: set[str]):
        self.attributes, self.names, self.attrs, self.size = attributes, {}, {}, 0
        self.text = self._node(unit)

    def _name(self, name: str) -> str:
        return name if name in _BUILTINS else self.names.setdefault(name, f"n{len(self.names)}")

    def _node(self, node: ast.AST) -> str:
        self.size += 1
        if isinstance(node, ast.Name):
            return self._name(node.id)
        if isinstance(node, ast.arg):
            return f"arg({self._name(node.arg)})"
        if isinstance(node, ast.JoinedStr) or isinstance(node, ast.Constant) and isinstance(node.value, str):
            return "''"
        if isinstance(node, ast.Constant):
            return repr(node.value)
        if isinstance(node, ast.Attribute):
            attr = (self.attrs.setdefault(node.attr, f"a{len(self.attrs)}") if node.attr in self.attributes
                    else node.attr)
            return f"{self._node(node.value)}.{attr}"
        parts = []
        for field, value in ast.iter_fields(node):
            if field in _DROPPED_FIELDS:
                continue
            if field == "name" and isinstance(value, str) and not isinstance(node, ast.alias):  # not an import's
                parts.append(self._name(value))
            elif isinstance(value, list):
                parts.append("[" + ",".join(self._node(v) if isinstance(v, ast.AST) else repr(v)
                                            for v in value if not _is_text(v)) + "]")
            else:
                parts.append(self._node(value) if isinstance(value, ast.AST) else repr(value))
        kind = "Assign" if isinstance(node, ast.AnnAssign) else type(node).__name__  # `x: int = 1` is `x = 1`
        return f"{kind}({','.join(parts)})"


Unit = tuple[str, int, str, str]  # (where, line, name, fingerprint)


def _units(source: str, where: str, lines: set[int] | None = None) -> list[Unit]:
    """Every function, method and class of `source` with at least MIN_NODES nodes once normalised, as
    (where, line, name, fingerprint); only those that span one of `lines`, when given. Unparsable code: none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    units = []
    for node, (size, attributes) in _definitions(tree).items():
        if size < MIN_NODES or (lines is not None and not any(node.lineno <= n <= node.end_lineno for n in lines)):
            continue  # normalising only removes nodes: too small as written is too small normalised
        fingerprint = _Fingerprint(node, attributes)
        if fingerprint.size >= MIN_NODES:
            units.append((where, node.lineno, node.name, fingerprint.text))
    return sorted(units)


def solution_units(solution: Path) -> list[Unit]:
    """The functions, methods and classes of a solution that hold fenced code: what an exercise asks for."""
    source, fenced, inside = solution.read_text(), set(), False
    for number, line in enumerate(source.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN) or stripped.startswith(END):
            inside = stripped.startswith(BEGIN)
        elif inside:
            fenced.add(number)
    return _units(source, f"solutions/{solution.name}", lines=fenced)


def shipped_units(rel: str, data: bytes) -> list[Unit]:
    """The functions and classes of a shipped Python file, or of a notebook's code cells (IPython's magic lines
    blanked, so a %%writefile cell is read as the script it writes)."""
    if rel.endswith(".py"):
        return _units(data.decode(errors="replace"), rel)
    if not rel.endswith(".ipynb"):
        return []
    units = []
    for i, cell in enumerate(json.loads(data).get("cells", [])):
        if cell.get("cell_type") == "code":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
            units += _units(code, f"{rel} cell {i}")
    return units


def find_renamed_copies(files: dict[str, bytes], solutions: dict[str, Path]) -> tuple[list[str], int]:
    """(["where:line `name` is a renamed copy of solutions/X.py `name`", ...], how many solution units were
    looked for): shipped functions and classes whose normalised syntax tree equals that of a solution's function,
    method or class holding fenced code. Unlike the distinctive lines, this finds a solution whose names,
    docstring, comments and messages were changed."""
    wanted = {}
    for path in solutions.values():
        for where, _, name, fingerprint in solution_units(path):
            wanted.setdefault(fingerprint, f"{where} `{name}`")
    copies = [f"{where}:{line} `{name}` is a renamed copy of {wanted[fingerprint]}"
              for rel, data in files.items() for where, line, name, fingerprint in shipped_units(rel, data)
              if fingerprint in wanted]
    return copies, len(wanted)


# --- where it goes ---------------------------------------------------------------------------------
def _check_destination(dest: Path, root: Path) -> Path:
    dest = dest.expanduser().resolve()
    if dest == root or root in dest.parents:
        raise ReleaseError(f"{dest} is inside the course checkout {root}: choose a folder outside it")
    if dest.exists() and not dest.is_dir():
        raise ReleaseError(f"{dest} exists and is not a folder: choose a new or empty folder")
    if dest.is_dir() and any(dest.iterdir()):
        raise ReleaseError(f"{dest} exists and is not empty: choose a new or empty folder (nothing is ever "
                           "deleted or overwritten)")
    return dest


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _left_out(root: Path) -> list[str]:
    top = {Path(entry).parts[0] for entry in SHIPPED}
    out = [f"{p.name}/" if p.is_dir() else p.name for p in sorted(root.iterdir())
           if p.name not in top and p.name != ".git"]
    return out


def _manifest(root: Path, commit: str, dirty: list[str], files: dict[str, bytes], written: list[str],
              solutions: dict[str, Path], looked_for: int, units: int) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    shown = ", ".join(dirty[:10]) + (f" and {len(dirty) - 10} more" if len(dirty) > 10 else "")
    state = (f"with uncommitted changes in {len(dirty)} shipped path(s): {shown}" if dirty else
             "the shipped files matched the commit") if commit != "unknown" else "not a git checkout"
    lines = ["gpucourse student release", "",
             f"made:   {stamp} by `gpucourse release`",
             f"source: {root}",
             f"commit: {commit} ({state})", "",
             f"included ({len(files) + 1} files with this one): " + ", ".join(SHIPPED), "",
             "written for this release:"]
    lines += [f"  {w}" for w in written]
    lines += ["", "left out:",
              f"  solutions/ ({len(solutions)} files: {', '.join(p.name for p in solutions.values())})"]
    lines += [f"  {entry}" for entry in _left_out(root) if entry != "solutions/"]
    lines += ["",
              "so, in this release: `gpucourse make-exercises` and `make exercises` refuse (no solutions/ to generate",
              "from), `make bench` has no benchmarks to run, `gpucourse grade EX --target solutions` refuses, and",
              "`make test` has no tests to run (grade with `gpucourse grade EX`).", "",
              f"checked before writing: no file holds any of the {looked_for} distinctive lines of the solutions",
              f"(fenced solution code of at least {MIN_LINE_CHARS} characters that is not in its exercise),",
              f"and no function or class is a renamed copy of any of the {units} functions, methods and classes",
              "of the solutions that hold fenced code (syntax trees compared with names, strings, docstrings",
              f"and annotations normalised; units of at least {MIN_NODES} nodes).", ""]
    return "\n".join(lines)


# --- the release ------------------------------------------------------------------------------------
def make_release(dest: str | Path, root: Path | None = None, source: str = "") -> Path:
    """Write the learners' copy of the course at `dest` (new or empty, outside the checkout). Returns its manifest.
    source: the release's git URL, written into every chapter's Colab start cell (and a Colab badge, for GitHub).

    Raises ReleaseError before writing anything when dest is unsuitable, the checkout has no solutions/ (a
    release is made from the course's checkout), exercises/ is out of date, or a solution would leak.
    """
    root = (root or exercises.course_root()).resolve()
    solutions = exercises.solution_files(root / "solutions")
    if not solutions:
        raise ReleaseError(f"no solutions/ex*.py in {root}: a release is made from the course's own checkout "
                           "(this may already be a release)")
    dest = _check_destination(Path(dest), root)
    try:
        stale = exercises.generate_exercises(check=True, solutions=root / "solutions",
                                             exercises=root / "exercises")
    except ExerciseError as err:
        raise ReleaseError(f"exercises/ cannot be checked against solutions/: {err}") from None
    if stale:
        raise ReleaseError(f"exercises/ is out of date with solutions/ ({', '.join(p.name for p in stale)}): "
                           "run `gpucourse make-exercises` first")

    files = _shipped_files(root)
    commit = (_git(root, "rev-parse", "HEAD") or "unknown").strip() or "unknown"
    status = _git(root, "status", "--porcelain", "--", *SHIPPED) or ""
    dirty = sorted(path for path in (line[3:] for line in status.splitlines() if line.strip())
                   if path in files or any(rel.startswith(path) for rel in files if path.endswith("/")))
    written = [f"{name}: {why}" for name, why in (
        (f"{GRADERS}/{exercises.REQUIRED_NAMES}",
         "the names each exercise must define (read from the solutions; names only)"),
        ("README.md", "a note at the top saying what this copy is"))]
    required = {name: exercises.public_names(path) for name, path in solutions.items()}
    files[f"{GRADERS}/{exercises.REQUIRED_NAMES}"] = (json.dumps(required, indent=1) + "\n").encode()
    files["README.md"] = _readme_note(files["README.md"].decode(), commit).encode()
    written += _point_smoke_at_exercises(files)
    if source:
        written += _stamp_source(files, source)

    leaks, looked_for = find_leaks(files, solutions)
    if leaks:
        raise ReleaseError(f"nothing written: {len(leaks)} line(s) of solution code would ship, first "
                           f"{leaks[0]}: remove them from that file, then release again")
    copies, units = find_renamed_copies(files, solutions)
    if copies:
        raise ReleaseError(f"nothing written: renamed copies of solution code would ship ({len(copies)}), first "
                           f"{copies[0]}: run the learner's version from exercises/ (exercises.load_for_chapter) "
                           "or torch's own instead, then release again")

    manifest = _manifest(root, commit, dirty, files, written, solutions, looked_for, units)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for rel, data in files.items():
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "xb") as f:  # "x": never over a file that appeared meanwhile
                f.write(data)
        with open(dest / MANIFEST, "x") as f:
            f.write(manifest)
    except OSError as err:
        left = (f"{dest} is incomplete (left as it is, with no {MANIFEST})" if dest.exists() else
                "nothing was written")
        raise ReleaseError(f"writing the release failed ({err}): {left}; release again into a new folder") from None
    return dest / MANIFEST


# --- command line ------------------------------------------------------------------------------------
def _cmd_release(args) -> int:
    """Bad input raises ReleaseError; the CLI (cli.main) prints it as one line and exits 2."""
    manifest = make_release(args.dir, source=args.source or "")
    count = sum(1 for p in manifest.parent.rglob("*") if p.is_file())
    print(f"release written to {manifest.parent} ({count} files, no solutions); what it holds and what was "
          f"left out: {manifest}")
    return 0


def add_cli(subparsers) -> None:
    """Register `release` on an argparse subparsers object (func(args) -> exit code)."""
    p = subparsers.add_parser("release", help="write the learners' copy of the course (no solutions) to DIR",
                              description="Exit code: 0 written, 2 bad input (DIR not empty or inside the "
                                          "checkout, exercises/ stale, a solution would leak): nothing written.")
    p.add_argument("dir", metavar="DIR", help="a new or empty folder outside the checkout")
    p.add_argument("--source", metavar="URL", help="where learners will fetch this release (its git URL): written "
                   "into each chapter's first cell, for Colab and Kaggle (and an Open in Colab badge, for GitHub)")
    p.set_defaults(func=_cmd_release)
