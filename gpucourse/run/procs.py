"""In the launcher's and the agent's processes: process-tree bookkeeping, find every process a run started and make sure
none survives."""
from __future__ import annotations

import os
import signal
import socket
import subprocess

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


# --- processes started by hand, without torchrun (chapter 08's rendezvous cases) ---------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_commands(specs: list[tuple[list[str], dict]], wait_s: float, grace_s: float = 60) -> list[tuple[int, str]]:
    """Start one process per (command, environment), side by side; return [(exit code, output)] in order once
    all have ended. Each runs in a session of its own and is SIGKILLed with its group if it outlives
    wait_s + grace_s: nothing is left behind."""
    if not specs:
        raise ValueError("run_commands needs at least one (command, environment)")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, env in specs]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=wait_s + grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def last_words(text: str, width: int = 220) -> str:
    """What to read first in a process's output: its last exception line (torch prints C++ frames and warnings
    around it), else its last line, cut to `width` characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].split(".")[-1].endswith(("Error", "Exception"))]
    return (errors or lines or ["(nothing)"])[-1][:width]
