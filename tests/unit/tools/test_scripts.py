"""`gpucourse scripts`: scripts/ written from the chapters' %%writefile cells (nothing executed), or checked."""
import json

import pytest

from gpucourse.tools import scripts


def chapter(folder, name, *cells):
    nb = {"cells": [{"cell_type": kind, "metadata": {}, "source": source} for kind, source in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (folder / name).write_text(json.dumps(nb))


@pytest.fixture
def course(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "scripts").mkdir()
    chapter(tmp_path / "notebooks", "01_a.ipynb", ("markdown", "%%writefile ../scripts/not_code.py\nx"),
            ("code", "%%writefile ../scripts/01_a.py\nprint('a')"), ("code", "print('not a script')"))
    return tmp_path


def test_a_cell_is_written_as_writefile_would_and_check_finds_what_differs(course):
    notebooks, script = course / "notebooks", course / "scripts" / "01_a.py"
    assert scripts.stale(notebooks) == [script.resolve()]          # missing
    assert scripts.write(notebooks) == [script.resolve()]
    assert script.read_text() == "print('a')\n"                    # the body and a final newline
    assert scripts.stale(notebooks) == [] and scripts.write(notebooks) == []
    script.write_text("print('edited by hand')\n")
    assert scripts.stale(notebooks) == [script.resolve()]
    assert not (course / "scripts" / "not_code.py").exists()       # a markdown cell writes nothing


def test_a_cell_writing_outside_scripts_or_two_cells_disagreeing_is_refused(course):
    notebooks = course / "notebooks"
    chapter(notebooks, "02_b.ipynb", ("code", "%%writefile ../scripts/01_a.py\nprint('b')"))
    with pytest.raises(ValueError, match="written differently by 01_a.ipynb and 02_b.ipynb"):
        scripts.written_scripts(notebooks)
    chapter(notebooks, "02_b.ipynb", ("code", "%%writefile ../elsewhere.py\nprint('b')"))
    with pytest.raises(ValueError, match="outside scripts/"):
        scripts.written_scripts(notebooks)
