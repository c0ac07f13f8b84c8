"""Colab and Kaggle: every chapter starts with the cell that fetches the course into a default python3 kernel
(gpucourse/tools/colab.py), and chapter 00 runs that way: a fresh environment that has torch and Jupyter but not
the course, the python3 kernel, no make lab, the first cell doing the rest."""
import os
import shutil
import subprocess
import sys
import sysconfig

import nbformat
import pytest

from gpucourse.tools import colab
from gpucourse.tools.course import find_notebooks, smoke_parameters, with_parameters

from tests.conftest import ROOT

GITHUB = "https://github.com/example-org/gpucourse.git"


@pytest.mark.parametrize("path", find_notebooks(), ids=lambda p: p.stem)
def test_every_chapter_starts_with_the_colab_cell(path):
    cells = nbformat.read(path, as_version=4).cells
    first_code = next(c for c in cells if c.cell_type == "code")
    assert first_code.get("id") == colab.CELL_ID, f"{path.name}: its first code cell is not the Colab start cell"
    assert first_code.source == colab.start_cell(), f"{path.name}: the start cell differs from gpucourse/tools/colab.py"


def test_stamp_writes_the_source_and_one_badge(tmp_path):
    path = tmp_path / find_notebooks()[0].name
    shutil.copy(find_notebooks()[0], path)
    colab.add_start_cell(path)
    assert colab.stamp(path, GITHUB) and not colab.stamp(path, GITHUB)  # a second stamp changes nothing
    nb = nbformat.read(path, as_version=4)
    code = next(c for c in nb.cells if c.get("id") == colab.CELL_ID).source
    assert code == colab.start_cell(GITHUB)
    assert nb.cells[0].source.count("colab-badge.svg") == 1
    assert f"github/example-org/gpucourse/blob/main/notebooks/{path.name}" in nb.cells[0].source
    assert colab.badge("https://gitlab.com/x/y", "00.ipynb") == ""  # only GitHub has Colab links


@pytest.mark.notebook
@pytest.mark.timeout(900)
def test_chapter_00_runs_the_colab_way(tmp_path, runs_dir):
    """A new environment sees torch, Jupyter and papermill (as Colab has them) but not the course: the course's
    site-packages are on its path through a .pth line, which Python does not scan for the course's own
    editable-install .pth. The notebook runs on the python3 kernel from a folder of its own (Colab's /content)."""
    env_dir = tmp_path / "colab-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env_dir], check=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / site / "colab.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run([python, "-c", "import torch, importlib.util as u; print(u.find_spec('gpucourse'))"],
                           capture_output=True, text=True, env=clean, cwd=tmp_path)
    assert probe.stdout.strip() == "None", f"the course is importable before the first cell: {probe}"
    subprocess.run([python, "-m", "ipykernel", "install", "--prefix", env_dir, "--name", "python3"], check=True,
                   capture_output=True, env=clean)

    chapter, content = find_notebooks()[0], tmp_path / "content"
    content.mkdir()
    with_parameters(chapter, content / chapter.name, smoke_parameters(chapter))
    colab.add_start_cell(content / chapter.name)  # (a no-op once the chapter has it)
    nb = nbformat.read(content / chapter.name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import gpucourse, sys; print(sys.executable, gpucourse.__file__)"))
    nbformat.write(nb, content / chapter.name)
    out = subprocess.run([python, "-m", "papermill", chapter.name, "executed.ipynb", "-k", "python3",
                          "--cwd", content], capture_output=True, text=True, cwd=content, timeout=800,
                         env={**clean, "GPUCOURSE_SOURCE": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    last = nbformat.read(content / "executed.ipynb", as_version=4).cells[-1].outputs[0]["text"].split()
    assert last == [str(python), str(ROOT / "gpucourse" / "__init__.py")]  # this env's kernel, the fetched course
    assert list(runs_dir.glob("00-hello-*")), "chapter 00's launches did not run"
