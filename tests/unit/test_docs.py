"""The front door and the pages behind it stay true: the README short, every link and named file real, every chapter
in both chapter tables, and the "Add a chapter" recipe's files and steps where it says they are."""
import importlib
import re

import pytest

from gpucourse.tools.course import chapter_key, find_notebooks

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Files a page names in backquotes; the dated reports keep the names of their day, so they are not read here.
NAMED = re.compile(r"`((?:tests|gpucourse|scripts|benchmarks|docs|notebooks|solutions|exercises)/[\w./-]+)`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the detail to a page in docs/"


def test_slug_is_githubs():
    assert slug("The cluster on a laptop: `gpucourse dryrun`") == "the-cluster-on-a-laptop-gpucourse-dryrun"
    assert slug("CI's budget") == "cis-budget"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_named_file_is_there(page):
    text, broken = page.read_text(), []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no such heading)")
    for named in [] if page.name.startswith("gpu-report-") else NAMED.findall(text):  # dated: names of their day
        if not any(c in named for c in "<>*") and not (ROOT / named.rstrip("/")).exists():
            broken.append(f"`{named}`")
    assert not broken, f"{page.relative_to(ROOT)} points at what is not there: {broken}"


def test_the_checks_of_the_links_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Top\n[a](p.md#top) [b](gone.md) [c](p.md#nowhere)\n")
    assert [t for t in LINK.findall(page.read_text()) if "#" in t and t.partition("#")[2] not in anchors(page)] == [
        "p.md#nowhere"]


def chapter_rows(page) -> list[str]:
    """The keys of a chapter table's rows, `| 07b | `07b_...` |`, in order."""
    return [key for key, again in re.findall(r"^\| (\d\d[a-z]?) \| `(\d\d[a-z]?)_", page.read_text(), re.M)
            if key == again]


@pytest.mark.parametrize("page", ["README.md", "docs/chapters.md"])
def test_every_chapter_has_one_row_in_order(page):
    keys = [chapter_key(p) for p in find_notebooks()]
    assert chapter_rows(ROOT / page) == keys, f"{page}'s chapter table must list {keys}, one row each, in order"


def test_the_add_a_chapter_recipe_holds():
    """docs/architecture.md's recipe: the helpers it names exist, the GPU run runs every chapter, and a chapter's
    module goes where the recipe says, each listed in the layers table."""
    recipe = (ROOT / "docs" / "architecture.md").read_text().split("## Add a chapter")[1].split("\n## ")[0]
    assert "gpucourse.tools.colab.add_start_cell" in recipe and "`parameters`" in recipe and "metadata.gpucourse.smoke" in recipe
    assert callable(importlib.import_module("gpucourse.tools.colab").add_start_cell)
    runtime_text = (ROOT / "gpucourse" / "run" / "runtime.py").read_text()
    assert all(f"def {name}(" in runtime_text for name in ("setup", "log", "teardown"))
    gpu_run = (ROOT / "docs" / "gpu-run.sh").read_text()
    named = {n for line in re.findall(r"--notebook ((?:\d\d[a-z]? ?)+)", gpu_run) for n in line.split()}
    but = [line.split() for line in re.findall(r"--notebook-except ((?:\d\d[a-z]? ?)+)", gpu_run)]
    run = [p for p in find_notebooks() if p.stem.startswith(tuple(named))
           or any(not p.stem.startswith(tuple(prefixes)) for prefixes in but)]
    missing = [chapter_key(p) for p in find_notebooks() if p not in run]
    assert but and not missing, (f"docs/gpu-run.sh runs no chapter {missing} on a GPU: its notebooks check is to "
                                 "run every notebook but those run apart (--notebook-except), not a list of chapters")
    # step 3: a chapter's own tables and figures go in its module, which the layers table lists
    assert "`gpucourse/chapters/`" in recipe and "from gpucourse.chapters import ch13" in recipe
    layers = (ROOT / "docs" / "architecture.md").read_text().split("## Layers")[1].split("\n## ")[0]
    row = next(line for line in layers.splitlines() if line.startswith("| `gpucourse/chapters/` |"))
    listed = re.findall(r"`(ch\d\d[a-z]?)`", row.split("|")[2])
    modules = sorted(p.stem for p in (ROOT / "gpucourse" / "chapters").glob("ch*.py"))
    assert sorted(listed) == modules, f"docs/architecture.md's layers table lists {listed}; the chapter modules: {modules}"
