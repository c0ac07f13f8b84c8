"""In each rank: the in-script runtime, what every course script calls.

    from gpucourse import runtime
    ctx = runtime.setup(seed=0)          # process group, device, watchdog, error capture
    for step in range(steps):
        ...
        runtime.log(step=step, total=steps, loss=runtime.value(loss))
    runtime.teardown()

It works the same under `gpucourse.launch` (which tells it the run directory through
$GPUCOURSE_RUN_DIR) and under plain `torchrun` (it then picks `runs/<script>-<run id>/`). Under
`gpucourse dryrun` (run/dryrun.py) setup() joins a fake process group instead and counts each step;
`value()` then gives None, since no value a dry run computes means anything.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import capture, hardware
from .contract import (BACKEND_ENV, COUNT_FILE_ENV, DRYRUN_ENV, EVENT_SETUP, EVENT_TEARDOWN, FAKE_TENSORS_ENV,
                       RUN_DIR_ENV, STORE_PREFIX_ENV, metrics_file, trace_file)
from .paths import runs_root, slug


@dataclass(frozen=True)
class Context:
    """Who this process is in the job, and where it computes."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    backend: str
    device: torch.device
    run_dir: Path

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_ctx: Context | None = None
_metrics_file = None
_counter = None  # counting.StepCounter, when $GPUCOURSE_COUNT_FILE asks this rank to count its steps
_fake_mode = None  # the FakeTensorMode of a --fake-tensors dry run, from setup() to teardown()


def dry_run() -> bool:
    """True in a `gpucourse dryrun` rank: the process group is fake, collectives move nothing, values mean nothing."""
    return os.environ.get(DRYRUN_ENV) == "1"


def fake_tensors() -> bool:
    """True in a dry run with fake tensors (`gpucourse dryrun --fake-tensors`): from setup() on, tensors have shapes
    and no storage, so no value can be read (value() gives None; .item() or print(tensor) stop the rank)."""
    return dry_run() and os.environ.get(FAKE_TENSORS_ENV) == "1"


def value(tensor) -> float | None:
    """A one-element tensor's value as a float (`.item()`), or None in a dry run, where no value means anything
    (and a fake tensor has none). Scripts read losses and other values they print or log through this."""
    if dry_run():
        return None
    return tensor.item() if isinstance(tensor, torch.Tensor) else float(tensor)


def all_gather_single(output, input, **kwargs):
    """dist.all_gather_single (torch 2.13; its old name, all_gather_into_tensor, deprecated there, is all that torch
    2.11 has). Looked up at each call, so whatever wraps torch.distributed's name counts it."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, **kwargs)


def reduce_scatter_single(output, input, **kwargs):
    """dist.reduce_scatter_single (torch 2.13), or reduce_scatter_tensor on torch 2.11 (all_gather_single's note)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, **kwargs)


def assume(text: str) -> None:
    """State an assumption a dry run's figures rest on, where the script supplies what the fake group cannot (the
    counts an MoE layer would receive, say): the dry run reports it beside the figures. Nothing outside a dry run."""
    if dry_run() and _counter is not None and text not in _counter.assumptions:
        _counter.assumptions.append(text)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def default_run_dir() -> Path:
    """Run directory shared by all ranks of one job, also when started by plain torchrun."""
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    # Ranks of one node share their agent (parent) process; "none" is torchrun's static-rendezvous id.
    tag = run_id[:8] if run_id not in ("", "none") else f"agent{os.getppid()}"
    return runs_root() / f"{slug(Path(sys.argv[0]).stem)}-torchrun-{tag}"


def _watch_parent(interval: float = 0.5) -> None:
    """Exit when the torchrun agent that started us disappears.

    torchrun starts workers in their own session, so a killed notebook kernel or agent never
    signals them; without this thread they would live on (and keep ports) forever.
    """
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(143)

    threading.Thread(target=watch, name="gpucourse-parent-watchdog", daemon=True).start()


FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
GLOO_WORKER_THREAD = "pt_gloo_runloop"


def _gloo_workers_idle() -> bool | None:
    """True when every gloo worker thread of this process sleeps in an untimed wait; None if Linux can't tell.

    An idle worker waits on its queue's condition variable: futex with no timeout (5th field of
    /proc/<tid>/syscall is 0). A worker still running, or waiting for the GIL (Python's take_gil waits
    in 5 ms timed slices), shows otherwise.
    """
    tasks = Path("/proc/self/task")
    if FUTEX_SYSCALL is None or not tasks.is_dir():
        return None
    try:
        for task in tasks.iterdir():
            if (task / "comm").read_text().strip() != GLOO_WORKER_THREAD:
                continue
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            call = (task / "syscall").read_text().split()
            if state != "S" or call[0] != str(FUTEX_SYSCALL) or int(call[4], 16) != 0:
                return False
    except (OSError, IndexError, ValueError):  # a thread ended while we read, or /proc is restricted
        return None
    return True


def wait_for_gloo_workers(timeout_s: float = 10.0) -> bool:
    """Release the GIL until gloo's worker threads are idle (at most `timeout_s`). True if they are.

    Why: a gloo worker thread destroys each finished collective's work object itself. If the work held
    the last reference to a tensor that Python had already dropped, that destructor needs the GIL. Once
    the interpreter is finalizing, a thread asking for the GIL is ended with pthread_exit, whose unwind
    through a noexcept C++ destructor calls std::terminate: the process aborts with "terminate called
    without an active exception" *after* the script's work is done (gdb on the core: ~AsyncAllgatherWork
    -> decref_pyobject -> take_gil -> pthread_exit in ProcessGroupGloo::runLoop). destroy_process_group()
    does not stop the workers while DDP (or anything else) still references the group, so the race
    stays open until exit. Waiting here, before finalization starts, closes it.
    """
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline:
        idle = _gloo_workers_idle()
        if idle is None:  # cannot look: give the workers a moment with the GIL released
            time.sleep(0.05)
            return False
        quiet = quiet + 1 if idle else 0
        if quiet >= 3:  # idle on three looks in a row, a few ms apart
            return True
        time.sleep(0.002)
    return False


def _record_uncaught_exceptions() -> None:
    """Write an uncaught exception to torchrun's per-rank error file, so the launcher can name the root cause.

    Same JSON layout as torch.distributed.elastic's @record decorator, written from sys.excepthook so
    that scripts need no decorator.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path and not issubclass(exc_type, KeyboardInterrupt):
            data = {"message": {"message": f"{exc_type.__name__}: {exc}", "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
                "timestamp": str(int(time.time()))}}}
            with contextlib.suppress(OSError):  # whole or not at all: torchrun may SIGTERM us mid-write
                tmp = Path(f"{path}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(data))
                tmp.replace(path)
        if _ctx is not None and capture.enabled() and not issubclass(exc_type, KeyboardInterrupt):
            with contextlib.suppress(OSError):
                capture.dump(_ctx.run_dir, _ctx.rank, f"{exc_type.__name__}: {exc}")
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)


def setup(*, seed: int | None = None, seed_per_rank: bool = True, timeout_s: float | None = None,
          cuda_with_gloo: bool = True) -> Context:
    """Join the job torchrun started: process group, device, seeds, watchdog. Returns the Context.

    seed: seeds python, numpy and torch with `seed + rank` (or `seed` on every rank if not seed_per_rank).
    timeout_s: collective timeout; short values turn a hang into a clear error (default: torch's).
    cuda_with_gloo: with gloo on a machine with GPUs (more ranks than GPUs), put each rank on a GPU (True)
    or keep it on the CPU (False). gloo runs all_reduce, broadcast and all_gather on CUDA tensors, but not
    everything: on an H100 (torch 2.11, docs/gpu-report-2026-11-25.md and -26.md) its send/recv failed on CUDA
    tensors ("writev ... Bad address") and FSDP2's full_tensor() died of SIGSEGV. Scripts that need those
    pass False.
    """
    global _ctx, _fake_mode
    if _ctx is not None:
        return _ctx
    if "RANK" not in os.environ:
        # Run as a plain `python script.py`: a one-rank job, so every script also runs by itself.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "0"))
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    world_size, local_world = _env_int("WORLD_SIZE", 1), _env_int("LOCAL_WORLD_SIZE", 1)
    _watch_parent()
    _record_uncaught_exceptions()
    atexit.unregister(wait_for_gloo_workers)  # once per process, however often setup() runs
    atexit.register(wait_for_gloo_workers)  # runs before finalization: see wait_for_gloo_workers
    if dry_run():  # gpucourse dryrun: no peers, no device; the fake group answers every collective at once
        backend, where = "fake", "cpu"
    else:
        # The launcher's plan fixed the backend ($GPUCOURSE_BACKEND); under plain torchrun the same rule picks it.
        backend, where = hardware.placement(os.environ.get(BACKEND_ENV, "auto"), local_world, local_rank,
                                            cuda_with_gloo=cuda_with_gloo)
    device = torch.device(where)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    if dry_run():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from .fake import prepare_fake_group

        prepare_fake_group()  # what torch needs from peers that a fake group cannot deliver (pipeline stages' vote)

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    elif os.environ.get("MASTER_PORT") == "0":  # single process without torchrun: no rendezvous needed
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
    elif os.environ.get(STORE_PREFIX_ENV):  # one of several process groups in turn (contract.STORE_PREFIX_ENV)
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, **kwargs))
        dist.init_process_group(backend, store=dist.PrefixStore(os.environ[STORE_PREFIX_ENV], store), rank=rank,
                                world_size=world_size, **kwargs)
    else:
        dist.init_process_group(backend, **kwargs)
    if seed is not None:
        seed_everything(seed + (rank if seed_per_rank else 0))
    if fake_tensors() and _fake_mode is None:  # before the counter: its modes then see the fake tensors' ops
        from .fake import enter_fake_tensors

        _fake_mode = enter_fake_tensors()  # after the process group and seeds; the script's model comes after it
    _start_counting(rank, world_size)
    run_dir = default_run_dir()
    if not dry_run():
        capture.start(run_dir, rank)
    _ctx = Context(rank, local_rank, world_size, local_world, _env_int("GROUP_RANK", 0), backend, device, run_dir)
    _write_record({"event": EVENT_SETUP, "world_size": world_size, "backend": backend, "device": str(device),
                   "pid": os.getpid(), "host": os.uname().nodename})
    return _ctx


def _start_counting(rank: int, world_size: int) -> None:
    """$GPUCOURSE_COUNT_FILE (gpucourse dryrun, or a real job compared with one): count every step. A relative path
    is in the job's run folder."""
    global _counter
    path = os.environ.get(COUNT_FILE_ENV)
    if path and _counter is None:
        from .counting import StepCounter

        _counter = StepCounter(str(default_run_dir() / path), rank, world_size, dry=dry_run())
        atexit.register(_counter.finish)  # a script that never calls teardown() still leaves its counts


def context() -> Context:
    if _ctx is None:
        raise RuntimeError("gpucourse.run.runtime.setup() has not been called in this process")
    return _ctx


def amp_dtype(device=None) -> torch.dtype:
    """The 16-bit type to train in on `device` (default: this rank's): bfloat16 where the device computes in it
    (CPUs; NVIDIA from Ampere on: A100, L4, H100), float16 where it does not (T4, V100: Colab's and Kaggle's free
    GPUs). torch calls bfloat16 "supported" on a T4 because it can emulate it, slowly: emulation does not count
    here. float16 needs a loss scaler: grad_scaler()."""
    device = torch.device(device if device is not None else context().device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def grad_scaler(dtype: torch.dtype, device=None) -> torch.amp.GradScaler:
    """A GradScaler that scales the loss for float16 and does nothing for the other types (bfloat16 and float32
    have float32's range: nothing underflows), so a training loop is the same whichever amp_dtype() chose."""
    device = torch.device(device if device is not None else context().device)
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def _write_record(record: dict) -> None:
    global _metrics_file
    ctx = context()
    if _metrics_file is None:
        path = metrics_file(ctx.run_dir, ctx.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        _metrics_file = open(path, "a", buffering=1)  # line-buffered: the launcher tails it live
    _metrics_file.write(json.dumps({"rank": ctx.rank, "time": time.time(), **record}) + "\n")


def _plain(value):
    if isinstance(value, torch.Tensor) and fake_tensors():  # a fake tensor has no value to log
        return None
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def log(step: int | None = None, *, total: int | None = None, **metrics) -> None:
    """Record metrics for this rank (one JSON line). `step`/`total` drive the launcher's progress bar."""
    record = {k: _plain(v) for k, v in metrics.items()}
    if step is not None:
        record["step"] = int(step)
        if _counter is not None:
            _counter.mark(step)
    if total is not None:
        record["total"] = int(total)
    _write_record(record)


@contextlib.contextmanager
def profile(*, wait: int = 1, warmup: int = 1, active: int = 3, record_shapes: bool = False, name: str | None = None):
    """Profile the steps of a loop; call `prof.step()` once per step. Writes traces/rank<r>.json.

    The schedule (skip `wait` steps, warm up, record `active`) puts ProfilerStep#N markers in the
    trace, which the trace analysis uses to cut time into steps.
    """
    from torch.profiler import ProfilerActivity, schedule

    ctx = context()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    out = trace_file(ctx.run_dir, name or "rank", ctx.rank)
    out.parent.mkdir(parents=True, exist_ok=True)

    def export(prof):
        prof.export_chrome_trace(str(out))

    with torch.profiler.profile(activities=activities, record_shapes=record_shapes, on_trace_ready=export,
                                schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1)) as prof:
        yield prof


def teardown() -> None:
    """Leave the job cleanly: flush metrics, destroy the process group.

    The last metrics record, {"event": "teardown"}, says this rank finished its work: a rank that
    dies after it (gloo can abort at interpreter exit) has left complete results, and the launcher's
    report says so (result.py) instead of blaming the run's results.
    """
    global _ctx, _metrics_file, _fake_mode
    if _counter is not None:
        _counter.finish()
    if _fake_mode is not None:
        _fake_mode.__exit__(None, None, None)
        _fake_mode = None
    if _ctx is not None:
        _write_record({"event": EVENT_TEARDOWN})
    if _metrics_file is not None:
        _metrics_file.close()
        _metrics_file = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _ctx = None


@contextlib.contextmanager
def session(**kwargs):
    """`with runtime.session(seed=0) as ctx:` = setup(), then teardown() even on error."""
    ctx = setup(**kwargs)
    try:
        yield ctx
    finally:
        teardown()

