"""The live views (gpucourse/run/live.py), fed by hand with the batches the launcher's monitor loop would send:
what a learner sees in a pane or a terminal, with no torchrun job behind it."""
from types import SimpleNamespace

import pytest

from gpucourse import live
from gpucourse.run.result import RootCause
from gpucourse.run.tail import Line

# Kineto's lines as a profiled rank writes them (tests/jobs/worker.py --profile, torch 2.13 CPU)
USDT = ["USDT:2026-11-24 21:13:13 4633:4633 SyncActivityProfilerHandler.cpp:52] profiler_start",
        "USDT:2026-11-24 21:13:13 4633:4633 SyncActivityProfilerHandler.cpp:59] profiler_stop"]


def result(ok=True, error=None):
    return SimpleNamespace(ok=ok, status="ok" if ok else "failed", duration=1.0, name="job", world_size=2,
                           manifest={"backend": "gloo"}, error=error, summary=lambda: "job: summary")


@pytest.fixture
def widget_view(monkeypatch):
    pytest.importorskip("ipywidgets")
    monkeypatch.setattr("IPython.display.display", lambda obj: None)
    return live.WidgetView("job", 2)


def pane_texts(view) -> dict:
    """{"all" or rank: the text its pane shows}, one entry per tab."""
    return {key: pane.outputs[0]["text"] if pane.outputs else "" for key, pane in view.panes.items()}


def tab_titles(view) -> list[str]:
    return [view.tabs.get_title(i) for i in range(len(view.tabs.children))]


def test_noise_is_only_kineto_announcing_a_trace():
    assert all(live.NOISE.match(text) for text in USDT)
    for text in ["USDT: the course's own line", "profiler_start", "rank 0 step 3 USDT:] profiler_stop later"]:
        assert not live.NOISE.match(text), text


def test_widget_panes_leave_profiler_noise_out(widget_view):
    widget_view.update([Line(0, "stderr", USDT[0]), Line(0, "stdout", "step 1"), Line(1, "stdout", USDT[1])],
                       [], "running")
    widget_view.finish(result())
    assert pane_texts(widget_view) == {"all": "[rank 0] step 1\n", 0: "step 1\n"}  # rank 1 printed only noise
    assert tab_titles(widget_view) == ["all ranks", "rank 0"]


def test_text_view_leaves_profiler_noise_out(capsys):
    view = live.TextView("job", 2)
    view.update([Line(0, "stderr", USDT[0]), Line(1, "stdout", "step 1"), Line(1, "stderr", USDT[1])], [], "running")
    out, err = capsys.readouterr()
    assert "USDT" not in out + err and "[rank 1] step 1" in out


def test_torch_rank_prefix_becomes_the_views_own(widget_view, capsys):
    lines = [Line(1, "stderr", "[rank1]: Traceback (most recent call last):"),
             Line(1, "stderr", "[rank0]: a message about rank 0, printed by rank 1"),
             Line(1, "stderr", "[rank1] no colon: not torch's prefix")]
    expected = ["[rank 1] Traceback (most recent call last):",  # one kind of prefix in a pane
                "[rank 1] [rank0]: a message about rank 0, printed by rank 1",
                "[rank 1] [rank1] no colon: not torch's prefix"]
    widget_view.update(lines, [], "running")
    widget_view.finish(result())
    panes = pane_texts(widget_view)
    everyone, rank1 = panes["all"], panes[1]
    assert everyone.splitlines() == expected
    assert rank1.splitlines() == [ln.text for ln in lines]  # a rank's own pane shows its lines as written

    live.TextView("job", 2).update(lines, [], "running")
    assert capsys.readouterr().err.splitlines() == expected


def test_a_run_that_printed_nothing_collapses_to_its_status(widget_view):
    widget_view.update([Line(0, "stderr", USDT[0]), Line(None, "stderr", "torchrun chatter")],
                       [{"rank": r, "step": 4, "total": 5} for r in (0, 1)], "running")
    widget_view.finish(result())
    assert widget_view.box.children == (widget_view.status, widget_view.style)
    assert "finished" in widget_view.status.value and "5/5 steps" in widget_view.status.value


def test_a_failed_run_that_printed_nothing_keeps_its_root_cause(widget_view):
    widget_view.finish(result(ok=False, error=RootCause("rank 1 was killed by SIGKILL", rank=1)))
    status, cause, style = widget_view.box.children
    assert status is widget_view.status and "failed" in status.value
    assert "rank 1 was killed by SIGKILL" in cause.value and style is widget_view.style


def test_a_run_that_printed_keeps_its_tabs(widget_view):
    widget_view.update([Line(1, "stderr", "[rank1]: ValueError: boom")], [], "running")
    widget_view.finish(result(ok=False, error=RootCause("rank 1 failed", rank=1)))
    status, cause, tabs, style = widget_view.box.children  # no total reported: no bar
    assert "rank 1 failed" in cause.value and tab_titles(widget_view)[tabs.selected_index] == "rank 1"


def test_tabs_appear_for_the_ranks_that_print_in_rank_order(monkeypatch):
    pytest.importorskip("ipywidgets")
    monkeypatch.setattr("IPython.display.display", lambda obj: None)
    view = live.WidgetView("job", 4)
    assert tab_titles(view) == ["all ranks"]
    view.update([Line(3, "stdout", "three")], [], "running")
    view.update([Line(1, "stdout", "one")], [], "running")
    assert tab_titles(view) == ["all ranks", "rank 1", "rank 3"]
    view.finish(result())
    assert pane_texts(view) == {"all": "[rank 3] three\n[rank 1] one\n", 3: "three\n", 1: "one\n"}


def test_the_bar_shows_a_count_or_is_not_shown(widget_view):
    widget_view.update([Line(0, "stdout", "hello")], [{"rank": r, "step": 2} for r in (0, 1)], "running")
    widget_view._flush("running")
    assert widget_view.bar_row.layout.display == "none" and "3 steps done" in widget_view.status.value
    widget_view.update([], [{"rank": r, "step": 3, "total": 8} for r in (0, 1)], "running")
    widget_view._flush("running")
    assert widget_view.bar_row.layout.display is None and widget_view.bar_label.value == "4/8 steps"
    assert (widget_view.bar.value, widget_view.bar.max) == (4, 8)
    widget_view.finish(result())
    assert widget_view.bar_row in widget_view.box.children and "steps" not in widget_view.status.value


def test_panes_keep_the_newest_line_in_view(widget_view):
    """A pane longer than its box opened at its first lines, the newest below the fold. Laid out as a
    reversed column, a scrolling box starts at (and stays anchored to) its bottom."""
    for pane in widget_view.panes.values():
        assert (pane.layout.display, pane.layout.flex_flow, pane.layout.overflow) == ("flex", "column-reverse", "auto")


def test_panes_wrap_between_words(widget_view):
    """JupyterLab's `.jp-OutputArea-output pre {word-break: break-all}` cuts words; the view's own rule,
    on its own class and one step more specific, puts word-break back to normal (tests/integration/test_browser.py
    checks the style the browser computes)."""
    assert live.WidgetView.CSS_CLASS in widget_view.box._dom_classes
    assert widget_view.style in widget_view.box.children and widget_view.style.layout.display == "none"
    css = live.WidgetView.CSS
    assert widget_view.style.value == f"<style>{css}</style>"
    assert css.startswith(f"div.{live.WidgetView.CSS_CLASS} pre ") and "word-break: normal" in css


def test_a_rank_s_printed_lines_come_before_the_traceback_it_died_with(tmp_path):
    """Both streams written before one poll (a rank prints, then dies): stdout is read first."""
    from gpucourse.run.contract import attempt_dir, logs_dir
    from gpucourse.run.tail import RunTailer

    folder = attempt_dir(logs_dir(tmp_path), 0)
    folder.mkdir(parents=True)
    for rank in (1, 0):
        (folder / f"rank{rank}.stderr").write_text(f"Traceback of rank {rank}\n")
        (folder / f"rank{rank}.stdout").write_text(f"step 3 of rank {rank}\n")
    lines, _ = RunTailer(tmp_path).poll()
    assert [(ln.rank, ln.text) for ln in lines] == [(0, "step 3 of rank 0"), (0, "Traceback of rank 0"),
                                                   (1, "step 3 of rank 1"), (1, "Traceback of rank 1")]


def test_a_status_line_says_state_time_steps_and_the_last_line():
    slot = SimpleNamespace(value="")
    view = live.StatusLine(slot, "job: 2 rank(s)", 2)
    assert "starting" in slot.value
    view.update([Line(0, "stdout", "loading"), Line(1, "stdout", "step 3 loss 0.5"), Line(1, "stderr", USDT[0])],
                [{"rank": r, "step": 3, "total": 10} for r in (0, 1)], "running")
    assert "running" in slot.value and "4/10 steps" in slot.value and "[rank 1] step 3 loss 0.5" in slot.value
    view.finish(result(ok=False, error=RootCause("rank 1 was killed by SIGKILL", rank=1)))
    assert "failed" in slot.value and "rank 1 was killed by SIGKILL" in slot.value and "4/10 steps" in slot.value


def test_a_kernel_gets_the_output_style_once_and_a_rank_never(monkeypatch):
    """Printed words cut anywhere by JupyterLab's `word-break: break-all`. In a kernel, the first import
    of gpucourse displays the JavaScript that puts a whole-word rule into the page's head (once per kernel);
    outside a kernel nothing is displayed (tests/test_browser.py checks the style the browser computes)."""
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append((obj, raw)))
    monkeypatch.setattr(live, "_styled", False)
    monkeypatch.setattr(live, "in_notebook", lambda: False)
    assert live.style_notebook_outputs() is False and shown == []
    monkeypatch.setattr(live, "in_notebook", lambda: True)
    assert live.style_notebook_outputs() is True and live.style_notebook_outputs() is False
    assert shown == [({"application/javascript": live.OUTPUT_STYLE_JS}, True)]
    assert "word-break: normal" in live.OUTPUT_CSS and live.OUTPUT_CSS in live.OUTPUT_STYLE_JS
    assert ".jp-OutputArea-output pre" in live.OUTPUT_CSS and "document.head.appendChild" in live.OUTPUT_STYLE_JS


def test_the_status_says_what_a_job_does_before_its_first_step(widget_view):
    """A launch that prints nothing for its first tens of seconds showed an empty pane and a clock. The
    status line says what it waits for (the ranks' "setup" records, then the first step), and the tabs come with
    the first printed line."""
    widget_view._flush("running")
    assert "starting 2 rank(s)" in widget_view.status.value and widget_view.tabs.layout.display == "none"
    widget_view.update([], [{"rank": 1, "event": "setup"}], "running")
    widget_view._flush("running")
    assert "1 of 2 rank(s) set up" in widget_view.status.value
    widget_view.update([], [{"rank": 0, "event": "setup"}], "running")
    widget_view._flush("running")
    assert "2 rank(s) set up, first step running" in widget_view.status.value
    widget_view.update([Line(0, "stdout", "hello")], [{"rank": r, "step": 0, "total": 4} for r in (0, 1)], "running")
    widget_view._flush("running")
    assert "set up" not in widget_view.status.value and widget_view.tabs.layout.display is None
    line = live.StatusLine(SimpleNamespace(value=""), "job", 2)
    line.update([], [{"rank": 0, "event": "setup"}], "running")
    assert "1 of 2 rank(s) set up" in line.slot.value
