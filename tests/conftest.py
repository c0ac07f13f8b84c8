import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"


@pytest.fixture
def runs_dir(tmp_path, monkeypatch):
    """Every test writes its runs into its own folder (parallel tests never share one)."""
    path = tmp_path / "runs"
    monkeypatch.setenv("GPUCOURSE_RUNS_DIR", str(path))
    return path


def run_processes(run_dir) -> list[psutil.Process]:
    """Live processes belonging to a run: the launcher puts GPUCOURSE_RUN_DIR in the agent's and workers' env."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("GPUCOURSE_RUN_DIR") == str(run_dir) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def listening_ports(pids) -> list:
    pids = set(pids)
    return [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


@pytest.fixture
def python():
    return sys.executable
