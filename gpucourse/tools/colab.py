"""Every chapter's first cell: on Colab or Kaggle it fetches the course and uses it from the running kernel (the
default python3 kernel; the preinstalled torch is kept); where the course is installed (make lab, a checkout) it
does nothing.

The course's git URL goes into the cell's COURSE_SOURCE when a release is written (`gpucourse release --source
URL`); $GPUCOURSE_SOURCE (a URL or a folder) overrides it. The cell does not pip-install the course: the kernel
imports it from the clone (sys.path) and the ranks through $PYTHONPATH, so nothing is built and no .pth file has
to be read by a kernel that is already running.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

CELL_ID = "colab-start"
SOURCE_LINE = re.compile(r'^COURSE_SOURCE = os\.environ\.get\("GPUCOURSE_SOURCE", ".*"\)', re.M)
CELL = '''\
# Colab or Kaggle: fetch the course and use it from this kernel (once, about a minute; the preinstalled torch is
# kept). Where the course is installed (make lab, a checkout) this cell does nothing.
import importlib.util, os, subprocess, sys  # noqa: E401
COURSE_SOURCE = os.environ.get("GPUCOURSE_SOURCE", "{source}")
if importlib.util.find_spec("gpucourse") is None:
    assert COURSE_SOURCE, "set COURSE_SOURCE in this cell to the course's git URL, then run the cell again"
    home = COURSE_SOURCE if os.path.isdir(COURSE_SOURCE) else os.path.abspath("gpucourse")
    if not os.path.isdir(home):
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", COURSE_SOURCE, home], check=True)
    missing = [m for m in ("psutil", "ipywidgets", "pandas", "matplotlib", "pytest") if not importlib.util.find_spec(m)]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing], check=True)
    sys.path.insert(0, home)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [home, os.environ.get("PYTHONPATH")]))  # the ranks
    os.chdir(os.path.join(home, "notebooks"))  # the chapters' ../scripts and ../exercises'''


def start_cell(source: str = "") -> str:
    """The first cell's code, for a course fetched from `source` (a git URL; "" until a release names one)."""
    return CELL.format(source=source)


def badge(source: str, notebook: str) -> str:
    """Markdown of an "Open in Colab" badge for a notebook of a course on GitHub, or "" for any other source."""
    found = re.match(r"https://github\.com/([^/]+/[^/.]+?)(?:\.git)?/?$", source)
    if not found:
        return ""
    url = f"https://colab.research.google.com/github/{found[1]}/blob/main/notebooks/{notebook}"
    return f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def stamp_notebook(nb: dict, name: str, source: str) -> bool:
    """Write `source` into a notebook's start cell, and a Colab badge under its title (a GitHub source only);
    True if the notebook (a dict, nbformat's JSON) changed. Stamping twice is stamping once."""
    before = json.dumps(nb)
    cell = next((c for c in nb["cells"] if c.get("id") == CELL_ID), None)
    if cell is None:  # not a chapter (every chapter has one: tests/integration/test_colab.py)
        return False
    text = SOURCE_LINE.sub(f'COURSE_SOURCE = os.environ.get("GPUCOURSE_SOURCE", "{source}")', "".join(cell["source"]))
    cell["source"] = text.splitlines(keepends=True)
    title = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    lines = "".join(title["source"]).splitlines()
    if len(lines) > 2 and "colab-badge.svg" in lines[2]:  # the badge of an earlier stamp: "# title", "", badge
        del lines[1:3]
    if badge(source, name):
        lines[1:1] = ["", badge(source, name)]
    title["source"] = "\n".join(lines).splitlines(keepends=True)
    return json.dumps(nb) != before


def stamp(path: Path, source: str) -> bool:
    """stamp_notebook on a notebook file, kept in the notebooks' JSON layout; True if it changed."""
    nb = json.loads(path.read_text())
    if not stamp_notebook(nb, path.name, source):
        return False
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    return True


def add_start_cell(path: Path) -> bool:
    """Put the start cell right after a notebook's title cell, unless it has one; True if it was added."""
    nb = json.loads(path.read_text())
    if any(c.get("id") == CELL_ID for c in nb["cells"]):
        return False
    cell = {"cell_type": "code", "execution_count": None, "id": CELL_ID, "metadata": {}, "outputs": [],
            "source": start_cell().splitlines(keepends=True)}
    nb["cells"].insert(1, cell)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    return True

