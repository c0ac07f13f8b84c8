"""What every grading job shares (imported by the exNN_job.py scripts, which run inside each rank).

A submission must never be able to take the grading run down with it: its output is capped, each case
runs under a watchdog that logs why and ends the rank when the case runs too long, and its exceptions
are reported in one line pointing at the submission's own code.

A job's main: log the plan, `import_or_exit` (the "import" record, or the module), `run_cases` (one record
per case, then "done"). A job's Guard subclasses `Guard`: which torch.distributed calls it notes.
"""
import contextlib
import functools
import importlib.util
import io
import os
import re
import sys
import threading
import time
import traceback

import torch

from gpucourse import runtime

OUTPUT_BUDGET = 10_000  # characters of the submission's own output kept per rank
GLOO_WHERE = re.compile(r"\[[^\]]*third_party/gloo[^\]]*\] ")  # gloo's source path in its error messages


def load_submission(path: str, name: str):
    """Import the learner's file as a module (any path: exercises/, solutions/, a submission folder)."""
    spec = importlib.util.spec_from_file_location(f"submission_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_or_exit(path: str, name: str, wanted, watching, watchdog: "Watchdog", limit: float, *,
                   fields=dict):
    """The submission as a module, loaded under the watchdog's "import" case with `watching()` on (the guard:
    what it does at import is recorded and what it prints capped). It must define the `wanted` callables.

    Anything else (a crash, a missing name) is logged as the "import" record, with fields(), and ends the rank:
    the grader then reports that the submission could not be loaded, and why.
    """
    with watchdog.case_limit("import", "import", limit):
        try:
            with watching():
                module = load_submission(path, name)
            missing = [n for n in wanted if not callable(getattr(module, n, None))]
            if missing:
                raise AttributeError(f"{os.path.basename(path)} defines no {' or '.join(missing)}")
        except BaseException as err:  # noqa: BLE001 - a broken submission is graded, not a grader crash
            runtime.log(case="import", group="import", error=one_line(err, os.path.abspath(path)), **fields())
            runtime.teardown()
            sys.exit(1)
    return module


def run_cases(cases, args: tuple, watchdog: "Watchdog", limit: float, submission: str, *, fields=dict,
              between=None) -> None:
    """Run each (case, group, run) as run(*args) under the watchdog's limit; log one record per case, then "done".

    A case's record is what run returned, with "error": None, or {"error": one line} for an exception of any
    kind (SystemExit and friends are the submission's bugs too). fields() adds the job's own fields, read
    after the case (e.g. whether a forbidden class was used); the case's own fields win. between(), if given,
    runs after each record, still under the case's limit (e.g. a barrier that lines the ranks up again).
    """
    for case, group, run in cases:
        with watchdog.case_limit(case, group, limit):
            try:
                record = {"error": None, **run(*args)}
            except BaseException as err:  # noqa: BLE001
                record = {"error": one_line(err, os.path.abspath(submission))}
            runtime.log(case=case, group=group, **{**fields(), **record})
            if between is not None:
                between()
    runtime.log(case="done")


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


def nbytes(obj) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    return 0


class Guard:
    """Runs the submission while `watching()`: what it prints is capped, and the calls it makes to the functions
    wrapped with `wrap` are noted. Only its own, outermost calls: dist.all_reduce, not also the process group
    call inside it. A job's guard says what to note (the `note` it wraps with) and what a new watch forgets."""

    def __init__(self):
        self.active, self.depth = False, 0
        self.output = CappedOutput()

    def wrap(self, fn, note):
        """fn, calling note(*args, **kwargs) first when the watched submission calls it (the outermost call)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.active and self.depth == 0:
                note(*args, **kwargs)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapper

    def reset(self) -> None:
        """Forget what the last watch noted, at the start of a new one (nothing to forget here)."""

    @contextlib.contextmanager
    def watching(self):
        """Run the submission: note its calls (after reset()), cap what it prints."""
        self.reset()
        self.active = True
        try:
            with self.output.capturing():
                yield self
        finally:
            self.active = False


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


class TiedLM(torch.nn.Module):
    """An embedding whose weight is also the output layer's: one parameter used twice (graders' tied case)."""

    def __init__(self, vocab: int = 32, dim: int = 16, seed: int | None = None):
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.hidden(self.emb(ids))))
