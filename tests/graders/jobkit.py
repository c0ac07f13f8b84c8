"""What every grading job shares (imported by the exNN_job.py scripts, which run inside each rank).

A submission must never be able to take the grading run down with it: its output is capped, each case
runs under a watchdog that logs why and ends the rank when the case runs too long, and its exceptions
are reported in one line pointing at the submission's own code. Nor should it be able to change the verdict
by rebinding names: the job's records go through a writer made before the submission is imported
(`record_writer`), what it communicates is recorded by comm_recorder, and the classes it must not use are
replaced by refusals that are checked to bind (`ban`).

A job's main: runtime.setup(), `log = record_writer()`, its Guard (on comm_recorder.install()), log the plan,
`import_or_exit` (the "import" record, or the module), `run_cases` (one record per case, then "done").
"""
import contextlib
import gc
import importlib
import importlib.util
import io
import json
import os
import re
import sys
import threading
import time
import traceback
import types
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpucourse import runtime
from gpucourse.contract import metrics_file

OUTPUT_BUDGET = 10_000  # characters of the submission's own output kept per rank
RECHECKS, RECHECK_S = 5, 0.02  # an allocation must stay alive this long (0.1 s) to count as kept
GLOO_WHERE = re.compile(r"\[[^\]]*third_party/gloo[^\]]*\] ")  # gloo's source path in its error messages


def load_submission(path: str, name: str):
    """Import the learner's file as a module (any path: exercises/, solutions/, a submission folder)."""
    spec = importlib.util.spec_from_file_location(f"submission_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_writer():
    """log(**record): one JSON line in this rank's metrics file, exactly as runtime.log writes it.

    Made after runtime.setup() and before the submission is imported, from a file descriptor of its own and
    functions captured now: a submission that replaces gpucourse.runtime.log, runtime._write_record, json.dumps
    or os.write at import changes nothing the grader writes. Keep it in a local variable (no module attribute).
    """
    ctx = runtime.context()
    path = metrics_file(ctx.run_dir, ctx.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    write, dumps, now, rank, lock, tensor = os.write, json.dumps, time.time, ctx.rank, threading.Lock(), torch.Tensor

    def plain(value):  # as runtime.log: a tensor becomes a number or a list
        if isinstance(value, tensor):
            return value.item() if value.numel() == 1 else value.tolist()
        return value

    def log(**record) -> None:
        line = dumps({"rank": rank, "time": now(), **{k: plain(v) for k, v in record.items()}}) + "\n"
        data = line.encode()
        with lock:  # the watchdog's thread writes too; O_APPEND keeps whole lines beside runtime's own
            while data:
                data = data[write(fd, data):]

    return log


class BanError(RuntimeError):
    """A ban that cannot bind: the job stops at start-up rather than forbid nothing."""


def ban_targets(targets: dict) -> list[tuple]:
    """[(module, name, why)] for each "module.path:Name" of `targets` ({where: why}), or BanError: every target must
    exist in this torch, or the ban would forbid nothing (a torch upgrade that moves a class) without a word."""
    bound = []
    for where, why in targets.items():
        module_name, _, name = where.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise BanError(f"the grader's ban of {where} cannot bind: {err} (torch {torch.__version__}); "
                           f"update the grader's ban list") from None
        if not hasattr(module, name):
            raise BanError(f"the grader's ban of {where} cannot bind: {module_name} has no {name} in torch "
                           f"{torch.__version__}; update the grader's ban list")
        bound.append((module, name, why))
    return bound


def ban(targets: dict, used: list) -> None:
    """Replace each "module.path:Name" of `targets` ({where: why}) with a class that refuses to run: calling or
    instantiating it appends Name to `used` and raises RuntimeError(why). A class, so that a submission that
    subclasses it still imports (and is refused when it runs). Checked first (ban_targets): a target that
    does not exist stops the job at start-up, before the submission is loaded.
    """
    for module, name, why in ban_targets(targets):
        setattr(module, name, _refusal(name, why, used))


def _refusal(name: str, why: str, used: list) -> type:
    class Refused:
        def __new__(cls, *args, **kwargs):
            used.append(name)
            raise RuntimeError(f"{name} is not allowed here: {why}")

    Refused.__name__ = Refused.__qualname__ = name
    return Refused


def import_or_exit(path: str, name: str, wanted, watching, watchdog: "Watchdog", limit: float, log, *,
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
            log(case="import", group="import", error=one_line(err, os.path.abspath(path)), **fields())
            runtime.teardown()
            sys.exit(1)
    return module


def run_cases(cases, args: tuple, watchdog: "Watchdog", limit: float, submission: str, log, *, fields=dict,
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
            log(case=case, group=group, **{**fields(), **record})
            if between is not None:
                between()
    log(case="done")


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


class Guard:
    """Runs the submission while `watching()`: what it prints is capped, and what it communicates is recorded by
    `self.comm` (comm_recorder's, installed before the submission is imported). A job's guard reads its events;
    `reset()` forgets the job's own notes at the start of a new watch (the recorder starts afresh by itself)."""

    def __init__(self, comm):
        self.comm = comm
        self.output = CappedOutput()
        # The grader's own collectives (references, barriers), taken now, before the submission could rebind
        # dist's: they run outside watching(), so comm's wrappers pass them through unrecorded.
        self.dist = types.SimpleNamespace(all_reduce=dist.all_reduce, barrier=dist.barrier, broadcast=dist.broadcast)

    def reset(self) -> None:
        """Forget what the last watch noted, at the start of a new one (nothing to forget here)."""

    @contextlib.contextmanager
    def watching(self):
        """Run the submission: record what it communicates (after reset()), cap what it prints."""
        self.reset()
        with self.comm.recording(), self.output.capturing():
            yield self


class Watchdog:
    """Ends the rank, after logging why, when the current case runs past its limit."""

    def __init__(self, reason: str, log):
        self.reason = reason  # what usually causes it, in this exercise's terms
        self.log = log  # record_writer's
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
                self.log(case=self.case, group=self.group, timed_out=True,
                            error=f"did not finish within {self.limit:g} s: {self.reason}")
                sys.__stdout__.flush()
                os._exit(3)


class Allocations(TorchDispatchMode):
    """Weak references to every tensor of at least min_numel elements that an op creates while active.

    What a submission keeps is then what is still alive afterwards, however it keeps it (saved for backward,
    stashed on ctx or on a module, a received buffer held on to): graders of memory rules ask `alive_bytes`."""

    def __init__(self, min_numel: int = 1):
        super().__init__()
        self.min_numel, self.refs = min_numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel:
                self.refs.append(weakref.ref(t))
        return out

    def alive_bytes(self, exclude=(), within: int = 0) -> int:
        """Bytes of the storages still alive among those tensors (each storage once), except `exclude`'s.

        A collective's buffer stays referenced by gloo's worker thread until that thread has finished with the
        work, which can be after wait() returned: wait for gloo's workers to go idle first; what is alive is
        then asked again, a few times, before it counts (the smallest of the answers). An answer of at most
        `within` bytes (what the grader allows) is final at once."""
        runtime.wait_for_gloo_workers()
        alive = None
        for _ in range(RECHECKS):
            now = self._alive_bytes(exclude)
            alive = now if alive is None else min(alive, now)
            if alive <= within:
                return alive
            time.sleep(RECHECK_S)
        return alive

    def _alive_bytes(self, exclude=()) -> int:
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
        seen = {}
        for ref in self.refs:
            t = ref()
            if t is not None:
                storage = t.untyped_storage()
                if storage.data_ptr() not in skip and storage.nbytes() > 0:
                    seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


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
