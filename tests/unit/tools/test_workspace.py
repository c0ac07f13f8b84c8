"""The learner's copy of the chapters (`gpucourse workspace`, what `make lab` opens): copied once, never
overwritten, updates reported, a refresh keeps the learner's copy. (Every chapter runs from such a copy in
tests/integration/test_notebooks.py.)"""
import json
from pathlib import Path

import pytest

from gpucourse.tools.workspace import RECORD, WorkspaceError, refresh, sync

from tests.conftest import ROOT, run_cli


@pytest.fixture
def course(tmp_path):
    """Two fake chapters in a notebooks/ folder of their own."""
    books = tmp_path / "notebooks"
    books.mkdir()
    for name in ("00_a.ipynb", "01_b.ipynb"):
        (books / name).write_text(json.dumps({"cells": [], "v": name}))
    return sorted(books.glob("*.ipynb"))


def test_copies_once_and_never_overwrites_the_learners_work(course, tmp_path):
    mine = tmp_path / "mywork"
    assert sync(mine, course) == {"copied": ["00_a.ipynb", "01_b.ipynb"], "updated": [], "kept": []}
    (mine / "00_a.ipynb").write_text("my notes")
    assert sync(mine, course) == {"copied": [], "updated": [], "kept": ["00_a.ipynb", "01_b.ipynb"]}
    assert (mine / "00_a.ipynb").read_text() == "my notes"


def test_an_updated_chapter_is_reported_and_refresh_keeps_the_old_copy(course, tmp_path):
    mine = tmp_path / "mywork"
    sync(mine, course)
    (mine / "01_b.ipynb").write_text("my notes")
    course[1].write_text("the course's new version")
    assert sync(mine, course)["updated"] == ["01_b.ipynb"]
    assert (mine / "01_b.ipynb").read_text() == "my notes"  # reported, not replaced
    new, kept = refresh(mine, "01", course)
    assert new.read_text() == "the course's new version" and kept.read_text() == "my notes"
    assert kept.name.startswith("01_b-mine-") and sync(mine, course)["updated"] == []


def test_bad_input_says_what_to_do_and_loses_nothing(course, tmp_path):
    mine = tmp_path / "mywork"
    sync(mine, course)
    with pytest.raises(WorkspaceError, match="name one of 00, 01"):
        refresh(mine, "7", course)
    (mine / RECORD).write_text("{not json")
    with pytest.raises(WorkspaceError, match="delete it"):
        sync(mine, course)
    assert sorted(p.name for p in mine.glob("*.ipynb")) == ["00_a.ipynb", "01_b.ipynb"]
    out = run_cli("workspace", "--dir", mine, "--refresh", "7")
    assert out.returncode == 2 and "no single chapter '7'" in out.stderr and "Traceback" not in out.stderr


def test_a_lettered_chapter_follows_its_number_everywhere(tmp_path, monkeypatch):
    """07b (a chapter split from 07) is found, ordered after 07, keyed apart from it, and refreshed by its key."""
    from gpucourse.tools import course as course_mod

    books = tmp_path / "notebooks"
    books.mkdir()
    for name in ("08_c.ipynb", "07b_b.ipynb", "07_a.ipynb", "00_z.ipynb", "07-notes.ipynb", ".nbval-07_a.ipynb"):
        (books / name).write_text(json.dumps({"cells": [], "v": name}))
    monkeypatch.setattr(course_mod, "notebooks_dir", lambda: books)
    found = course_mod.find_notebooks()
    assert [p.name for p in found] == ["00_z.ipynb", "07_a.ipynb", "07b_b.ipynb", "08_c.ipynb"]
    assert [course_mod.chapter_key(p) for p in found] == ["00", "07", "07b", "08"]
    assert [p.name for p in course_mod.find_notebooks(["07"])] == ["07_a.ipynb", "07b_b.ipynb"]
    assert [p.name for p in course_mod.find_notebooks(["07b"])] == ["07b_b.ipynb"]
    with pytest.raises(course_mod.CourseError, match="not a chapter's file name"):
        course_mod.chapter_key(books / "07-notes.ipynb")
    mine = tmp_path / "mywork"
    sync(mine, found)
    assert refresh(mine, "07", found)[0].name == "07_a.ipynb"
    assert refresh(mine, "07b", found)[0].name == "07b_b.ipynb"


def test_the_workspace_goes_beside_the_clone_it_is_run_in(tmp_path):
    """Two clones, one environment: `gpucourse workspace` run in the second clone (here, from a folder
    inside it) copies that clone's chapters into that clone's mywork/, not the installed package's checkout's."""
    from gpucourse.run.paths import project_root

    clone = tmp_path / "second-clone"
    (clone / "notebooks").mkdir(parents=True)
    (clone / "scripts").mkdir()
    (clone / "pyproject.toml").write_text('[project]\nname = "gpucourse"\n')
    (clone / "notebooks" / "00_only_here.ipynb").write_text(json.dumps({"cells": [], "v": "clone"}))
    out = run_cli("workspace", cwd=clone / "scripts")
    assert out.returncode == 0, out.stderr
    assert [p.name for p in (clone / "mywork").glob("*.ipynb")] == ["00_only_here.ipynb"]
    assert f"the course's chapters: {clone / 'notebooks'}/" in out.stdout and f"{clone / 'mywork'}/" in out.stdout
    assert not (project_root() / "mywork" / "00_only_here.ipynb").exists()


def test_outside_any_clone_the_workspace_names_the_packages_checkout(tmp_path):
    from gpucourse.tools.workspace import checkout_of, course_notebooks

    (tmp_path / "notebooks").mkdir()  # a notebooks/ folder alone is not a checkout of the course
    assert checkout_of(tmp_path) is None
    assert course_notebooks(tmp_path) == course_notebooks(Path(__file__).parent) == ROOT / "notebooks"
