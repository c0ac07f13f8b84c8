"""A real two-host job: two network namespaces joined by a veth pair, one `gpucourse launch` in each.

Each namespace is a "host" with its own interfaces, addresses and ports; the only way between them is
the veth link (10.77.0.1 <-> 10.77.0.2). The two launches meet at a rendezvous endpoint on host 0, as on
a real cluster, and gloo is pinned to the veth (GLOO_SOCKET_IFNAME), so every byte between the hosts
crosses the link. Needs root (CAP_SYS_ADMIN) and iproute2: skipped with the reason otherwise.

Two settings a real cluster usually gets from DNS are given through torchrun's environment options here,
because both namespaces share one host name (which resolves to 127.0.0.1): PET_LOCAL_ADDR (the address
other hosts reach this one at, which becomes MASTER_ADDR) and PET_RDZV_CONF=is_host=... (which agent
hosts the rendezvous store).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gpucourse.run.contract import RUNS_ENV
from gpucourse.run.result import load_run

from tests.conftest import JOBS, run_processes

HOLD = JOBS / "hold.py"
SUBNET = "10.77.0"  # lives only inside the two namespaces: no clash with the machine's own networks
PORT = 29400
NPROC = 1  # ranks per host: world size 2 keeps the test well under a minute on a loaded 2-core machine


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def hosts():
    """Two namespaces ("hosts") and a veth pair between them; removed afterwards, whatever happened."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed: cannot create network namespaces")
    tag = f"{os.getpid() % 100000}"
    names, links = [f"gc{tag}h0", f"gc{tag}h1"], [f"gc{tag}v0", f"gc{tag}v1"]
    made = []
    try:
        for ns in names:
            out = ip("netns", "add", ns, check=False)
            if out.returncode:
                pytest.skip(f"cannot create a network namespace (needs root / CAP_SYS_ADMIN): {out.stderr.strip()}")
            made.append(ns)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for k, (ns, link) in enumerate(zip(names, links)):
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield [{"ns": ns, "link": link, "addr": f"{SUBNET}.{k + 1}"} for k, (ns, link) in enumerate(zip(names, links))]
    finally:
        survivors = {}
        for ns in made:
            pids = ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # only processes this test started can live in its namespaces
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            survivors.update({ns: pids} if pids else {})
            ip("netns", "del", ns, check=False)  # also removes the veth pair
        assert not survivors, f"processes survived in the namespaces: {survivors}"


def netns_listeners(ns: str, pids) -> list:
    """(pid, ip, port) of TCP sockets listening in namespace `ns` owned by `pids` (psutil reads its own netns)."""
    code = ("import json, psutil, sys; pids = set(json.loads(sys.argv[1])); "
            "print(json.dumps([(c.pid, *c.laddr[:2]) for c in psutil.net_connections(kind='tcp') "
            "if c.status == psutil.CONN_LISTEN and c.pid in pids]))")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, json.dumps(sorted(pids))],
                         capture_output=True, text=True, timeout=60, check=True)
    return [tuple(x) for x in json.loads(out.stdout)]


def start_host(host, node_rank, runs, release):
    """`gpucourse launch` on one host, exactly as on a real machine, inside its namespace."""
    env = {**os.environ, RUNS_ENV: str(runs), "OMP_NUM_THREADS": "1",  # runs: each host's own, as on two machines
           "GLOO_SOCKET_IFNAME": host["link"],  # gloo over the link, never lo
           "PET_LOCAL_ADDR": host["addr"], "PET_RDZV_CONF": f"is_host={int(node_rank == 0)}"}
    cmd = ["ip", "netns", "exec", host["ns"], sys.executable, "-m", "gpucourse.tools.cli", "launch", str(HOLD),
           "-n", str(NPROC), "--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", f"{SUBNET}.1:{PORT}",
           "--name", "twohost", "--timeout", "100", "-q", "--", "--release", str(release), "--max-wait", "90"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_ranks(runs_roots, world, procs, deadline_s=100):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        # a rank's "sum" record comes after its all-reduce (the setup record before it does not count)
        if sum('"sum"' in f.read_text() for r in runs_roots for f in r.glob("*/metrics/rank*.jsonl")) == world:
            return True
        time.sleep(0.2)
    return False


def test_two_hosts_rendezvous_across_a_veth_link(hosts, tmp_path):
    world = 2 * NPROC
    runs = [tmp_path / "host0-runs", tmp_path / "host1-runs"]
    release = tmp_path / "release"
    launches = [start_host(h, k, runs[k], release) for k, h in enumerate(hosts)]
    try:
        ready = wait_for_ranks(runs, world, launches)
        run_dirs = [next(r.iterdir()) for r in runs]
        # While the job holds: host 0's rendezvous store must be reachable from host 1, so not on loopback.
        agent0 = [p.pid for p in run_processes(run_dirs[0]) if "RANK" not in p.environ()]
        host0_listeners = netns_listeners(hosts[0]["ns"], agent0) if ready else []
    finally:
        release.touch()
        outputs = [p.communicate(timeout=120)[0] for p in launches]
    assert ready, "the two hosts never all logged:\n" + "\n---\n".join(outputs)
    assert [p.returncode for p in launches] == [0, 0], "\n---\n".join(outputs)

    results = [load_run(d) for d in run_dirs]
    logged = [sorted(r for r, recs in res.metrics.items() if recs) for res in results]  # each host: its own ranks
    records = {r: next(x for x in res.metrics[r] if "sum" in x) for res, ranks in zip(results, logged) for r in ranks}
    assert sorted(records) == list(range(world))  # every global rank ran once, across the two hosts
    assert all(rec["sum"] == world * (world + 1) / 2 for rec in records.values())
    # Rank numbering follows host order: host 0 owns the first NPROC ranks.
    assert logged == [list(range(NPROC)), list(range(NPROC, world))]

    # The rendezvous crossed the link: host 1's workers were sent to host 0's address, and talk to it.
    peers = {r: {a.removeprefix("::ffff:") for a in rec["peers"]} for r, rec in records.items()}  # v4-mapped
    for rank in range(NPROC, world):
        assert records[rank]["master_addr"] == hosts[0]["addr"]
        assert hosts[0]["addr"] in peers[rank], records[rank]
    for rank in range(NPROC):
        assert hosts[1]["addr"] in peers[rank], records[rank]

    # Host 0's agent listens beyond loopback (the store must be reachable), and the run says so.
    assert any(addr not in ("127.0.0.1", "::1") and port == PORT for _, addr, port in host0_listeners), host0_listeners
    for res in results:
        manifest = json.loads((res.run_dir / "manifest.json").read_text())
        assert any("without authentication" in w for w in manifest["warnings"])
    assert "without authentication" in next(run_dirs[0].glob("agent*.log")).read_text()
    assert all("gpucourse: warning:" in out and "without authentication" in out for out in outputs)  # told, too
    for d in run_dirs:
        assert run_processes(d) == []
