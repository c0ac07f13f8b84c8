"""The browser pass: every chapter run to the end in JupyterLab, in headless Chromium, as a learner sees it.

Each chapter, at the smoke sizes CI runs it with (metadata `gpucourse.smoke`, injected as papermill injects
them), runs all its cells in the `lab` of tests/integration/test_browser.py. Then every output is scrolled on screen
(JupyterLab draws only cells on screen) and checked as rendered: no error output; every live launch view
shows a pane with text or is collapsed to its status line; every widget fits (test_browser.py's assert_fits); no
output text runs past its box unless it scrolls by design; every image is an <img> the browser decoded;
no profiler "USDT" line in a live pane. Each launch view, widget and figure is saved as an element screenshot,
<chapter>-<n>-<what>.png, for a reviewer. And one numeric problem answered as a learner would: wrong (the hint),
wrong again (the worked solution), right, each answer recorded in the progress file.

A whole pass takes far longer than CI's browser budget (35-50 min on a loaded 2-core machine), so it carries the
`browser_pass` marker, deselected by default; `make browser-pass` runs it (GPUCOURSE_BROWSER_SIZES=default: at
the learner's sizes, the notebooks' own parameters).
"""
import json
import os
import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from gpucourse.tools.course import chapter_key, find_notebooks, smoke_parameters, with_parameters

from tests.conftest import ROOT
from tests.integration.test_browser import (KERNEL_START_S, PANEL, RUN_STATE, assert_fits, assert_nothing_running,
                                             browser, lab, open_notebook, ran, run_all, save_shot, scroll_to,
                                             shots_dir)

__all__ = ["lab", "browser"]  # fixtures, used by name

pytestmark = [pytest.mark.browser_pass, pytest.mark.timeout(1800)]

CHAPTERS = find_notebooks()  # notebooks/NN_*.ipynb (and NNb_*): a new chapter is in the pass as soon as it exists
# What a chapter reads beside notebooks/, as in a clone: scripts/ (the lab's copy starts empty; 03 launches 01's
# 01_bandwidth.py, 07b imports 09's 09_gpt_2d.py, and 09 imports its own before the cell that writes it), and
# what its scripts and smoke parameters name (../solutions, ../exercises, ../data).
SIBLINGS = ("scripts", "solutions", "exercises", "data")
CHAPTER_RUN_S = 1500  # a readiness wait, not a speed check: a chapter at smoke size takes minutes on a loaded machine

# JS: each top-level output of the cell (not the outputs inside an Output widget), marked with data-pass=<key>
# so Playwright can find it again, and what it is: a live launch view, another widget, a figure, or text.
OUTPUTS = """(cell, prefix) => Array.from(cell.querySelectorAll('.jp-OutputArea-output'))
    .filter(el => !el.parentElement.closest('.jp-OutputArea-output'))
    .map((el, i) => {
        el.dataset.pass = prefix + '-' + i;
        const kind = el.querySelector('.gpucourse-live') ? 'launch'
                   : el.querySelector('.jupyter-widgets') ? 'widget'
                   : el.querySelector('img') ? 'figure' : 'text';
        return {key: el.dataset.pass, kind};
    })"""
# JS: true once the browser has drawn the element (not skipped by JupyterLab's content-visibility: auto).
DRAWN = "el => el.checkVisibility({contentVisibilityAuto: true})"
# JS: output text wider than its box. JupyterLab's `.jp-OutputArea-output pre` is `white-space: pre-wrap;
# word-break: break-all` (the live view: `word-break: normal; overflow-wrap: anywhere`): every line wraps, and
# its `overflow-x: auto` is a fallback, not a design. So a wrapping <pre> wider than its box is text that ran
# out of it; only a <pre> that does not wrap (white-space: pre/nowrap, as an HTML table's may) and scrolls
# (overflow-x: auto/scroll) overflows by design.
OVERFLOWING_TEXT = """el => Array.from(el.querySelectorAll('pre'))
    .filter(pre => pre.clientWidth > 0 && pre.scrollWidth > pre.clientWidth)
    .map(pre => { const s = getComputedStyle(pre);
        return {text: pre.innerText.slice(0, 120), scroll: pre.scrollWidth, client: pre.clientWidth,
                whiteSpace: s.whiteSpace, overflowX: s.overflowX,
                byDesign: ['pre', 'nowrap'].includes(s.whiteSpace) && ['auto', 'scroll'].includes(s.overflowX)}; })
    .filter(p => !p.byDesign)"""
# JS: images the browser could not decode (an <img> with no natural width).
BROKEN_IMAGES = """el => Array.from(el.querySelectorAll('img'))
    .filter(img => !(img.complete && img.naturalWidth > 0)).map(img => img.src.slice(0, 60))"""
# JS: a live view as drawn: its status line, whether it has tabs, the text of the pane shown and of all panes.
LIVE_VIEW = """el => Array.from(el.querySelectorAll('.gpucourse-live')).map(view => {
    const status = view.querySelector('.widget-html-content');
    const panes = Array.from(view.querySelectorAll('.widget-tab-contents > .widget-output'));
    const shown = panes.find(p => !p.classList.contains('lm-mod-hidden'));
    return {status: status ? status.innerText : '', tabs: panes.length,
            shown: shown ? shown.innerText : null, all: panes.map(p => p.textContent).join('\\n')}; })"""
RUN_NAME = re.compile(r"— (\S+?)-\d{8}-\d{6}")  # a live view's status: "finished — 00-hello-2-20261125-064651 — ..."
# JS: per code cell, the outputs the kernel sent (model, not DOM): errors, stderr tracebacks, image counts.
MODEL_OUTPUTS = f"""path => {{ {PANEL}
    return panel.content.widgets.map((c, i) => {{
        if (c.model.type !== 'code') return null;
        const outs = c.model.outputs.toJSON();
        return {{index: i, count: c.model.executionCount, n: outs.length,
                errors: outs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
                tracebacks: outs.filter(o => o.output_type === 'stream' && o.name === 'stderr'
                                             && o.text.includes('Traceback (most recent call last)'))
                                .map(o => o.text.slice(-400)),
                images: outs.filter(o => o.data && (o.data['image/png'] || o.data['image/jpeg'])).length}};
    }}).filter(c => c !== null); }}"""


def _prepare(lab, path: Path) -> None:
    """The chapter in the lab's copy of notebooks/ with its smoke values (its own, a learner's, with
    GPUCOURSE_BROWSER_SIZES=default), its siblings beside it."""
    for name in SIBLINGS:
        shutil.copytree(ROOT / name, lab.root.parent / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    learner = os.environ.get("GPUCOURSE_BROWSER_SIZES") == "default"
    with_parameters(path, lab.root / path.name, {} if learner else smoke_parameters(path))


def _wait_ran(page, name: str) -> float:
    started = time.monotonic()
    state = page.wait_for_function(RUN_STATE, arg=name, timeout=CHAPTER_RUN_S * 1000, polling=500).json_value()
    assert "error" not in state, f"{name} raised in the browser: {state['error']}"
    return time.monotonic() - started


def _check_cell(page, cell, index: int, chapter: str, shots: list[Path], problems: dict) -> None:
    """Scroll one cell's outputs on screen, check each as drawn, screenshot the launch views, widgets, figures."""
    for out in cell.evaluate(OUTPUTS, f"{chapter}-{index}"):
        el = page.locator(f'[data-pass="{out["key"]}"]')
        el.scroll_into_view_if_needed()
        page.wait_for_function(DRAWN, arg=el.element_handle())
        page.wait_for_function("el => Array.from(el.querySelectorAll('img')).every(i => i.complete)",
                               arg=el.element_handle())
        where = f"cell {index} ({out['kind']})"
        if broken := el.evaluate(BROKEN_IMAGES):
            problems.setdefault("images not drawn", []).append((where, broken))
        if wide := el.evaluate(OVERFLOWING_TEXT):
            problems.setdefault("text past its box", []).append((where, wide))
        for view in el.evaluate(LIVE_VIEW):
            if view["tabs"] and not (view["shown"] or "").strip():
                problems.setdefault("blank live pane", []).append((where, view["status"]))
            if "USDT" in view["all"]:
                problems.setdefault("USDT in a live pane", []).append((where, view["status"]))
        if out["kind"] in ("launch", "widget"):
            for box in el.locator(".jupyter-widgets").all()[:1]:  # the outermost widget of the output
                try:
                    assert_fits(box)
                except AssertionError as cut:
                    problems.setdefault("widget cut", []).append((where, str(cut)[:600]))
        if out["kind"] != "text":
            what = out["kind"]
            if views := el.evaluate(LIVE_VIEW):  # the run's name, less its timestamp: "launch-00-hello-2"
                run = RUN_NAME.search(views[0]["status"])
                what += "-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", run.group(1)) if run else ""
            shot = shots_dir() / f"{chapter}-{len(shots) + 1:02d}-{what}-cell{index}.png"
            _screenshot(page, el, shot)
            shots.append(shot)


def _screenshot(page, el, path: Path) -> None:
    """An element screenshot of the whole output. The notebook scrolls inside JupyterLab's panel, not the page,
    so an output taller than the window would come out cut, toolbars around it: the window is made tall enough
    for it (same width, so nothing reflows sideways), then put back."""
    size = page.viewport_size
    height = el.bounding_box()["height"]
    if height > size["height"] - 250:
        page.set_viewport_size({"width": size["width"], "height": int(height) + 300})
        el.scroll_into_view_if_needed()
    try:
        el.screenshot(path=str(path))
    finally:
        page.set_viewport_size(size)


class _PatientBrowser:
    """The browser, its pages waiting up to KERNEL_START_S for JupyterLab's page to load: open_notebook's 30 s
    default (page.goto) ran out once on this loaded machine before the chapter even opened. Playwright's
    navigation timeout takes precedence over the default one open_notebook sets."""

    def __init__(self, browser):
        self._browser = browser

    def new_page(self, **kwargs):
        page = self._browser.new_page(**kwargs)
        page.set_default_navigation_timeout(KERNEL_START_S * 1000)
        return page


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_clean_in_the_browser(lab, browser, path):
    chapter = chapter_key(path)  # 07 and 07b: their screenshots apart
    for old in shots_dir().glob(f"{chapter}-*.png"):  # the folder holds the last run's pictures only
        old.unlink()
    _prepare(lab, path)
    page = open_notebook(_PatientBrowser(browser), lab, path.name)
    run_all(page)
    took = _wait_ran(page, path.name)
    sizes = "the notebook's own" if os.environ.get("GPUCOURSE_BROWSER_SIZES") == "default" else "smoke"
    print(f"{path.stem}: all cells ran in the browser in {took:.0f} s ({sizes} sizes)")

    cells = page.evaluate(MODEL_OUTPUTS, path.name)
    assert all(c["count"] is not None for c in cells), [c["index"] for c in cells if c["count"] is None]
    problems: dict[str, list] = {}
    for c in cells:
        if c["errors"]:
            problems.setdefault("error output", []).append((c["index"], c["errors"]))
        if c["tracebacks"]:
            problems.setdefault("traceback on stderr", []).append((c["index"], c["tracebacks"]))
    shots: list[Path] = []
    code_cells = page.locator(".jp-Notebook .jp-Cell.jp-CodeCell")
    assert code_cells.count() == len(cells), (code_cells.count(), len(cells))
    for i, c in enumerate(cells):
        if c["n"]:
            _check_cell(page, code_cells.nth(i), c["index"], chapter, shots, problems)
    # Every image output the kernel sent is drawn as an <img> (widgets' own images come on top).
    sent = sum(c["images"] for c in cells)
    drawn = page.evaluate("() => Array.from(document.querySelectorAll('.jp-Notebook .jp-RenderedImage img'))"
                          ".filter(img => !img.closest('.widget-output')).length")
    if drawn != sent:
        problems.setdefault("image outputs not drawn", []).append({"sent": sent, "drawn": drawn})
    (shots_dir() / f"{chapter}-report.json").write_text(json.dumps(
        {"chapter": path.stem, "seconds": round(took, 1), "shots": [s.name for s in shots], "problems": problems},
        indent=1, default=str) + "\n")
    print(f"{path.stem}: {len(shots)} screenshots in {shots_dir()}")
    assert not problems, json.dumps(problems, indent=1, default=str)[:6000]
    assert_nothing_running(lab)


def test_a_problem_answered_wrong_twice_then_right(lab, browser):
    """A numeric problem as a learner meets it: a wrong number gets the hint, a second the worked solution, the
    right one "Correct"; each answer is recorded in the progress file ($GPUCOURSE_PROGRESS) in its order."""
    from gpucourse import problems

    problem = problems.get("01.busbw-all-reduce")
    right = f"{problem.answer:.1f}"
    cells = [nbformat.v4.new_code_cell("import os\nos.environ['GPUCOURSE_PROGRESS'] = 'progress.jsonl'\n"
                                       "from gpucourse import problems\nproblems.get('01.busbw-all-reduce')")]
    page = ran(lab, browser, "problem.ipynb", cells)
    box = scroll_to(page.locator(".jp-OutputArea-output .widget-vbox").first)
    typed, feedback = box.locator("input[type=text]"), box.locator(".widget-html-content").last
    seen = []
    for answer, says in (("100", "Hint:"), ("101", "Worked solution:"), (right, "Correct:")):
        typed.fill(answer)
        box.get_by_role("button", name="Check").click()
        page.wait_for_function("([el, text]) => el.innerText.includes(text)", arg=[feedback.element_handle(), says])
        seen.append(feedback.inner_text())
    save_shot(page, "answered")
    assert "Worked solution:" not in seen[0] and problem.hint.split(".")[0] in seen[0], seen[0]
    assert problem.answer_text() in seen[1], seen[1]  # the worked solution states the answer
    recorded = [json.loads(line) for line in (lab.root / "progress.jsonl").read_text().splitlines()]
    assert [r["right"] for r in recorded] == [False, False, True], recorded
