"""What every grading job shares (each grader, graders/exNN_<name>.py, runs as a job inside each rank).

A submission must never be able to take the grading run down with it: its output is capped, each case
runs under a watchdog that logs why and ends the rank when the case runs too long, and its exceptions
are reported in one line pointing at the submission's own code. Nor should it be able to change the verdict:
a rank computes none. It saves what the submission produced, raw (tensors through `record_writer`'s `raw=`,
counts from comm_recorder), and the grader process recomputes the expected values from the case's inputs and
compares (job_records). The records go through a writer made before the submission is imported, and the
classes it must not use are replaced by refusals that are checked to bind (`ban`).

A job is a `GradingJob` subclass and its script ends with `jobkit.main(ThatJob)`: setup, the record writer, the
guard and watchdog, the plan, the import and the cases run in that order for every exercise (`GradingJob.run`).

One launch grades one submission or several (the test suite grades all mutants of an exercise at once): each rank
forks a process per submission, one after the other, and that process grades it with a process group of its own
(contract.STORE_PREFIX_ENV), so what one submission does to its process (a rebound function, a hang, a crash)
never reaches the next. Every record carries the submission's number, "sub".
"""
import argparse
import contextlib
import gc
import importlib
import importlib.util
import io
import json
import os
import re
import signal
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

from gpucourse.run import runtime
from gpucourse.run.contract import STORE_PREFIX_ENV, metrics_file, raw_file
from gpucourse.run import comm_recorder

OUTPUT_BUDGET = 10_000  # characters of the submission's own output kept per rank
RECHECKS, RECHECK_S = 5, 0.02  # an allocation must stay alive this long (0.1 s) to count as kept
# What a job's rank imports once, before it forks a process per submission (GradingJob.preload): torch imports
# much on first use (a dispatch mode's or DDP's first op pulls in torch._dynamo and sympy, 800 modules), about a
# second of CPU in every process that does it, and a batch forks a process per submission in every rank.
PRELOAD_BASE = ("numpy.random", "torch.distributed._functional_collectives", "torch.utils.serialization")
PRELOAD = PRELOAD_BASE + ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp",
                          "torch.distributed.optim")
GLOO_WHERE = re.compile(r"\[[^\]]*third_party/gloo[^\]]*\] ")  # gloo's source path in its error messages


def load_submission(path: str, name: str):
    """Import the learner's file as a module (any path: exercises/, solutions/, a submission folder)."""
    spec = importlib.util.spec_from_file_location(f"submission_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_writer(sub: int = 0):
    """log(**record): one JSON line in this rank's metrics file, as runtime.log writes it, with "sub": `sub`.

    `raw={name: tensor or plain value}` in a record is saved to the case's raw file instead (torch.save, read
    back by JobRecords.raw with weights_only=True) and the record keeps the names: the tensors a case produced,
    for the grader process to check. Made after runtime.setup() and before the submission is imported, from
    file descriptors of its own and functions captured now: a submission that replaces gpucourse.run.runtime.log,
    runtime._write_record, json.dumps, torch.save or os.write at import changes nothing the grader writes.
    Keep it in a local variable (no module attribute).
    """
    ctx = runtime.context()
    path = metrics_file(ctx.run_dir, ctx.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw_dir = raw_file(ctx.run_dir, ctx.rank, "plan", sub).parent
    raw_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    raw_fd = os.open(raw_dir, os.O_RDONLY | os.O_DIRECTORY)
    write, dumps, now, rank, lock, tensor = os.write, json.dumps, time.time, ctx.rank, threading.Lock(), torch.Tensor
    save, open_at, close, buffer = torch.save, os.open, os.close, io.BytesIO

    def plain(value):  # as runtime.log: a tensor becomes a number or a list
        if isinstance(value, tensor):
            return value.item() if value.numel() == 1 else value.tolist()
        return value

    def write_all(to, data: bytes) -> None:
        while data:
            data = data[write(to, data):]

    def store(case: str, values: dict) -> list[str]:
        out = buffer()
        save({k: v.detach().cpu().clone() if isinstance(v, tensor) else v for k, v in values.items()}, out)
        name = raw_file(ctx.run_dir, rank, case, sub).name
        to = open_at(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=raw_fd)
        try:
            write_all(to, out.getvalue())
        finally:
            close(to)
        return sorted(values)

    def log(**record) -> None:
        if "raw" in record:
            record["raw"] = store(record["case"], record["raw"])
        line = dumps({"rank": rank, "time": now(), **{k: plain(v) for k, v in record.items()}, "sub": sub}) + "\n"
        with lock:  # the watchdog's thread writes too; O_APPEND keeps whole lines beside runtime's own
            write_all(fd, line.encode())

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
    """Run each (case, group, run[, limit]) as run(*args) under the watchdog's limit (the case's own, if given);
    log one record per case, then "done".

    A case's record is what run returned, with "error": None, or {"error": one line} for an exception of any
    kind (SystemExit and friends are the submission's bugs too). fields() adds the job's own fields, read
    after the case (e.g. whether a forbidden class was used); the case's own fields win. between(), if given,
    runs after each record, still under the case's limit (e.g. a barrier that lines the ranks up again).
    """
    for case, group, run, *own_limit in cases:
        with watchdog.case_limit(case, group, own_limit[0] if own_limit else limit):
            try:
                record = {"error": None, **run(*args)}
            except BaseException as err:  # noqa: BLE001
                record = {"error": one_line(err, os.path.abspath(submission))}
            log(case=case, group=group, **{**fields(), **record})
            if between is not None:
                between()
    log(case="done")


class GradingJob:
    """One exercise's grading job, run in every rank: its script defines a subclass and ends with
    `jobkit.main(ThatJob)`. `run` is the one order of events; a job overrides the hooks it needs.

    The hooks run in this order: options, setup, prepare (what must happen before the submission is imported
    and outside every case's clock: warm-ups, process groups every rank creates), make_guard, make_watchdog,
    plan (logged as the "plan" record with plan_fields), the submission's import (under `watching`), loaded,
    then each case as run(*case_args(module)), its record with fields() and its raw results.
    """

    name = ""  # the submission's module name inside the rank ("ex05"); the exercise's number
    wanted: tuple = ()  # the callables the submission must define
    case_limit = 15.0  # seconds a case may run (--case-limit); the grader's tests pass their own
    reason = "an endless loop, or far too slow"  # what usually makes a case overrun, in the exercise's terms
    barrier_between_cases = False  # a rank that failed before a send must not meet its peers' next case
    preload = PRELOAD  # imported before the first fork (PRELOAD_BASE where no lazy import of torch is needed)

    def options(self, parser: argparse.ArgumentParser) -> None:
        """Add this job's own command-line options (read back from self.args)."""

    def setup(self):
        return runtime.setup(seed=0)

    def prepare(self) -> None:
        """After setup, before the record writer and the import."""

    def make_guard(self, comm) -> "Guard":
        return Guard(comm)

    def make_watchdog(self, log) -> "Watchdog":
        return Watchdog(self.reason, log)

    def plan(self) -> list[tuple]:
        """[(case, group, run[, limit])]: run(*case_args(module)) returns the case's record (a dict; raw= for
        the tensors the grader process checks); a case's own limit in seconds replaces --case-limit."""
        raise NotImplementedError

    def plan_fields(self) -> dict:
        return {}

    def watching(self):
        """What the submission's import runs under (the guard's watch: recorded, output capped)."""
        return self.guard.watching()

    def loaded(self, module) -> None:
        """After the import succeeded (e.g. a reference that needs the submission's own model class)."""

    def case_args(self, module) -> tuple:
        return module, self.guard

    def fields(self) -> dict:
        """Added to every record, the import's too (e.g. whether a forbidden class was reached for)."""
        return {}

    def parse(self, argv=None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(description=self.__doc__)
        parser.add_argument("submissions", nargs="+", help="the files to grade, each in a process of its own")
        parser.add_argument("--case-limit", type=float, default=self.case_limit)
        self.options(parser)
        return parser.parse_args(argv)

    def run(self, args: argparse.Namespace, sub: int) -> None:
        """Grade submission number `sub` of args.submissions, in this (forked) process."""
        self.args = args
        self.submission = os.path.abspath(args.submissions[sub])
        os.environ[STORE_PREFIX_ENV] = f"sub{sub}/"
        self.ctx = self.setup()
        all_connected(self.ctx.world_size)
        self.prepare()
        self.log = log = record_writer(sub)  # before the submission is imported: see record_writer
        self.guard = self.make_guard(comm_recorder.install())
        self.watchdog = self.make_watchdog(log)
        limit = args.case_limit
        cases = self.plan()
        log(case="plan", cases={case: group for case, group, *_ in cases}, world_size=self.ctx.world_size,
            **self.plan_fields())
        module = import_or_exit(self.submission, self.name, self.wanted, self.watching, self.watchdog, limit, log,
                                fields=self.fields)
        self.loaded(module)
        run_cases(cases, self.case_args(module), self.watchdog, limit, self.submission, log, fields=self.fields,
                  between=self.line_up if self.barrier_between_cases else None)
        runtime.teardown()


    def line_up(self) -> None:
        """The barrier between cases, once gloo's workers are idle: a collective of the submission's that failed
        stays on its worker's in-progress list until the worker has finished with it, and a barrier made before
        then waits on it and raises its error again, on that rank only, which would end the rank and cost the
        cases after it."""
        runtime.wait_for_gloo_workers()
        self.guard.dist.barrier()


def all_connected(world: int, wait_s: float = 60.0) -> None:
    """Wait until every rank's process group is up. A rank that finished its cases at once (an untouched exercise
    raises NotImplementedError) and exited closed its connections while a slower rank was still building its gloo
    mesh: "connectFullMesh failed ... Connection closed by peer" on that rank, and the batch's job stalled. Counted
    in the group's store, not with a collective, so that no grader sees one the submission did not make."""
    if not dist.is_initialized() or world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    store.add("gpucourse-connected", 1)
    deadline = time.monotonic() + wait_s
    while store.add("gpucourse-connected", 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)


def main(job_class: type[GradingJob], argv=None) -> None:
    """The entry point of every grading job script: each submission is graded in a process forked from this rank,
    one after the other. This process never joins a process group (nor touches a GPU): it waits for each, and logs
    how it ended ({"case": "exit", "sub": n, "code": ...}). One that writes no record for far longer than a case may
    take (stuck where its own watchdog cannot act) is killed."""
    args = job_class().parse(argv)
    quiet_for = 3 * args.case_limit + 30
    for name in job_class.preload:
        importlib.import_module(name)
    for sub in range(len(args.submissions)):
        sys.stdout.flush()
        sys.stderr.flush()
        # What this process holds (torch and the preloaded modules, ~10^6 objects) is never garbage: frozen, the
        # child's gc.collect() skips it (Allocations.alive_bytes collects up to five times a check: 1.4 s -> 0.1 s).
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                job_class().run(args, sub)
                code = 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else 1
            except BaseException:  # noqa: BLE001 - the grader's own bug: shown in the rank's log
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _log_exit(sub, _wait(pid, quiet_for))


def _metrics_path():
    return metrics_file(runtime.default_run_dir(), int(os.environ.get("RANK", 0)))


def _wait(pid: int, quiet_for: float) -> int:
    """The child's exit code (negative: the signal that ended it); killed after `quiet_for` s without a record."""
    path, size, last = _metrics_path(), -1, time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        now_size = path.stat().st_size if path.exists() else 0
        if now_size != size:
            size, last = now_size, time.monotonic()
        elif time.monotonic() - last > quiet_for:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _log_exit(sub: int, code: int) -> None:
    path = _metrics_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"rank": int(os.environ.get("RANK", 0)), "time": time.time(), "case": "exit", "sub": sub,
                       "code": code}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


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
