"""The package's import graph, read from its source with `ast` (nothing is imported).

Imports go one way: no cycle among gpucourse's modules, counting the imports made inside functions; every module
sits in one of five layers (LAYERS: run, models, viz, chapters, tools) and imports from its own layer and lower ones
only; a chapter's module never imports another chapter's.
And no module uses another module's private names (`from .x import _y`, or `x._y`); a private module (`_name.py`)
may be imported from inside its own package only.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # tests/unit/test_architecture.py -> the checkout
PACKAGE = "gpucourse"


def read_package(root: Path = ROOT) -> dict[str, str]:
    """{path relative to root: source} for every module of the package."""
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted((root / PACKAGE).rglob("*.py"))}


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def uses(sources: dict[str, str]) -> dict[str, list[tuple[str, str | None, int]]]:
    """{module: [(other module, name or None, line)]}: each import of another package module, with the name
    imported from it (None when the module itself is imported), and each `module._name` read."""
    modules = {module_name(path): path for path in sources}
    found = {}
    for me, path in modules.items():
        tree = ast.parse(sources[path], path)
        package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
        mine, aliases, attributes = [], {}, []  # aliases: local name -> the package module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if private(node.attr):
                    attributes.append(node)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        mine.append((a.name, None, node.lineno))
                        local = a.asname or a.name.partition(".")[0]
                        aliases[local] = a.name if a.asname else local
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + [node.module] if node.module else up)
                for a in node.names:
                    if f"{base}.{a.name}" in modules:  # a submodule
                        mine.append((f"{base}.{a.name}", None, node.lineno))
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    elif base in modules:
                        mine.append((base, a.name, node.lineno))
        for node in attributes:  # `module._name`, `package.module._name`
            dotted, value = [], node.value
            while isinstance(value, ast.Attribute):
                dotted.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = ".".join([aliases[value.id], *dotted])
                if target in modules:
                    mine.append((target, node.attr, node.lineno))
        found[me] = [u for u in mine if u[0] != me]
    return found


def private_uses(used_by: dict) -> list[str]:
    """'importer line N: module.name' for every private name (or private module) used from outside its home."""
    bad = []
    for me, used in used_by.items():
        for target, name, line in used:
            parts = target.split(".")
            # a private module is private to the package that holds it
            foreign_module = any(private(p) and not me.startswith(".".join(parts[:i]) + ".")
                                 for i, p in enumerate(parts))
            if foreign_module or (name and private(name)):
                bad.append(f"{me} line {line}: {target}{'.' + name if name else ''}")
    return bad


def import_cycles(used_by: dict) -> list[str]:
    """Import cycles as 'a (line N) -> b (line M) -> a': a's line N imports b, b's line M imports a.

    Depth-first search: every cycle has an edge back to a module on the current path, reported here."""
    graph = {me: {} for me in used_by}
    for me, used in used_by.items():
        for target, _, line in used:
            graph[me].setdefault(target, line)
    cycles, path, state = [], [], {}  # state: 1 on the current path, 2 done

    def visit(me):
        state[me] = 1
        path.append(me)
        for other in sorted(graph[me]):
            if state.get(other) == 1:
                loop = path[path.index(other):]
                cycles.append(" -> ".join(f"{m} (line {graph[m][n]})" for m, n in zip(loop, loop[1:] + [other]))
                              + f" -> {other}")
            elif other not in state:
                visit(other)
        state[me] = 2
        path.pop()

    for me in sorted(graph):
        if me not in state:
            visit(me)
    return cycles


def test_the_checks_catch_a_cycle_and_a_private_name():
    sources = {"gpucourse/__init__.py": "",
               "gpucourse/a.py": "def f():\n    from .b import _g\n",
               "gpucourse/b.py": "from gpucourse import a\nx = a._h\n",
               "gpucourse/sub/__init__.py": "",
               "gpucourse/sub/_own.py": "",
               "gpucourse/sub/user.py": "from . import _own\nfrom .. import b\n"}
    assert import_cycles(uses(sources)) == ["gpucourse.a (line 2) -> gpucourse.b (line 1) -> gpucourse.a"]
    assert private_uses(uses(sources)) == ["gpucourse.a line 2: gpucourse.b._g", "gpucourse.b line 2: gpucourse.a._h"]
    sources["gpucourse/c.py"] = "from gpucourse.sub._own import X\n"
    assert private_uses(uses(sources))[-1] == "gpucourse.c line 1: gpucourse.sub._own.X"


@pytest.fixture(scope="module")
def package():
    used_by = uses(read_package())
    assert any(t == "gpucourse.run.contract" for t, _, _ in used_by["gpucourse.run.launcher"]), "no import was read"
    return used_by


def test_imports_go_one_way(package):
    cycles = import_cycles(package)
    assert not cycles, "import cycles among gpucourse's modules:\n" + "\n".join(cycles)


def test_no_module_uses_another_modules_private_names(package):
    bad = private_uses(package)
    assert not bad, ("private names used from another module (give the shared thing a public name in the "
                     "lowest module that both can import):\n" + "\n".join(bad))


# The package's five layers, lowest first, one folder each (gpucourse/<layer>/); a module may import its own
# layer's modules and lower ones only (chapters: lower ones only). What each owns: gpucourse/__init__.py and
# docs/architecture.md.
LAYERS = ("run", "models", "viz", "chapters", "tools")


def layer_of(module: str) -> str | None:
    """'run' for gpucourse.run.launcher; None for the package itself or a module outside every layer folder."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(used_by: dict) -> list[str]:
    """'importer (layer) line N -> module (layer)' for every import of a higher layer's module."""
    order = list(LAYERS)
    return [f"{me} ({layer_of(me)}) line {line} -> {target} ({layer_of(target)})"
            for me, used in used_by.items() if layer_of(me) for target, _, line in used
            if layer_of(target) and order.index(layer_of(target)) > order.index(layer_of(me))]


def test_the_layer_check_catches_an_upward_import():
    sources = {"gpucourse/__init__.py": "", "gpucourse/run/__init__.py": "", "gpucourse/viz/__init__.py": "",
               "gpucourse/run/launcher.py": "from ..viz import widgets\n",
               "gpucourse/viz/widgets.py": "from ..run.launcher import launch\n"}
    assert upward_imports(uses(sources)) == ["gpucourse.run.launcher (run) line 1 -> gpucourse.viz.widgets (viz)"]


def test_every_module_has_a_layer_and_imports_only_downwards(package):
    unplaced = sorted(m for m in package if m != PACKAGE and layer_of(m) is None)
    assert not unplaced, f"put each module in one of LAYERS (docs/architecture.md, 'Layers'): {unplaced}"
    upward = upward_imports(package)
    assert not upward, ("imports from a higher layer (move the shared thing down, or the importer up):\n"
                        + "\n".join(upward))


def short_alias_imports(sources: dict[str, str]) -> list[str]:
    """'path line N: from gpucourse import costs' for every package module that imports a layer module by the
    public short name (gpucourse/__init__.py's lazy aliases, `gpucourse.costs` too): such an import hides its layer
    from the checks above."""
    def short(name: str | None) -> bool:  # gpucourse.costs, gpucourse.grading.runner: not under a layer folder
        parts = (name or "").split(".")
        return parts[0] == PACKAGE and len(parts) > 1 and parts[1] not in LAYERS

    bad = []
    for path, source in sources.items():
        if path == f"{PACKAGE}/__init__.py":
            continue
        for node in ast.walk(ast.parse(source, path)):
            if isinstance(node, ast.ImportFrom) and node.module == PACKAGE and not node.level:
                bad += [f"{path} line {node.lineno}: from {PACKAGE} import {a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and short(node.module) and not node.level:
                bad.append(f"{path} line {node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                bad += [f"{path} line {node.lineno}: import {a.name}" for a in node.names if short(a.name)]
    return bad


def test_the_package_imports_its_modules_by_their_layer_path():
    assert short_alias_imports({"gpucourse/run/x.py": "from gpucourse import costs\n"}) == [
        "gpucourse/run/x.py line 1: from gpucourse import costs"]  # the check can fail
    assert short_alias_imports({"gpucourse/run/x.py": "import gpucourse.costs\nfrom gpucourse.plots import f\n"
                                                      "import gpucourse.models.costs\n"}) == [
        "gpucourse/run/x.py line 1: import gpucourse.costs", "gpucourse/run/x.py line 2: from gpucourse.plots import ..."]
    bad = short_alias_imports(read_package())
    assert not bad, "inside the package, import a module by its layer path (gpucourse.models.costs):\n" + "\n".join(bad)


def chapter_cross_imports(used_by: dict) -> list[str]:
    """'importer line N -> module' for every chapter module importing another chapter's module: what two chapters
    show is shared, and goes down into viz/."""
    return [f"{me} line {line} -> {target}" for me, used in used_by.items() if layer_of(me) == "chapters"
            for target, _, line in used if layer_of(target) == "chapters" and target != "gpucourse.chapters"]


def test_a_chapters_module_imports_no_other_chapters():
    sources = {"gpucourse/__init__.py": "", "gpucourse/chapters/__init__.py": "",
               "gpucourse/chapters/ch05.py": "from ..viz import tables\n",
               "gpucourse/chapters/ch07.py": "from . import ch05\n", "gpucourse/viz/tables.py": ""}
    assert chapter_cross_imports(uses(sources)) == ["gpucourse.chapters.ch07 line 1 -> gpucourse.chapters.ch05"]
    assert not upward_imports(uses(sources))  # the layer check alone would let it pass
    bad = chapter_cross_imports(uses(read_package()))
    assert not bad, "a chapter's module imports another chapter's (move what both show into viz/):\n" + "\n".join(bad)


# viz/ keeps what several chapters share; a table or figure of one chapter lives in gpucourse/chapters/chNN.py.
SHARED_MODULE_LINES = {"gpucourse/viz/tables.py": 400, "gpucourse/viz/plots.py": 400}


def test_the_shared_tables_and_figures_stay_short():
    long = {path: len((ROOT / path).read_text().splitlines()) for path in SHARED_MODULE_LINES}
    over = {path: n for path, n in long.items() if n > SHARED_MODULE_LINES[path]}
    assert not over, (f"{over} lines: at most {SHARED_MODULE_LINES}; move what one chapter shows into its module, "
                      "gpucourse/chapters/chNN.py")
