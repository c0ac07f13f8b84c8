"""JupyterLab in headless Chromium: what a learner sees when a notebook launches a job.

Each test starts its own JupyterLab on loopback, serving a temporary copy of notebooks/ (the repo is
never touched), drives it with Playwright through Debian's chromium (no browser download), and reads
the live launch view (gpucourse/run/live.py's WidgetView) from the page as rendered.
Skipped, with the reason, only when playwright or /usr/bin/chromium is missing.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import pytest

from gpucourse import labconfig

from tests.conftest import ROOT, run_processes

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed in this environment")

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
JUPYTER = ROOT / ".venv" / "bin" / "jupyter"
CHAPTER_00 = "00_setup_and_first_launch.ipynb"
FOREVER = Path(__file__).resolve().parents[1] / "browser_jobs" / "forever.py"
WORKER = Path(__file__).resolve().parents[1] / "jobs" / "worker.py"
SHOTS_ENV = "GPUCOURSE_BROWSER_SHOTS"  # where screenshots go; default <repo>/runs/browser-shots (git-ignored)

LAB_START_S = 180       # a readiness wait, not a speed check: ~10 s usually, over 60 s under heavy load
KERNEL_START_S = 120    # page load + kernel start: ~15 s
RUN_ALL_S = 240         # chapter 00 with NPROCS = [1, 2]: ~40 s alone, far more beside other tests
STOP_S = 20             # server + kernel shutdown

# JS: the notebook panel open on `path`, found through the app JupyterLab exposes on window.
PANEL = ("const panel = Array.from(window.jupyterapp.shell.widgets('main'))"
         ".find(w => w.context && w.context.path === path);")
KERNEL_IDLE = f"""path => {{ if (!window.jupyterapp) return false; {PANEL}
    const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
    return !!kernel && kernel.status === 'idle'; }}"""
# null while cells run; then {{done}} or the first error output (run-all stops there).
RUN_STATE = f"""path => {{ {PANEL}
    const cells = panel.content.widgets.filter(c => c.model.type === 'code');
    for (const c of cells)
        for (const o of c.model.outputs.toJSON())
            if (o.output_type === 'error') return {{error: o.ename + ': ' + o.evalue}};
    const kernel = panel.sessionContext.session.kernel;
    const ran = cells.every(c => c.model.executionCount !== null);
    return kernel.status === 'idle' && ran ? {{done: true}} : null; }}"""


@dataclass
class Lab:
    url: str           # http://127.0.0.1:<port>
    token: str
    root: Path         # the copied notebooks/ the server serves
    scripts: Path      # its sibling scripts/, where the notebooks' %%writefile cells write
    runs: Path         # GPUCOURSE_RUNS_DIR of the server and its kernels

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/lab/tree/{name}?token={self.token}"

    def run_dirs(self) -> list[Path]:
        return sorted(p for p in self.runs.iterdir() if p.is_dir()) if self.runs.exists() else []


def shots_dir() -> Path:
    """The one folder every browser test saves its screenshots in, for a reviewer to look at afterwards:
    $GPUCOURSE_BROWSER_SHOTS if set, else <repo>/runs/browser-shots (runs/ is git-ignored)."""
    folder = Path(os.environ.get(SHOTS_ENV) or ROOT / "runs" / "browser-shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_shot(target, what: str, test: str | None = None) -> Path:
    """Screenshot `target` (a Playwright page, or a locator for one widget) as shots_dir()/<test>-<what>.png.

    test defaults to the running test's name (pytest's PYTEST_CURRENT_TEST), parameters included; a later run
    overwrites the file, so the folder always holds the last run's pictures."""
    if test is None:
        current = os.environ.get("PYTEST_CURRENT_TEST", "browser").split("::")[-1].split(" ")[0]
        test = current
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{test}-{what}").strip("_")
    path = shots_dir() / f"{name}.png"
    target.screenshot(path=str(path))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_settings(settings_dir: Path) -> None:
    """User settings of a throwaway profile: no 'Would you like to get notified about Jupyter news?' toast.

    `--LabApp.news_url=None` stops the fetching but not that question, which covers part of the page."""
    path = settings_dir / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


def _wait_until_serving(proc, url: str, token: str, log: Path) -> None:
    deadline = time.monotonic() + LAB_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"jupyter lab did not answer within {LAB_START_S} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGTERM the server (it shuts its kernels down), then make sure none of its processes is left.

    Returns the processes that had to be killed by hand: the caller fails the test on any."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.terminate()
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(family, timeout=STOP_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def lab(tmp_path, runs_dir):
    """A JupyterLab on 127.0.0.1 serving a copy of notebooks/; stopped, kernels included, afterwards."""
    if not CHROMIUM.exists():  # skip before starting a server nobody will visit
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)")
    work = tmp_path / "course"
    shutil.copytree(ROOT / "notebooks", work / "notebooks")
    (work / "scripts").mkdir()
    _quiet_settings(tmp_path / "lab-settings")
    # The chapters open on the "gpucourse" kernel (`make lab` registers it): register it here, in a throwaway
    # prefix, for this Python.
    kernels = tmp_path / "kernels"
    subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(kernels), "--name", "gpucourse",
                    "--display-name", "Python (gpucourse)"], check=True, capture_output=True, timeout=120)
    port, token = _free_port(), os.urandom(16).hex()
    env = {**os.environ,  # with runs_dir's $GPUCOURSE_RUNS_DIR, for the server and its kernels
           "JUPYTER_PATH": os.pathsep.join(filter(None, [str(kernels / "share" / "jupyter"),
                                                         os.environ.get("JUPYTER_PATH")])),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"),
           # the server settings `make lab` writes into .venv (gpucourse/tools/labconfig.py), here in a config dir of its own
           "JUPYTER_CONFIG_DIR": str(labconfig.write(tmp_path / "jupyter-config").parent)}
    env.pop("GPUCOURSE_LIVE", None)  # the point is the widget view, whatever the caller's shell says
    cmd = [str(JUPYTER), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work / 'notebooks'}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = tmp_path / "jupyter-lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(proc, url, token, log)
        yield Lab(url, token, work / "notebooks", work / "scripts", runs_dir)
    finally:
        killed = _stop(proc)
    assert not killed, f"processes outlived JupyterLab's shutdown (killed now): {[p.pid for p in killed]}"


@pytest.fixture
def browser(monkeypatch):
    monkeypatch.setenv("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        try:
            chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        except sync_api.Error as e:
            pytest.skip(f"{CHROMIUM} could not be launched: {str(e).splitlines()[0]}")
        try:
            yield chromium
        finally:
            chromium.close()


def write_notebook(lab: Lab, name: str, cells: list) -> None:
    """A notebook of `cells` in the lab's folder, on the course's kernel (the lab fixture registers it)."""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "gpucourse", "display_name": "Python (gpucourse)",
                                                           "language": "python"}})
    nb.cells = cells
    nbformat.write(nb, lab.root / name)


def drawn_widget(page):
    """The page's first widget output, scrolled on screen, with its plots decoded."""
    box = page.locator(".jp-OutputArea-output .widget-vbox").first
    box.locator("img").first.wait_for(timeout=60_000)
    scroll_to(box)
    page.wait_for_function("box => Array.from(box.querySelectorAll('img')).every(i => i.complete)",
                           arg=box.element_handle())
    return box


def open_notebook(browser, lab: Lab, name: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30_000)
    page.goto(lab.notebook_url(name))
    page.wait_for_function(KERNEL_IDLE, arg=name, timeout=KERNEL_START_S * 1000, polling=250)
    return page


def run_all(page) -> None:
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def wait_all_ran(page, name: str) -> None:
    state = page.wait_for_function(RUN_STATE, arg=name, timeout=RUN_ALL_S * 1000, polling=500).json_value()
    assert "error" not in state, f"{name} raised in the browser: {state['error']}"


def ran(lab: Lab, browser, name: str, cells: list):
    """A notebook of `cells` written, opened and run to the end in the lab: its page."""
    write_notebook(lab, name, cells)
    page = open_notebook(browser, lab, name)
    run_all(page)
    wait_all_ran(page, name)
    return page


def launch_view(page, run_name_prefix: str):
    """The VBox gpucourse.launch displayed for the run whose directory name starts with run_name_prefix."""
    status = page.locator(".widget-html-content", has_text=f" {run_name_prefix}")
    view = page.locator(".widget-vbox").filter(has=status)
    assert view.count() == 1, f"expected one launch view for {run_name_prefix}, found {view.count()}"
    return view


def scroll_to(view):
    """Scroll the view on screen and wait until it is drawn: JupyterLab skips rendering cells off screen
    (CSS content-visibility), and their innerText, what a learner would read, is empty until then."""
    view.scroll_into_view_if_needed()
    view.page.wait_for_function("el => el.innerText.trim().length > 0", arg=view.element_handle())
    return view


def tab_titles(view) -> list[str]:
    return view.locator(".lm-TabBar-tabLabel").all_inner_texts()


def shown_pane(view, title: str | None = None):
    """The pane a learner sees: after clicking the tab `title`, if given (the others are hidden)."""
    if title is not None:
        view.locator(".lm-TabBar-tab", has_text=re.compile(f"^{title}$")).click()
    return view.locator(".widget-tab-contents > .widget-output:not(.lm-mod-hidden)")


def status_line(view) -> str:
    return view.locator(".widget-html-content").first.inner_text()


def word_break(pane) -> str:
    """How the browser breaks the pane's lines (the CSS computed for its text)."""
    return pane.locator("pre").first.evaluate("el => getComputedStyle(el).wordBreak")


def bar_style(view) -> str:
    classes = view.locator(".widget-hprogress .progress-bar").get_attribute("class")
    return re.search(r"progress-bar-(\w+)", classes).group(1)


def assert_nothing_running(lab: Lab) -> None:
    for run_dir in lab.run_dirs():
        assert run_processes(run_dir) == [], f"{run_dir.name} left processes behind"


def test_chapter_00_shows_a_live_view_per_launch(lab, browser):
    nb_path = lab.root / CHAPTER_00
    nb = nbformat.read(nb_path, as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source, n = re.subn(r"^NPROCS = .*$", "NPROCS = [1, 2]", params.source, flags=re.M)
    assert n == 1, f"{CHAPTER_00}'s parameters cell no longer sets NPROCS: update this test"
    nbformat.write(nb, nb_path)

    page = open_notebook(browser, lab, CHAPTER_00)
    kernel = page.evaluate(f"path => {{ {PANEL} return panel.sessionContext.session.kernel.name; }}", CHAPTER_00)
    assert kernel == "gpucourse", f"{CHAPTER_00} opened on the {kernel!r} kernel, not the course's"
    started = time.monotonic()
    run_all(page)
    wait_all_ran(page, CHAPTER_00)
    print(f"chapter 00 ran in the browser in {time.monotonic() - started:.1f} s")

    two = launch_view(page, "00-hello-2-")
    scroll_to(two)
    assert status_line(two).startswith("finished"), status_line(two)
    assert two.locator(".widget-hprogress .widget-label").inner_text() == "steps"
    assert bar_style(two) == "success"
    assert tab_titles(two) == ["all ranks", "rank 0", "rank 1"]
    everyone = shown_pane(two).inner_text()  # "all ranks" is the tab shown first
    assert "[rank 0] rank 0/2" in everyone and "[rank 1] rank 1/2" in everyone
    assert word_break(shown_pane(two)) == "normal"  # JupyterLab's own 'break-all' cut words in two
    rank0 = shown_pane(two, "rank 0").inner_text()
    assert "rank 0/2" in rank0 and "rank 1/2" not in rank0
    rank1 = shown_pane(two, "rank 1").inner_text()  # left selected for the screenshot
    assert "rank 1/2" in rank1 and "rank 0/2" not in rank1
    assert "all_reduce of all ranks = 1 (expected 1)" in rank1
    save_shot(page, "two-ranks-rank1-tab")

    one = scroll_to(launch_view(page, "00-hello-1-"))
    assert tab_titles(one) == ["all ranks", "rank 0"] and bar_style(one) == "success"

    # The failure demo: the view opens on the failing rank's tab, where its traceback is.
    failed = scroll_to(launch_view(page, "00-failure-"))
    assert status_line(failed).startswith("failed")
    assert failed.locator(".widget-hprogress").count() == 0  # it logs no total: a bar would have nothing to count
    assert failed.locator(".lm-TabBar-tab.lm-mod-current").inner_text() == "rank 1"
    assert "RuntimeError" in shown_pane(failed).inner_text()
    # One kind of prefix in the all-ranks pane: torch's '[rank1]: ' on the traceback becomes the view's '[rank 1] '.
    failed_everyone = shown_pane(failed, "all ranks").inner_text()
    assert "[rank 1] Traceback" in failed_everyone and "[rank1]:" not in failed_everyone
    # Kineto's 'USDT: ... profiler_start' lines stay in the log files, off the page (the all-ranks panes).
    assert not [text for text in (everyone, shown_pane(one).inner_text(), failed_everyone) if "USDT" in text]

    # Chapter 00 draws no plot; when a chapter does, every image output must render as an <img>.
    images = page.evaluate(f"""path => {{ {PANEL}
        return panel.content.widgets.flatMap(c => c.model.type === 'code' ? c.model.outputs.toJSON() : [])
                    .filter(o => o.data && o.data['image/png']).length; }}""", CHAPTER_00)
    assert page.locator(".jp-RenderedImage img").count() == images
    assert_nothing_running(lab)


def test_interrupt_button_stops_the_launch(lab, browser):
    script = lab.scripts / FOREVER.name
    shutil.copy(FOREVER, script)
    cells = [nbformat.v4.new_code_cell("import gpucourse"),
                nbformat.v4.new_code_cell(f"gpucourse.launch({str(script)!r}, nproc=2, name='forever', timeout=90)")]
    write_notebook(lab, "interrupt.ipynb", cells)

    page = open_notebook(browser, lab, "interrupt.ipynb")
    run_all(page)
    view = page.locator(".widget-vbox")
    everyone = shown_pane(view)
    # Both ranks are running and their output reached the page.
    everyone.filter(has_text="[rank 0] rank 0 step 1").wait_for(timeout=60_000)
    everyone.filter(has_text="[rank 1] rank 1 step 1").wait_for(timeout=10_000)
    assert lab.run_dirs() and run_processes(lab.run_dirs()[0]), "the job is not running"

    page.get_by_title("Interrupt the kernel").first.click()
    sync_api.expect(view.locator(".widget-html-content").first).to_contain_text("interrupted", timeout=30_000)
    # The cell ends with the KeyboardInterrupt the launcher re-raises once the job is stopped.
    state = page.wait_for_function(RUN_STATE, arg="interrupt.ipynb", timeout=30_000, polling=250).json_value()
    scroll_to(view)
    save_shot(page, "interrupted")

    assert state.get("error", "").startswith("KeyboardInterrupt"), state
    assert status_line(view).startswith("interrupted"), status_line(view)
    # forever.py logs steps but no total: no bar, the count in the status line
    assert view.locator(".widget-hprogress").count() == 0 and "steps done" in status_line(view)
    [run_dir] = lab.run_dirs()
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "interrupted"
    assert run_processes(run_dir) == [], "workers survived the interrupt"


def test_widgets_show_the_values_they_were_given(lab, browser):
    """The browser draws a slider from its value; with a step it snapped the value to its grid and sent the
    snapped one back to the kernel (7.5e9 parameters became 7.94e9, 8.8 ms became 7.94 ms)."""
    from gpucourse.viz.widgets import memory_calculator

    cells = [nbformat.v4.new_code_cell("from gpucourse.widgets import memory_calculator\n"
                                       "memory_calculator(num_params=7.5e9, world_size=64)"),
                nbformat.v4.new_code_cell("from gpucourse.widgets import scaling_simulator\n"
                                       "scaling_simulator({'compute_s': 0.0088, 'grad_bytes': 4 * 7.5e9,\n"
                                       "                   'alpha': 3e-4, 'beta': 2e-9, 'bucket_mb': 3.3})"),
                nbformat.v4.new_code_cell("from gpucourse.quiz import QuickCheck\n"
                                       "QuickCheck('Which option? `code`', ['this one', 'that one'], 1, 'ANSWER-TEXT')",
                                       metadata={"jupyter": {"source_hidden": True}})]  # as the chapters store it
    write_notebook(lab, "widgets.ipynb", cells)
    page = open_notebook(browser, lab, "widgets.ipynb")
    run_all(page)
    wait_all_ran(page, "widgets.ipynb")
    boxes = page.locator(".jp-OutputArea-output .widget-vbox")
    boxes.nth(1).wait_for(timeout=60_000)
    for i in range(2):
        scroll_to(boxes.nth(i))
    time.sleep(3)  # a snapped value would reach the kernel and come back as a new summary by now
    readouts = [boxes.nth(i).locator(".widget-readout").all_inner_texts() for i in range(2)]
    # d3's ".3g", as the sliders' readout_format says: the given values, not the nearest tenth of a decade
    assert readouts[0][0] == "7.50e+9", readouts
    assert readouts[1][:2] == ["7.50e+9", "8.80"] and "3.30" in readouts[1], readouts
    expected = memory_calculator(num_params=7.5e9, world_size=64).summary.value
    shown = boxes.nth(0).locator(".widget-html-content").first.inner_html()
    assert re.sub(r"\s+", " ", shown) == re.sub(r"\s+", " ", expected), (shown, expected)
    quiz = page.locator(".jp-Cell").nth(2)
    scroll_to(quiz)
    save_shot(page, "quiz-unanswered")
    assert "Which option?" in quiz.inner_text() and "ANSWER-TEXT" not in quiz.inner_text()  # not before answering
    assert quiz.locator("code").inner_text() == "code" and "`" not in quiz.inner_text()  # inline code, as Markdown


# JS: for each <select> in the element, the widest option's text (canvas measureText in the select's own
# computed font) against the width the select leaves for text (client width less its padding, where
# ipywidgets draws the arrow). A select never scrolls, so scrollWidth cannot tell: the label is just cut.
SELECT_FIT = """box => Array.from(box.querySelectorAll('select')).map(sel => {
    const style = getComputedStyle(sel);
    const ctx = document.createElement('canvas').getContext('2d');
    ctx.font = style.font;
    const text = Array.from(sel.options).map(o => o.text)
                      .reduce((a, b) => ctx.measureText(a).width >= ctx.measureText(b).width ? a : b);
    return {text, needed: ctx.measureText(text).width,
            room: sel.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight)}; })"""
# JS: labels cut with an ellipsis ("offload to CPU (..."): text that overflows the element it is drawn in.
CUT_LABELS = """box => Array.from(box.querySelectorAll('label, .widget-readout'))
    .filter(el => el.clientWidth > 0 && el.scrollWidth > el.clientWidth)
    .map(el => ({text: el.innerText, scroll: el.scrollWidth, client: el.clientWidth}))"""
# JS: text boxes (inputs, and HTML readouts such as a summary) whose text is wider than the box shows.
CUT_TEXT_BOXES = """box => Array.from(box.querySelectorAll('input[type=text], input[type=number], textarea, .widget-html-content'))
    .filter(el => el.clientWidth > 0 && el.scrollWidth > el.clientWidth)
    .map(el => ({text: (el.value || el.innerText).slice(0, 80), scroll: el.scrollWidth, client: el.clientWidth}))"""
# JS: the plot's natural width against what it is drawn at (max-width: 100% shrinks a wider one silently).
IMAGE_FIT = """box => Array.from(box.querySelectorAll('img')).map(img =>
    ({natural: img.naturalWidth, shown: img.clientWidth, container: img.parentElement.clientWidth}))"""


def test_memory_calculator_fits_its_box(lab, browser):
    """Chapter 07's calculator as rendered: no dropdown label cut ('Adam / AdamW (m,', 'bf16/fp16 + fp32 ma'),
    the plot drawn at its own size. (The title and legend inside the plot are checked in test_memory.py.)"""
    cells = [nbformat.v4.new_code_cell("from gpucourse.widgets import memory_calculator\n"
                                       "memory_calculator(num_params=7.5e9, world_size=64)")]
    box = drawn_widget(ran(lab, browser, "calculator.ipynb", cells))
    save_shot(box, "calculator")

    selects, images = box.evaluate(SELECT_FIT), box.evaluate(IMAGE_FIT)
    assert len(selects) == 2 and len(images) == 1, (selects, images)  # optimizer and precision; the plot
    assert_fits(box)


def assert_fits(box) -> None:
    """Nothing in a rendered widget is cut: dropdown texts fit their selects, no label overflows, no plot is
    shrunk. All problems at once: one failure says everything that is cut."""
    problems = {
        "dropdown text wider than its select (px)": [s for s in box.evaluate(SELECT_FIT) if s["needed"] > s["room"]],
        "labels cut": box.evaluate(CUT_LABELS),
        "text boxes cut": box.evaluate(CUT_TEXT_BOXES),
        "plot shrunk to fit": [i for i in box.evaluate(IMAGE_FIT) if i["natural"] > min(i["shown"], i["container"])],
    }
    assert not any(problems.values()), problems


def test_run_explorer_shows_a_profiled_run(lab, browser):
    """Chapter 03's run explorer on a real profiled job: the run listed, its timeline drawn, nothing cut."""
    worker = Path(__file__).resolve().parents[1] / "jobs" / "worker.py"
    cells = [nbformat.v4.new_code_cell(f"import gpucourse\nfrom gpucourse.widgets import run_explorer\n"
                                       f"gpucourse.launch({str(worker)!r}, nproc=2, args=['--steps', '4', "
                                       f"'--profile'], name='explored', live=False)"),
                nbformat.v4.new_code_cell("run_explorer()")]
    write_notebook(lab, "explorer.ipynb", cells)
    page = open_notebook(browser, lab, "explorer.ipynb")
    run_all(page)
    wait_all_ran(page, "explorer.ipynb")
    box = drawn_widget(page)
    chosen = box.locator("select").evaluate("sel => sel.options[sel.selectedIndex].text")
    assert chosen.startswith("explored"), chosen
    assert box.locator("img").count() == 2  # the timeline and the breakdown
    save_shot(box, "explorer")
    assert_fits(box)
    assert_nothing_running(lab)


# JS: from now on, every 200 ms, what the learner sees of cell `index` and of the kernel: the cell's prompt
# ("[*]:" while it runs), the kernel's status in JupyterLab's model, and the status bar's text; plus every
# message the page exchanges with the kernel (for the report when the status is wrong).
WATCH_STATUS = f"""([path, index]) => {{ {PANEL}
    const kernel = panel.sessionContext.session.kernel;
    const seen = {{samples: [], messages: []}};
    window.gpucourseWatch = seen;
    kernel.anyMessage.connect((_, {{msg, direction}}) => seen.messages.push({{
        t: performance.now(), direction, channel: msg.channel, type: msg.header.msg_type,
        parent: (msg.parent_header || {{}}).msg_type || null, parent_id: (msg.parent_header || {{}}).msg_id || null,
        id: msg.header.msg_id, state: (msg.content || {{}}).execution_state || null,
        code: msg.header.msg_type === 'execute_request' ? msg.content.code : null}}));
    seen.timer = setInterval(() => {{
        const cell = panel.content.widgets[index];
        const bar = document.querySelector('#jp-main-statusbar');
        seen.samples.push({{t: performance.now(), prompt: cell.node.querySelector('.jp-InputPrompt').innerText,
                            kernel: kernel.status, bar: bar ? bar.innerText.replace(/\\s+/g, ' ') : null}});
    }}, 200); }}"""


LAG_MS = 500


def test_status_stays_busy_while_a_launch_runs(lab, browser):
    """A learner saw the status bar say Idle while a launch cell was still running. A launch of ~20 s,
    the learner's view of it sampled every 200 ms: while the kernel runs the cell, its prompt says [*] and nothing
    says Idle."""
    script = lab.scripts / FOREVER.name
    shutil.copy(FOREVER, script)
    cells = [nbformat.v4.new_code_cell("import gpucourse"),
                nbformat.v4.new_code_cell(f"gpucourse.launch({str(script)!r}, nproc=2, name='busy', timeout=20, "
                                       "check=False)")]
    write_notebook(lab, "busy.ipynb", cells)
    page = open_notebook(browser, lab, "busy.ipynb")
    page.evaluate(WATCH_STATUS, ["busy.ipynb", 1])
    run_all(page)
    wait_all_ran(page, "busy.ipynb")
    seen = page.evaluate("() => { clearInterval(window.gpucourseWatch.timer); return window.gpucourseWatch; }")
    save_shot(page, "after")
    # The launch cell's execution, as the kernel reported it: from its execute_request's "busy" to its "idle". Before
    # and after, the prompt may say [*] while the kernel is rightly idle (queued behind the import, or just sent).
    # A margin of LAG_MS on both sides: the status bar is redrawn a frame after the status changes.
    launch_request = next(m["id"] for m in seen["messages"]
                          if m["type"] == "execute_request" and "gpucourse.launch" in m["code"])
    state_at = {m["state"]: m["t"] for m in seen["messages"]
                if m["type"] == "status" and m["parent_id"] == launch_request}
    assert {"busy", "idle"} <= state_at.keys(), f"the launch cell's busy/idle never came: {state_at}"
    running = [s for s in seen["samples"] if state_at["busy"] + LAG_MS < s["t"] < state_at["idle"] - LAG_MS]
    assert len(running) >= 20, f"only {len(running)} samples while the ~20 s launch ran"
    wrong = [s for s in running if s["prompt"].strip() != "[*]:" or s["kernel"] != "busy" or "Idle" in (s["bar"] or "")]
    # The kernel's iopub "idle"s whose parent is not an execute request: what JupyterLab may have taken for its status.
    foreign = sorted({m["parent"] for m in seen["messages"] if m["type"] == "status" and m["state"] == "idle"
                      and m["parent"] != "execute_request"})
    assert not wrong, (f"{len(wrong)} of {len(running)} samples taken while the cell ran say otherwise: {wrong[:3]}; "
                       f"idle statuses of other requests: {foreign}")


# JS: run `code` in the notebook's kernel (as a learner's extra cell would, but not in the notebook) and return
# what it printed: how a test reads the kernel's side of a widget after the browser moved it.
KERNEL_EVAL = f"""async ([path, code]) => {{ {PANEL}
    const future = panel.sessionContext.session.kernel.requestExecute({{code, store_history: false}});
    let text = '';
    future.onIOPub = msg => {{
        if (msg.header.msg_type === 'stream') text += msg.content.text;
        if (msg.header.msg_type === 'error') text += `ERROR ${{msg.content.ename}}: ${{msg.content.evalue}}`; }};
    await future.done;
    return text; }}"""


def kernel_eval(page, path: str, code: str) -> str:
    text = page.evaluate(KERNEL_EVAL, [path, code])
    assert not text.startswith("ERROR"), text
    return text


SIMULATOR_GIVEN = {"compute_s": 0.08, "grad_bytes": 4 * 25.6e6, "alpha": 1e-5, "beta": 1e-10, "bucket_mb": 3.3,
                   "backward_fraction": 0.6, "overlap_cost": 0.25, "batch": 16}
SIMULATOR_STATE = ("import json; print(json.dumps(dict(params=sim.params.value, dtype=sim.grad_dtype.value, "
                   "compute_ms=sim.compute_ms.value, world_lo=sim.world.value[0], world_hi=sim.world.value[1], bucket_mb=sim.bucket_mb.value, "
                   "overlap=sim.overlap.value, backward=sim.backward.value, overlap_cost=sim.overlap_cost.value, "
                   "batch=sim.batch.value, interconnect=sim.interconnect.value)))")


def modelled_summary(state: dict) -> list[str]:
    """What the simulator's summary must say for these control values, from gpucourse.models.costs (the one model):
    the step, its parts and the efficiency at the largest world size chosen."""
    from gpucourse import costs
    from gpucourse.models.units import human_percent, human_seconds
    from gpucourse.viz.widgets import FITTED

    assert state["interconnect"] == FITTED  # the measured α–β below
    n, compute_s = state["world_hi"], state["compute_ms"] / 1e3
    m = costs.ddp_step_time(compute_s, round(state["params"] * state["dtype"]), n, SIMULATOR_GIVEN["alpha"],
                            SIMULATOR_GIVEN["beta"], bucket_bytes=state["bucket_mb"] * 2**20, overlap=state["overlap"],
                            backward_fraction=state["backward"], overlap_cost=state["overlap_cost"])
    return [f"At N = {n}: step {human_seconds(m.step)}", f"compute {human_seconds(compute_s)}",
            f"exposed comm {human_seconds(m.exposed)}", f"overlap cost {human_seconds(m.overlap_penalty)}",
            f"all-reduce {human_seconds(m.comm)} in {m.num_buckets} bucket(s)",
            f"efficiency {human_percent(compute_s / m.step)}", f"{n * state['batch'] / m.step:.3g} samples/s"]


def test_scaling_simulator_follows_its_sliders(lab, browser):
    """Chapter 03's simulator as a learner uses it: it starts at the values it was given (no snapping), and each
    slider moved from the keyboard changes the kernel's value, redraws the plot, and makes the summary say what
    gpucourse.models.costs says for the new values. Nothing in it is cut."""
    cells = [nbformat.v4.new_code_cell(f"from gpucourse.widgets import scaling_simulator\n"
                                       f"sim = scaling_simulator({SIMULATOR_GIVEN!r})\nsim")]
    write_notebook(lab, "simulator.ipynb", cells)
    page = open_notebook(browser, lab, "simulator.ipynb")
    run_all(page)
    wait_all_ran(page, "simulator.ipynb")
    box = drawn_widget(page)
    summary = box.locator(".widget-html-content").last

    assert box.locator("img").count() == 1, "the plot is shown more than once"

    def shown() -> tuple[str, str]:
        return summary.inner_text(), box.locator("img").get_attribute("src")

    def settled(dragged=None) -> tuple[dict, tuple[str, str]]:
        """The kernel's values once the summary on the page is the model's for them (a readiness wait). After a
        drag, also once the kernel holds the value the handle was dropped at (its readout): a drag sends values
        on the way, and the summary matches each of them in turn."""
        for _ in range(120):
            state = json.loads(kernel_eval(page, "simulator.ipynb", SIMULATOR_STATE))
            text = shown()[0]
            dropped = dragged is None or dragged[0].locator(".widget-readout").inner_text() == f"{state[dragged[1]]:.2f}"
            if dropped and all(part in text for part in modelled_summary(state)):
                return state, shown()
            time.sleep(0.5)
        pytest.fail(f"the summary {text!r} never matched the model for {state}: {modelled_summary(state)}")

    state, before = settled()
    # The given values, not snapped to a grid (8.8 ms became 7.94 ms): the browser's log sliders send back
    # 10 ** log10(value), equal to the last few bits of a float.
    numbers = {k: v for k, v in state.items() if k != "interconnect"}
    assert numbers == pytest.approx({"params": 25.6e6, "dtype": 4, "compute_ms": 80.0, "world_lo": 1,
                                     "world_hi": 4096, "bucket_mb": 3.3, "overlap": True, "backward": 0.6,
                                     "overlap_cost": 0.25, "batch": 16}, rel=1e-12), state
    readouts = box.locator(".widget-readout").all_inner_texts()
    assert readouts == ["2.56e+7", "80.0", "1-4096", "3.30", "0.60", "0.25"], readouts
    assert box.locator("input[type=number]").input_value() == "16"
    assert_fits(box)
    save_shot(box, "initial")

    moves = [("parameters", ".noUi-handle", "ArrowLeft", "params"),
             ("compute per step", ".noUi-handle", "ArrowRight", "compute_ms"),
             ("world sizes", ".noUi-handle-upper", "ArrowLeft", "world_hi"),
             ("bucket size", ".noUi-handle", "ArrowRight", "bucket_mb"),
             ("backward fraction", ".noUi-handle", -80, "backward"),  # px: dragged with the mouse
             ("overlap cost", ".noUi-handle", 80, "overlap_cost")]
    for label, handle, key, name in moves:
        slider = box.locator(".widget-hslider", has_text=label)
        assert slider.count() == 1, f"no single slider labelled {label!r}"
        if isinstance(key, str):  # a key pressed on the focused handle
            slider.locator(handle).focus()
            page.keyboard.press(key)
        else:  # the handle dragged `key` pixels sideways
            where = slider.locator(handle).bounding_box()
            x, y = where["x"] + where["width"] / 2, where["y"] + where["height"] / 2
            page.mouse.move(x, y)
            page.mouse.down()
            page.mouse.move(x + key, y, steps=8)
            page.mouse.up()
        # Readiness: the summary, then the plot (drawn after it), replaced.
        for what, changed in [("summary", "([box, old]) => Array.from(box.querySelectorAll('.widget-html-content'))"
                                          ".pop().innerText !== old[0]"),
                              ("plot", "([box, old]) => { const img = box.querySelector('img'); "
                                       "return !!img && img.getAttribute('src') !== old[1]; }")]:
            try:
                page.wait_for_function(changed, arg=[box.element_handle(), list(before)], timeout=60_000)
            except sync_api.TimeoutError:
                save_shot(box, f"stuck-{name}")
                pytest.fail(f"{key} on the {label!r} slider did not change the {what} within 60 s")
        new_state, after = settled(None if isinstance(key, str) else (slider, name))
        assert new_state[name] != state[name], f"{key} on {label!r} did not change {name}: {state[name]}"
        changed = sorted(k for k in state if new_state[k] != state[k])
        assert set(changed) <= {name, "compute_ms"}, (label, changed)  # compute follows the parameter count only
        assert box.locator("img").count() == 1, f"after moving {label!r} the plot is shown more than once"
        assert_fits(box)
        state, before = new_state, after
    save_shot(box, "after-moving-every-slider")


MANY = Path(__file__).resolve().parents[1] / "browser_jobs" / "many.py"
# (name, nproc, args): chapter 03's scaling loop in small, with a chatty run and a failing one among the quiet ones.
MANY_LAUNCHES = [("many-quiet-profiled", 2, ["--profile"]), ("many-talks", 2, ["--say"]),
                 ("many-quiet-one", 1, []), ("many-fails", 2, ["--say", "--fail-rank", "1"]),
                 ("many-quiet-two", 2, [])]
# JS: the text of every live pane on the page, shown or not (textContent: hidden tabs count).
ALL_PANES_TEXT = "() => Array.from(document.querySelectorAll('.widget-output')).map(el => el.textContent)"


def test_many_launches_in_one_cell(lab, browser):
    """A cell that launches run after run (chapter 03's scaling loop). Runs whose ranks printed nothing
    collapse to their one-line status; runs with output keep their panes; the failing run does not stop the loop
    (check=False) and its view opens on the failing rank, whose pane shows the line it printed before its
    traceback (time order, not stderr first); no profiler noise in any pane, nothing cut."""
    script = lab.scripts / MANY.name
    shutil.copy(MANY, script)
    cells = [nbformat.v4.new_code_cell("import gpucourse"),
                nbformat.v4.new_code_cell("launches = [\n" + "".join(f"    {launch!r},\n" for launch in MANY_LAUNCHES)
                                       + f"]\nscript = {str(script)!r}\nresults = []\n"
                                       "for name, nproc, args in launches:  # check=False: a failure stops nothing\n"
                                       "    results.append(gpucourse.launch(script, nproc=nproc, args=args, name=name,\n"
                                       "                                    timeout=120, check=False))")]
    write_notebook(lab, "many.ipynb", cells)
    page = open_notebook(browser, lab, "many.ipynb")
    run_all(page)
    wait_all_ran(page, "many.ipynb")

    # The loop went on past the failure: every launch ran and has its view.
    cell = page.locator(".jp-Cell").nth(1)
    scroll_to(cell)
    statuses = kernel_eval(page, "many.ipynb", "print([r.status for r in results])").strip()
    assert statuses == "['ok', 'ok', 'ok', 'failed', 'ok']", statuses
    views = {name: scroll_to(launch_view(page, f"{name}-")) for name, _, _ in MANY_LAUNCHES}

    for name in ("many-quiet-profiled", "many-quiet-one", "many-quiet-two"):
        view = views[name]
        assert status_line(view).startswith("finished"), status_line(view)
        # Collapsed: the status line alone, no tabs, no pane, no bar (whose count moved into the line).
        assert view.locator(".widget-tab, .widget-output, .widget-hprogress").count() == 0, name
        assert "\n" not in view.inner_text().strip(), view.inner_text()
        assert "3/3 steps" in status_line(view), status_line(view)

    talks = views["many-talks"]
    assert status_line(talks).startswith("finished") and bar_style(talks) == "success"
    assert tab_titles(talks) == ["all ranks", "rank 0", "rank 1"]
    everyone = shown_pane(talks).inner_text()
    assert "[rank 0] rank 0 step 2 sum 5" in everyone and "[rank 1] rank 1 step 2 sum 5" in everyone, everyone

    fails = views["many-fails"]
    assert status_line(fails).startswith("failed") and bar_style(fails) == "danger"
    assert fails.locator(".lm-TabBar-tab.lm-mod-current").inner_text() == "rank 1"
    rank1 = shown_pane(fails).inner_text()  # the tab it opened on
    assert "ValueError: deliberate failure on rank 1" in rank1, rank1
    printed_line, traceback = rank1.find("rank 1 printed this before failing"), rank1.find("Traceback")
    assert 0 <= printed_line < traceback, f"the line rank 1 printed is not before its traceback:\n{rank1}"
    assert 0 <= rank1.find("rank 1 step 2 sum 5") < printed_line, rank1

    # The profiler did print its noise (into the rank logs), and none of it reached a pane, hidden tabs included.
    [profiled] = [d for d in lab.run_dirs() if d.name.startswith("many-quiet-profiled-")]
    logged = "".join(p.read_text(errors="replace") for p in profiled.rglob("rank*.std*"))
    assert "USDT" in logged, "the profiled run printed no Kineto USDT line: this test no longer shows them filtered"
    panes = page.evaluate(ALL_PANES_TEXT)
    assert len(panes) == 3 + 3, panes  # all ranks + one per rank, for the two runs that printed
    assert not [text for text in panes if "USDT" in text], panes
    print(f"profiled run's logs hold {logged.count('USDT')} USDT line(s), the page none")

    for name, view in views.items():
        assert_fits(view)
    save_shot(cell, "cell")
    assert_nothing_running(lab)


def test_printed_words_wrap_whole_and_live_panes_show_their_newest_line(lab, browser):
    """JupyterLab's output style broke printed words anywhere ("MAS|TER_ADDR"); importing gpucourse puts
    word-break back to normal on the page, and it stays when the importing cell runs again. A live pane longer
    than its box shows its newest line, not its first."""
    cells = [nbformat.v4.new_code_cell("import gpucourse"),
             nbformat.v4.new_code_cell("print(' '.join(['MASTER_ADDR'] * 60))"),
             nbformat.v4.new_code_cell("from gpucourse.run import live\nfrom gpucourse.run.tail import Line\n"
                                       "view = live.WidgetView('job', 1)\n"
                                       "view.update([Line(0, 'stdout', f'line {i}') for i in range(100)], [], 'r')\n"
                                       "view._flush('running')")]
    write_notebook(lab, "wrap.ipynb", cells)
    page = open_notebook(browser, lab, "wrap.ipynb")
    run_all(page)
    wait_all_ran(page, "wrap.ipynb")
    printed = page.locator(".jp-Cell").nth(1).locator(".jp-OutputArea-output pre").first
    scroll_to(printed)
    assert "MASTER_ADDR" in printed.inner_text()
    assert printed.evaluate("el => getComputedStyle(el).wordBreak") == "normal"
    page.evaluate(f"path => {{ {PANEL} panel.content.activeCellIndex = 0; "
                  "window.jupyterapp.commands.execute('notebook:run-cell'); }", "wrap.ipynb")
    time.sleep(3)
    assert printed.evaluate("el => getComputedStyle(el).wordBreak") == "normal"  # still, after a re-run
    pane = page.locator(".widget-tab-contents > .widget-output:not(.lm-mod-hidden)").first
    scroll_to(pane)
    # the text's bottom (its newest line) at the pane's bottom edge, its top (the first lines) scrolled off above
    seen = pane.evaluate("""el => { const box = el.getBoundingClientRect();
        const text = el.querySelector('pre').getBoundingClientRect();
        return {last: Math.abs(text.bottom - box.bottom) < 30, first: text.top >= box.top}; }""")
    save_shot(page, "wrap-and-newest-line")
    assert seen == {"first": False, "last": True}, seen
