"""The launcher's plan and its watch over a job, without torchrun (the launches themselves: tests/integration/)."""
from types import SimpleNamespace

from torch.distributed import run as torchrun

from gpucourse.run import launcher
from gpucourse.run.contract import RUNS_ENV

from tests.conftest import ROOT


def test_torchrun_reads_the_agents_options(tmp_path, monkeypatch):
    """The options the agent passes are torchrun's own, read by torchrun's parser: its monitor looks at the workers
    every MONITOR_S, not at its default 0.1 s."""
    monkeypatch.setenv(RUNS_ENV, str(tmp_path))
    plan = launcher.plan_job(ROOT / "scripts" / "00_hello.py", nproc=2, backend="gloo")
    args = torchrun.parse_args(plan.torchrun_args(0))
    assert args.monitor_interval == launcher.MONITOR_S > 0.1 and args.nproc_per_node == "2" and args.standalone


def test_the_job_is_scanned_at_most_once_in_every(monkeypatch):
    """job.track(every=s) scans /proc for the agents' processes at most once in s seconds; track() always does (before
    a stop)."""
    scans = []
    monkeypatch.setattr(launcher, "descendants", lambda pid: scans.append(pid) or [])
    job = launcher._Job([SimpleNamespace(pid=4321)])  # an agent: only its pid is read
    job.track(every=60)
    assert scans == []
    job.track()
    job.track(every=60)
    assert scans == [4321]
    job._tracked -= 61
    job.track(every=60)
    assert scans == [4321, 4321]
