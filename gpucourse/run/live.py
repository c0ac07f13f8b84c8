"""In the launcher's process: live views of a running job, plain text (terminal, papermill, CI) or an ipywidgets panel
(JupyterLab).

Both are fed by the launcher's monitor loop with batches of whole lines and metric records, so the
widget sends one bounded update per pane per batch (never `with out:` from a thread, never an
ever-growing output list that a chatty rank could turn into a frozen browser tab).
"""
from __future__ import annotations

import collections
import html
import os
import re
import sys
import time

from .contract import EVENT_SETUP
from .tail import Line

LIVE_ENV = "GPUCOURSE_LIVE"  # "widget", "text" or "off": overrides the automatic choice

# Lines the live views leave out; the rank's log file on disk keeps them. Kineto (torch.profiler's
# backend) announces every trace it starts and stops, e.g.
#   USDT:2026-11-24 21:13:13 4633:4633 SyncActivityProfilerHandler.cpp:52] profiler_start
# In a profiling chapter that bookkeeping is all some panes would hold, and it says nothing to a learner.
NOISE = re.compile(r"^USDT:.*\] profiler_(?:start|stop)\s*$")


def shown(lines: list[Line]) -> list[Line]:
    """The lines a live view shows: the ranks' own (torchrun's chatter goes to the run directory), no noise."""
    return [ln for ln in lines if ln.rank is not None and not NOISE.match(ln.text)]


def with_rank(ln: Line) -> str:
    """A line as the all-ranks view shows it, prefixed by its rank as `[rank 1] `. torch prefixes its own messages
    (an uncaught exception's traceback, c10d warnings) with `[rank1]: `: that prefix is replaced by the view's, so
    that one pane reads with one kind of prefix (a rank's own pane and its log file keep the line as written)."""
    torch_prefix = f"[rank{ln.rank}]:"
    text = ln.text[len(torch_prefix):].removeprefix(" ") if ln.text.startswith(torch_prefix) else ln.text
    return f"[rank {ln.rank}] {text}"


class Progress:
    """Steps reported by the ranks; the bar follows the slowest rank, which is what the job waits for."""

    def __init__(self, world_size: int):
        self.step: dict[int, int] = {}
        self.total: int | None = None
        self.world_size = world_size
        self.ready: set[int] = set()  # ranks whose runtime.setup() has returned (its "setup" record)

    def update(self, records: list[dict]) -> None:
        for rec in records:
            if rec.get("event") == EVENT_SETUP:
                self.ready.add(rec["rank"])
            if "total" in rec:
                self.total = int(rec["total"])
            if "step" in rec:
                self.step[rec["rank"]] = int(rec["step"])

    @property
    def done(self) -> int | None:
        """Steps completed by every rank (a rank that has reported nothing has completed none)."""
        if not self.step:
            return None
        if len(self.step) < self.world_size:
            return 0
        return min(self.step.values()) + 1

    def phase(self) -> str:
        """What the job is doing before its first step is reported: a launch spends its first seconds (tens, on a
        loaded laptop) starting Python, importing torch and joining the process group, with nothing to print."""
        if self.step:
            return ""
        n, ready = self.world_size, len(self.ready)
        if not ready:
            return f"starting {n} rank(s): Python, torch, the process group"
        return f"{ready} of {n} rank(s) set up" if ready < n else f"{n} rank(s) set up, first step running"

    def text(self) -> str:
        if self.done is None:
            return ""
        return f"{self.done}/{self.total} steps" if self.total else f"{self.done} steps done"


class TextView:
    """Whole lines, prefixed by rank, printed from the caller's thread (so they land in the right cell)."""

    def __init__(self, header: str, world_size: int):
        self.progress = Progress(world_size)
        self._shown_decile = -1
        print(header, flush=True)

    def update(self, lines: list[Line], records: list[dict], status: str) -> None:
        for ln in shown(lines):
            print(with_rank(ln), file=sys.stderr if ln.stream == "stderr" else sys.stdout)
        self.progress.update(records)
        total, done = self.progress.total, self.progress.done
        if total and done is not None:
            decile = min(10, 10 * done // total)
            if decile != self._shown_decile and decile in (0, 5, 10):
                self._shown_decile = decile
                print(f"[progress] {self.progress.text()}")
        sys.stdout.flush()
        sys.stderr.flush()

    def finish(self, result, interrupted: bool = False) -> None:
        print(result.summary(), flush=True)


class WidgetView:
    """A status line (state, elapsed time, what the ranks do before their first step, then steps done), a progress
    bar while the ranks report a total, and tabs once a rank prints: all ranks together, then one pane per rank that
    has printed (a rank that never prints gets no empty tab)."""

    MAX_LINES = 200
    FLUSH_EVERY_S = 0.15
    # JupyterLab breaks output text at any character (`.jp-OutputArea-output pre {word-break: break-all}`),
    # which cuts words in two: "GROUP_RA|NK", "1.00 M|iB". In this view lines wrap between words, and only
    # a token longer than the pane is still cut. `div.` makes the rule win over JupyterLab's.
    CSS_CLASS = "gpucourse-live"
    CSS = f"div.{CSS_CLASS} pre {{word-break: normal; overflow-wrap: anywhere}}"

    def __init__(self, header: str, world_size: int):
        import ipywidgets as w
        from IPython.display import display

        self.w, self.world_size = w, world_size
        self.progress = Progress(world_size)
        self.status = w.HTML(self._status_html(header, "running"))
        self.bar = w.IntProgress(value=0, min=0, max=1, description="steps", bar_style="info",
                                 layout=w.Layout(width="60%"))
        self.bar_label = w.Label("")
        self.bar_row = w.HBox([self.bar, self.bar_label], layout=w.Layout(display="none"))  # shown with a total
        # column-reverse: a pane that scrolls starts at its bottom, and stays there as lines come (unless the
        # learner scrolls up to read): the newest line is the one in view, not the first.
        self.pane_layout = w.Layout(max_height="260px", overflow="auto", border="1px solid #ddd", display="flex",
                                    flex_flow="column-reverse")
        self.panes = {"all": self._pane()}  # "all", then each rank that printed, by rank
        self.buffers = {"all": collections.deque(maxlen=self.MAX_LINES * 2)}
        self.dirty: set = set()
        self.tabs = w.Tab(children=[self.panes["all"]], layout=w.Layout(display="none"))  # shown at the first line
        self.tabs.set_title(0, "all ranks")
        self.header = header
        self.started = time.monotonic()
        self._last_flush = 0.0
        # A <style> travels with the view (no notebook-wide setup); hidden, it takes no room.
        self.style = w.HTML(f"<style>{self.CSS}</style>", layout=w.Layout(display="none"))
        self.box = w.VBox([self.status, self.bar_row, self.tabs, self.style])
        self.box.add_class(self.CSS_CLASS)
        display(self.box)

    @staticmethod
    def _status_html(header: str, state: str, colour: str = "#1565c0") -> str:
        return f"<b style='color:{colour}'>{html.escape(state)}</b> — {html.escape(header)}"

    def _pane(self):
        pane = self.w.Output(layout=self.pane_layout)
        pane.add_class(PANE_CLASS)  # OUTPUT_CSS: its output area keeps its height, so the pane scrolls, not it
        return pane

    def _tab_of(self, rank: int) -> None:
        """Add rank's pane, in rank order among the tabs, the first time it prints."""
        if rank in self.panes:
            return
        self.panes[rank] = self._pane()
        self.buffers[rank] = collections.deque(maxlen=self.MAX_LINES)
        ranks = sorted(r for r in self.panes if r != "all")
        self.tabs.children = [self.panes["all"], *(self.panes[r] for r in ranks)]
        for i, r in enumerate(ranks, start=1):
            self.tabs.set_title(i, f"rank {r}")

    def tab_index(self, rank: int) -> int | None:
        ranks = sorted(r for r in self.panes if r != "all")
        return ranks.index(rank) + 1 if rank in ranks else None

    def update(self, lines: list[Line], records: list[dict], status: str) -> None:
        for ln in shown(lines):
            if ln.rank >= self.world_size:
                continue
            self._tab_of(ln.rank)
            self.tabs.layout.display = None
            self.buffers["all"].append(with_rank(ln))
            self.buffers[ln.rank].append(ln.text)
            self.dirty.update(("all", ln.rank))
        self.progress.update(records)
        if time.monotonic() - self._last_flush >= self.FLUSH_EVERY_S:
            self._flush(status)

    def _flush(self, status: str) -> None:
        for key in sorted(self.dirty, key=str):
            text = "\n".join(self.buffers[key]) + "\n"
            # Replace the whole (bounded) output in one message instead of appending forever.
            self.panes[key].outputs = ({"output_type": "stream", "name": "stdout", "text": text},)
        self.dirty.clear()
        if self.progress.total:  # a bar only where there is a total to fill it towards
            self.bar.max = self.progress.total
            self.bar.value = min(self.progress.done or 0, self.progress.total)
            self.bar_label.value = self.progress.text()
            self.bar_row.layout.display = None
        elapsed = time.monotonic() - self.started
        doing = self.progress.phase() or ("" if self.progress.total else self.progress.text())  # a bar says the rest
        steps = f", {doing}" if doing else ""
        self.status.value = self._status_html(f"{self.header} — {elapsed:.1f} s{steps}", status)
        self._last_flush = time.monotonic()

    def finish(self, result, interrupted: bool = False) -> None:
        self._flush("interrupted" if interrupted else result.status)
        self.bar.bar_style = "success" if result.ok else "danger"
        colour = "#2e7d32" if result.ok else "#c62828"
        state = "interrupted" if interrupted else {"ok": "finished"}.get(result.status, result.status)
        dur = f"{result.duration:.1f} s" if result.duration is not None else "?"
        text = f"{result.name} — {dur}, {result.world_size} rank(s), backend {result.manifest.get('backend', '?')}"
        printed = bool(self.buffers["all"])
        if self.progress.text() and not (printed and self.progress.total):
            text += f", {self.progress.text()}"  # no bar below to say it
        self.status.value = self._status_html(text, state, colour)
        error = []
        if result.error:  # the root cause first, where the eye goes: the failing rank's traceback
            error = [self.w.HTML(f"<pre style='color:{colour};white-space:pre-wrap'>"
                                 f"{html.escape(str(result.error))}</pre>")]
        # Ranks that printed nothing leave only their status line: a chapter that launches many quiet runs
        # (03 makes eight) would otherwise fill the page with empty tabs.
        body = ([self.bar_row] if self.progress.total else []) + [self.tabs] if printed else []
        self.box.children = (self.status, *error, *body, self.style)
        if result.error and result.error.rank is not None and self.tab_index(result.error.rank) is not None:
            self.tabs.selected_index = self.tab_index(result.error.rank)


class StatusLine:
    """One line for a job run beside others (launch_all): state, elapsed time, steps done and the last line a rank
    printed, in an HTML widget made by the caller in its own cell (a thread's display() would land elsewhere)."""

    def __init__(self, slot, header: str, world_size: int):
        self.slot, self.header = slot, header
        self.progress = Progress(world_size)
        self.last, self.started, self._last_flush = "", time.monotonic(), 0.0
        self.slot.value = WidgetView._status_html(header, "starting")

    def update(self, lines: list[Line], records: list[dict], status: str) -> None:
        mine = shown(lines)
        if mine:
            self.last = with_rank(mine[-1])
        self.progress.update(records)
        if time.monotonic() - self._last_flush >= WidgetView.FLUSH_EVERY_S:
            doing = self.progress.text() or ("" if self.last else self.progress.phase())  # a printed line says more
            steps = f", {doing}" if doing else ""
            last = f" — {self.last[:100]}" if self.last else ""
            self.slot.value = WidgetView._status_html(
                f"{self.header} — {time.monotonic() - self.started:.0f} s{steps}{last}", status)
            self._last_flush = time.monotonic()

    def finish(self, result, interrupted: bool = False) -> None:
        colour = "#2e7d32" if result.ok else "#c62828"
        state = "interrupted" if interrupted else {"ok": "finished"}.get(result.status, result.status)
        text = f"{result.name} — {result.duration or 0:.1f} s, {result.world_size} rank(s)"
        text += f", {self.progress.text()}" if self.progress.text() else ""
        text += f": {result.error.summary}" if result.error else ""
        self.slot.value = WidgetView._status_html(text, state, colour)


class SilentView:
    def __init__(self, header: str, world_size: int):
        pass

    def update(self, lines, records, status):
        pass

    def finish(self, result, interrupted: bool = False):
        pass


# JupyterLab breaks every output's text at any character (`.jp-OutputArea-output pre {word-break: break-all}`), which
# cuts printed words in two: "MAS|TER_ADDR", "doe|sn't". The course puts word-break back to normal on the page, once
# per kernel (the first `import gpucourse`): lines then wrap between words, and only a token longer than the
# output area is still cut. The rule goes into the page's <head> by a line of JavaScript, so it stays when the
# cell that imported gpucourse is run again or cleared; where JavaScript outputs do not run, nothing changes.
OUTPUT_STYLE_ID = "gpucourse-output-style"
PANE_CLASS = "gpucourse-pane"
OUTPUT_CSS = (".jp-OutputArea-output pre, .jp-OutputArea-output.jp-RenderedText "
              "{word-break: normal; overflow-wrap: anywhere} "
              f".{PANE_CLASS} > .jp-OutputArea {{flex-shrink: 0; overflow: visible}}")
OUTPUT_STYLE_JS = (f"if (!document.getElementById('{OUTPUT_STYLE_ID}')) {{ const s = document.createElement('style'); "
                   f"s.id = '{OUTPUT_STYLE_ID}'; s.textContent = '{OUTPUT_CSS}'; document.head.appendChild(s); }}")


def style_notebook_outputs() -> bool:
    """In a Jupyter kernel, display (once per kernel) the JavaScript that sets OUTPUT_CSS on the page; True when it
    was displayed now. Does nothing outside a kernel: a rank, a script, pytest (IPython is not even imported)."""
    global _styled
    if _styled or "IPython" not in sys.modules or not in_notebook():
        return False
    from IPython.display import display

    display({"application/javascript": OUTPUT_STYLE_JS}, raw=True)
    _styled = True
    return True


_styled = False


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def make_view(live, header: str, world_size: int):
    """live: True/None (auto), False, 'widget' / 'text' / 'off', or a view factory f(header, world_size)."""
    if callable(live):
        return live(header, world_size)
    mode = live if isinstance(live, str) else ("off" if live is False else os.environ.get(LIVE_ENV, "auto"))
    if mode == "auto":
        mode = "widget" if in_notebook() else "text"
    if mode == "widget":
        try:
            return WidgetView(header, world_size)
        except ImportError:
            mode = "text"
    if mode == "text":
        return TextView(header, world_size)
    if mode == "off":
        return SilentView(header, world_size)
    raise ValueError(f"live must be 'widget', 'text', 'off', True or False, not {live!r}")
