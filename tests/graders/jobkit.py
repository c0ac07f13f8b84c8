"""What every grading job shares (imported by the exNN_job.py scripts, which run inside each rank).

A submission must never be able to take the grading run down with it: its output is capped, each case
runs under a watchdog that logs why and ends the rank when the case runs too long, and its exceptions
are reported in one line pointing at the submission's own code.
"""
import contextlib
import importlib.util
import io
import os
import re
import sys
import threading
import time
import traceback

from gpucourse import runtime

OUTPUT_BUDGET = 10_000  # characters of the submission's own output kept per rank
GLOO_WHERE = re.compile(r"\[[^\]]*third_party/gloo[^\]]*\] ")  # gloo's source path in its error messages


def load_submission(path: str, name: str):
    """Import the learner's file as a module (any path: exercises/, solutions/, a submission folder)."""
    spec = importlib.util.spec_from_file_location(f"submission_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line(err: BaseException, submission: str) -> str:
    """`Type: message (at file:line)`, the line being the submission's last frame; gloo's source path dropped."""
    text = f"{type(err).__name__}: {GLOO_WHERE.sub('', str(err))}".strip().splitlines()
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == submission]
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return (text[0] if text else type(err).__name__)[:300] + where


class CappedOutput(io.TextIOBase):
    """Keeps the first OUTPUT_BUDGET characters the submission prints: a print loop cannot flood the logs."""

    def __init__(self, budget: int = OUTPUT_BUDGET):
        self.budget = self.left = budget

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.left > 0:
            sys.__stdout__.write(text[:self.left])
            if len(text) >= self.left:
                sys.__stdout__.write(f"\n[grader: output cut after {self.budget} characters]\n")
        self.left -= len(text)
        return len(text)

    @contextlib.contextmanager
    def capturing(self):
        with contextlib.redirect_stdout(self), contextlib.redirect_stderr(self):
            yield


class Watchdog:
    """Ends the rank, after logging why, when the current case runs past its limit."""

    def __init__(self, reason: str):
        self.reason = reason  # what usually causes it, in this exercise's terms
        self.case, self.group, self.deadline, self.limit = None, None, None, None
        threading.Thread(target=self._watch, name="grader-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def case_limit(self, case: str, group: str, limit: float):
        self.case, self.group, self.limit, self.deadline = case, group, limit, time.monotonic() + limit
        try:
            yield
        finally:
            self.deadline = None

    def _watch(self):
        while True:
            time.sleep(0.2)
            if self.deadline is not None and time.monotonic() > self.deadline:
                runtime.log(case=self.case, group=self.group, timed_out=True,
                            error=f"did not finish within {self.limit:g} s: {self.reason}")
                sys.__stdout__.flush()
                os._exit(3)
