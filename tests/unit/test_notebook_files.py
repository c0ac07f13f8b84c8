"""Every chapter notebook, read without running it: stored stripped, on the course's kernel, with its parameters
and smoke values, short cells, and in sync with scripts/. (Executed in CI, papermill and nbval:
tests/integration/test_notebooks.py.)"""
import ast
import re

import nbformat
import pytest

from gpucourse.tools.course import (CHECK_MARK, chapter_key, expected_outputs_file, find_notebooks, smoke_parameters,
                                    with_parameters)

from tests.conftest import ROOT

NOTEBOOKS = find_notebooks()
WRITEFILE = re.compile(r"^%%writefile\s+(\S+)\s*\n", re.M)


def _cells(path):
    return nbformat.read(path, as_version=4).cells


def test_there_are_notebooks():
    assert NOTEBOOKS and NOTEBOOKS[0].name == "00_setup_and_first_launch.ipynb"


CHECKED = [p for p in NOTEBOOKS if any(CHECK_MARK in c.source for c in _cells(p))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_stripped(path):
    for i, cell in enumerate(_cells(path)):
        if cell.cell_type != "code":
            continue
        assert cell.execution_count is None, f"{path.name} cell {i} has an execution count: strip it"
        assert not cell.outputs, f"{path.name} cell {i} is stored with outputs: strip it (nbstripout)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_on_the_course_kernel(path):
    """`make lab` registers the "gpucourse" kernel (the course's .venv); a notebook naming "python3" would open
    on whatever Python JupyterLab finds first, maybe one without torch. Batch runs pick their kernel themselves."""
    spec = nbformat.read(path, as_version=4).metadata.get("kernelspec", {})
    assert spec.get("name") == "gpucourse" and spec.get("display_name") == "Python (gpucourse)", spec


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_quick_checks_keep_their_answers_out_of_sight(path):
    """A quiz cell's source holds the answer and its explanation: JupyterLab shows it collapsed."""
    for i, cell in enumerate(_cells(path)):
        if cell.cell_type == "code" and "QuickCheck(" in cell.source:
            assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, \
                f"{path.name} cell {i} shows a quiz's answer above the quiz: set metadata.jupyter.source_hidden"


LINES_THAT_MATTER = "**The lines that matter**"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_lines_that_matter_are_the_scripts_own(path):
    """The box before a long script quotes its key lines: each must still be a line of the script that follows."""
    cells = _cells(path)
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown" or LINES_THAT_MATTER not in cell.source:
            continue
        script = next(c.source for c in cells[i + 1:] if c.cell_type == "code" and c.source.startswith("%%writefile"))
        quoted = re.search(r"```python\n(.*?)```", cell.source[cell.source.index(LINES_THAT_MATTER):], re.S)
        assert quoted, f"{path.name} cell {i}: the lines that matter need a ```python block"
        lines = [ln.strip() for ln in quoted.group(1).splitlines() if ln.strip() and not ln.startswith("#")]
        own = {ln.strip() for ln in script.splitlines()}
        assert lines and not [ln for ln in lines if ln not in own], \
            f"{path.name} cell {i} quotes lines the script no longer has: {[ln for ln in lines if ln not in own]}"
        stated = re.search(r"\((\d+) of its (\d+)\b", cell.source)  # "(9 of its 320, ...)": both counts true
        if stated:
            assert (int(stated.group(1)), int(stated.group(2))) == (len(lines), len(script.splitlines()) - 1), \
                f"{path.name} cell {i} says {stated.group(0)}): the box quotes {len(lines)} lines of {len(script.splitlines()) - 1}"


# Every cell a learner runs (a %%writefile cell aside) within 15 lines, and no line wider than 120 columns, so that a
# cell reads on one screen.
CELL_LINES, LINE_COLUMNS = 15, 120


def page_debt(path) -> tuple[int, int]:
    """(code cells over CELL_LINES lines, lines over LINE_COLUMNS columns) among the cells a learner runs."""
    code = [c.source for c in _cells(path) if c.cell_type == "code" and not WRITEFILE.match(c.source)]
    return (sum(len(s.splitlines()) > CELL_LINES for s in code),
            sum(len(line) > LINE_COLUMNS for s in code for line in s.splitlines()))


def test_page_debt_counts_long_cells_and_wide_lines_but_not_scripts(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1\n" * 16), nbformat.v4.new_code_cell("y = '" + "a" * 130 + "'"),
                nbformat.v4.new_code_cell("%%writefile s.py\n" + "z = 1\n" * 40)]
    nbformat.write(nb, tmp_path / "99.ipynb")
    assert page_debt(tmp_path / "99.ipynb") == (1, 1)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_reads_on_one_screen(path):
    long_cells, wide_lines = page_debt(path)
    assert (long_cells, wide_lines) == (0, 0), (
        f"{path.name}: {long_cells} code cell(s) over {CELL_LINES} lines and {wide_lines} line(s) over {LINE_COLUMNS} "
        "columns: split the cell, or move its analysis into the package")


# A notebook imports the package one way (gpucourse/__init__.py): `import gpucourse`, the short names
# (`from gpucourse import costs`, `from gpucourse.quiz import QuickCheck`) and its chapter's module
# (`from gpucourse.chapters import ch05`); never a layer path such as gpucourse.viz.quiz.
LAYERS = ("run", "models", "viz", "tools")
def layer_paths(source: str) -> list[str]:
    """The lines of a code cell that name a layer of the package: `from gpucourse.viz import problems`,
    `from gpucourse import viz`, `import gpucourse.run.contract`, `gpucourse.models.costs.busbw(...)`."""
    code = re.sub(r"^[ \t]*[%!].*$", "", source, flags=re.M)  # IPython's line magics: not Python
    lines = code.splitlines()

    def layer(name: str) -> bool:
        parts = name.split(".")
        return parts[0] == "gpucourse" and len(parts) > 1 and parts[1] in LAYERS

    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        else:
            continue
        if any(layer(n) for n in names):
            found.append(lines[node.lineno - 1].strip())
    return found


def test_layer_paths_finds_every_way_of_naming_a_layer():
    assert layer_paths("%matplotlib inline\nimport gpucourse\nfrom gpucourse import costs, problems\n"
                       "from gpucourse.quiz import QuickCheck\nfrom gpucourse.chapters import ch05\n"
                       "gpucourse.launch('s.py')\n") == []
    assert layer_paths("from gpucourse.viz.quiz import QuickCheck\nfrom gpucourse import viz\n"
                       "import gpucourse.models.costs as c\nx = gpucourse.run.launcher\n") == [
        "from gpucourse.viz.quiz import QuickCheck", "from gpucourse import viz", "import gpucourse.models.costs as c",
        "x = gpucourse.run.launcher"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_imports_the_package_by_its_short_names(path):
    named = [f"cell {i} ({cell.id}): {line}" for i, cell in enumerate(_cells(path))
             if cell.cell_type == "code" and not WRITEFILE.match(cell.source) for line in layer_paths(cell.source)]
    assert not named, (f"{path.name} names a layer of gpucourse: import its short name instead "
                       "(`from gpucourse import problems`, `from gpucourse.quiz import QuickCheck`; a module without "
                       "one: add it to _MODULES in gpucourse/__init__.py):\n" + "\n".join(named))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_imports_cell_turns_on_inline_figures(path):
    """The package's charts are Figures built without pyplot: a kernel shows them as '<Figure size ...>' text
    until the inline backend is on. The first code cell after the parameters turns it on."""
    cells = nbformat.read(path, as_version=4).cells
    params = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    imports = next(c for c in cells[params + 1:] if c.cell_type == "code")
    assert imports.source.startswith("%matplotlib inline\n"), f"{path.name}: start its imports cell with it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_has_parameters_cell_and_smoke_values(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    smoke = nb.metadata.get("gpucourse", {}).get("smoke", {})
    defined = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*=", tagged[0].source, re.M))
    assert set(smoke) <= defined, f"smoke parameters {set(smoke) - defined} are not in the parameters cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_smoke_copy_sets_the_smoke_values(path, tmp_path):
    """The copy the browser pass opens in JupyterLab (papermill's injection, outside papermill): its parameters
    cell then the injected one, run as Python, leave exactly the smoke values, and nothing else changed."""
    smoke = smoke_parameters(path)
    copy = nbformat.read(with_parameters(path, tmp_path / path.name, smoke), as_version=4)
    original = _cells(path)
    at = next(i for i, c in enumerate(copy.cells) if "parameters" in c.metadata.get("tags", []))
    injected = copy.cells[at + 1]
    assert injected.metadata.tags == ["injected-parameters"]
    assert [c.source for c in copy.cells[:at + 1] + copy.cells[at + 2:]] == [c.source for c in original]
    names: dict = {}
    exec(copy.cells[at].source + "\n" + injected.source, names)
    assert {k: names[k] for k in smoke} == smoke


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_scripts_equal_what_the_notebook_writes(path):
    for cell in _cells(path):
        m = WRITEFILE.match(cell.source)
        if not m:
            continue
        target = (path.parent / m.group(1)).resolve()
        assert target.parent == ROOT / "scripts", f"{path.name} writes outside scripts/: {m.group(1)}"
        assert target.exists(), f"{target.name} is missing: run `gpucourse scripts` and commit scripts/"
        body = cell.source[m.end():]
        # %%writefile writes the cell body plus a final newline
        assert target.read_text() == body + ("\n" if not body.endswith("\n") else ""), (
            f"scripts/{target.name} differs from what {path.name} writes: run `gpucourse scripts` (it writes scripts/ "
            "from the cells) and commit both")


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.stem)
def test_checked_cells_have_stored_reference_outputs(path):
    import json

    ids = {c.id for c in _cells(path) if c.cell_type == "code" and CHECK_MARK in c.source}
    stored = json.loads(expected_outputs_file(path).read_text())
    assert set(stored) == ids and all(stored.values()), (
        f"refresh with: gpucourse course --only {chapter_key(path)}_ --refresh-checked")
