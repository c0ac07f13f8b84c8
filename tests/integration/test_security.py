"""Who can reach a job's TCP stores: nobody beyond this machine when every node runs here.

torchrun's TCP stores (the rendezvous store in node 0's agent, and the workers' MASTER_PORT store) have
no authentication and, left alone, listen on every interface. The agent binds both to 127.0.0.1 when
all nodes are local (agent.py `_bind_stores_to_loopback`). These tests hold a job open and list the
listening sockets of all its processes. tests/integration/test_multihost.py checks the other side: with a real
rendezvous endpoint the store must stay reachable from the other host.
"""
import json
import threading
import time

import psutil
import pytest

from gpucourse.run.agent import is_loopback_endpoint
from gpucourse.run.launcher import launch

from tests.conftest import JOBS, run_processes

HOLD = JOBS / "hold.py"
LOOPBACK = {"127.0.0.1", "::1"}


def listening_sockets(procs) -> dict[int, list]:
    """{pid: [(ip, port), ...]} of TCP listening sockets (of this network namespace)."""
    out = {}
    for proc in procs:
        try:
            out[proc.pid] = [c.laddr[:2] for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return out


def hold_job(runs_dir, tmp_path, world, **launch_kwargs):
    """Launch hold.py, wait until every rank has all-reduced and logged, list the job's listening sockets,
    then let the job finish. Returns (result, {pid: sockets}, {pid: 'agent' | 'worker'})."""
    release = tmp_path / "release"
    done = {}
    thread = threading.Thread(target=lambda: done.update(res=launch(
        HOLD, args=["--release", release], timeout=150, live=False, check=False,
        env={"OMP_NUM_THREADS": "1"}, **launch_kwargs)))
    thread.start()
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine can take a minute to start 2 agents
        while time.monotonic() < deadline and thread.is_alive():
            # a rank's "sum" record comes after its all-reduce (its setup record, before it, does not count)
            if sum('"sum"' in f.read_text() for f in runs_dir.glob("*/metrics/rank*.jsonl")) == world:
                break
            time.sleep(0.2)
        run_dir = next(runs_dir.iterdir())
        procs = run_processes(run_dir)
        sockets = listening_sockets(procs)
        roles = {p.pid: "worker" if "RANK" in p.environ() else "agent" for p in procs}
    finally:
        release.touch()
        thread.join(timeout=170)
    return done["res"], sockets, roles


@pytest.mark.parametrize("nproc, nnodes", [(2, 1), (1, 2)], ids=["standalone-2ranks", "2nodes-local"])
def test_single_machine_job_listens_on_loopback_only(runs_dir, tmp_path, nproc, nnodes):
    world = nproc * nnodes
    res, sockets, roles = hold_job(runs_dir, tmp_path, world, nproc=nproc, nnodes=nnodes)
    assert res.ok, res.error
    assert [res.metric("sum", rank=r) for r in range(world)] == [[world * (world + 1) / 2]] * world
    assert sorted(roles.values()).count("agent") == nnodes and len(roles) == nnodes + world
    everything = [(pid, addr) for pid, addrs in sockets.items() for addr in addrs]
    exposed = [(roles[pid], pid, addr) for pid, addr in everything if addr[0] not in LOOPBACK]
    assert exposed == [], f"sockets listening beyond loopback: {exposed}"
    # Both stores exist and are hosted by an agent: the rendezvous store, and the workers' store at MASTER_PORT.
    report = next(rec for rec in res.metrics[0] if "sum" in rec)
    master_port = int(report["master_port"])
    agent_ports = {addr[1] for pid, addr in everything if roles[pid] == "agent"}
    assert master_port in agent_ports and len(agent_ports) >= 2
    assert report["master_addr"] == "127.0.0.1"
    manifest = json.loads((res.run_dir / "manifest.json").read_text())
    assert manifest["warnings"] == []


def test_restart_gets_a_fresh_loopback_store(runs_dir, tmp_path):
    """The agent hosts a new workers' store per rendezvous round: a restart must not meet the old one's keys."""
    release = tmp_path / "release"
    release.touch()  # nothing to inspect here: run straight through
    res = launch(HOLD, nproc=2, max_restarts=1, args=["--release", release, "--fail-first-attempt"],
                 timeout=150, live=False, check=False, env={"OMP_NUM_THREADS": "1"})
    assert res.ok, res.error
    assert [res.metric("attempt", rank=r) for r in range(2)] == [[1], [1]]  # attempt 0 never got to log
    assert [res.metric("sum", rank=r) for r in range(2)] == [[3.0], [3.0]]
    assert "deliberate failure on the first attempt" in (res.run_dir / "logs/attempt0/rank0.stderr").read_text()


@pytest.mark.parametrize("endpoint, loopback", [
    ("127.0.0.1:29400", True), ("localhost:0", True), ("[::1]:29400", True), ("127.0.1.1", True),
    ("10.0.0.1:29400", False), ("node0.cluster:29400", False), ("[fe80::1]:1", False), ("", False), (None, False)])
def test_only_literal_loopback_endpoints_count_as_one_machine(endpoint, loopback):
    assert is_loopback_endpoint(endpoint) is loopback
