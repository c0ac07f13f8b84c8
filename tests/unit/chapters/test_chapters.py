"""The chapter layer as a whole (gpucourse/chapters/): one module a chapter, named by its notebook, every table in it
shown by the course's one rule."""
import importlib
import inspect
import re

import nbformat
import pytest

from gpucourse.tools.course import chapter_key, find_notebooks
from gpucourse.viz import tables

from tests.conftest import ROOT

MODULES = sorted(p.stem for p in (ROOT / "gpucourse" / "chapters").glob("ch*.py"))


def test_each_chapter_module_is_named_by_a_notebook_that_imports_it_by_its_short_name():
    notebooks = {chapter_key(p): p for p in find_notebooks()}
    assert MODULES and all(re.fullmatch(r"ch\d\d[a-z]?", m) for m in MODULES), MODULES
    for module in MODULES:
        notebook = notebooks.get(module.removeprefix("ch"))
        assert notebook, f"gpucourse/chapters/{module}.py names no chapter: {sorted(notebooks)}"
        code = [c.source for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]
        assert any(f"from gpucourse.chapters import {module}" in line for c in code for line in c.splitlines()), \
            f"{notebook.name} does not import its module: `from gpucourse.chapters import {module}`"


@pytest.mark.parametrize("module", MODULES)
def test_every_table_a_chapter_builds_is_a_table(module):
    mod = importlib.import_module(f"gpucourse.chapters.{module}")
    built = {name: f for name, f in vars(mod).items() if inspect.isfunction(f) and f.__module__ == mod.__name__
             and not name.startswith("_") and inspect.signature(f).return_annotation == "pd.DataFrame"}
    bare = [name for name, f in built.items() if not getattr(f, "__wrapped__", None)]
    assert not bare, f"{module}: {bare} build a DataFrame but are not @tables.as_table (the course's one rule)"
    assert all(getattr(f, "__wrapped__", None) for f in (tables.frame, tables.trace_breakdown))
