"""Process-tree bookkeeping: find every process a run started and make sure none survives."""
from __future__ import annotations

import signal

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def rank_of(proc: psutil.Process) -> int | None:
    """The global rank of a torchrun worker (from its environment), or None for other processes."""
    try:
        rank = proc.environ().get("RANK")
    except psutil.Error:
        return None
    return int(rank) if rank is not None and rank.isdigit() else None


def terminate(procs: list[psutil.Process], grace: float = 3.0) -> None:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL whatever is left, and wait for it to go."""
    alive = [p for p in procs if _signal(p, signal.SIGTERM)]
    _, alive = psutil.wait_procs(alive, timeout=grace)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)


def _signal(proc: psutil.Process, sig: int) -> bool:
    try:
        proc.send_signal(sig)
        return True
    except psutil.Error:
        return False


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out
