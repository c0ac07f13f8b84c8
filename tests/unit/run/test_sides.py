"""One side of the process boundary per run/ module: its docstring's first line says where it runs, and the modules
that run in each rank import nothing of the launcher's side (a rank stays light, and a reader's change cannot
break a rank)."""
import ast
from pathlib import Path

RUN = Path(__file__).resolve().parents[3] / "gpucourse" / "run"
SIDES = {"In each rank": "rank", "In the launcher's": "launcher", "In the agent's": "agent", "Both sides": "both"}


def _side(path: Path) -> str | None:
    first = (ast.get_docstring(ast.parse(path.read_text())) or "").splitlines()[0] if path.stat().st_size else ""
    return next((side for prefix, side in SIDES.items() if first.startswith(prefix)), None)


def _imports(path: Path) -> set[str]:
    """The run/ modules a module imports (at its top or inside a function), by file name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {f"{node.module}.py"} if node.module else {f"{a.name}.py" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpucourse.run."):
            out.add(node.module.split(".")[2] + ".py")
    return out & {p.name for p in RUN.glob("*.py")}


def test_each_module_says_its_side():
    unsaid = [p.name for p in sorted(RUN.glob("*.py")) if _side(p) is None]
    assert not unsaid, f"run/ modules whose docstring's first line does not start with one of {list(SIDES)}: {unsaid}"


def test_the_ranks_side_imports_nothing_of_the_launchers():
    sides = {p.name: _side(p) for p in RUN.glob("*.py")}
    wrong = {name: sorted(m for m in _imports(RUN / name) if sides[m] not in ("rank", "both"))
             for name, side in sides.items() if side == "rank"}
    assert not {k: v for k, v in wrong.items() if v}, wrong
    assert {"runtime.py", "capture.py", "fake.py", "counting.py"} <= {n for n, s in sides.items() if s == "rank"}
