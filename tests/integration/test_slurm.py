"""`gpucourse slurm`: the sbatch script it writes, read back, run under stub commands, and run under a real Slurm.

The real test starts its own single-node cluster (Debian's slurmctld + slurmd, auth/none so no munge daemon,
every file in a temp dir, free ports), submits the generated script with `sbatch --wait`, reads the job's
metrics, stops the daemons and checks that nothing of the cluster or the job is left.
"""
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from gpucourse.run.slurm import SlurmConfigError, sbatch_script, write_sbatch

from tests.conftest import JOBS, run_cli

WORKER = JOBS / "worker.py"
SLURM_JOB = JOBS / "slurm_job.py"
ODD_ARGS = ["--msg", "it's a \"test\" $HOME `id`", "--steps", "2"]  # quoting must survive bash


def directives(text: str) -> dict[str, str]:
    """The `#SBATCH --key=value` lines as {key: value}."""
    found = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            assert key not in found, f"#SBATCH --{key} given twice"
            found[key] = value
    return found


def srun_command(text: str) -> list[str]:
    """The srun command line (continuations joined) as bash would split it, before expansion."""
    joined = text.replace("\\\n", " ")
    lines = [line for line in joined.splitlines() if line.startswith("srun ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def after(argv: list[str], program: str) -> list[str]:
    return argv[argv.index(program) + 1:]


# --- the generated text --------------------------------------------------------------------------------------
def test_gpu_nodes_script(tmp_path, runs_dir):
    text = sbatch_script(WORKER, nodes=2, gpus_per_node=4, args=["--steps", "3"], time="01:00:00",
                         partition="gpu", account="proj-42", port=29555, output_dir=tmp_path / "logs")
    d = directives(text)
    assert {k: d[k] for k in ("job-name", "nodes", "ntasks-per-node", "gpus-per-node", "time", "partition",
                              "account")} == {"job-name": "worker", "nodes": "2", "ntasks-per-node": "1",
                                              "gpus-per-node": "4", "time": "01:00:00", "partition": "gpu",
                                              "account": "proj-42"}
    assert int(d["cpus-per-task"]) >= 4  # at least one CPU per rank
    assert d["output"] == f"{tmp_path / 'logs'}/%x-%j.out" and d["error"] == f"{tmp_path / 'logs'}/%x-%j.err"
    srun = srun_command(text)
    assert "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun  # one torchrun per node
    per_node = [a for a in srun if a.startswith("--output=")]
    assert per_node == [f"--output={tmp_path / 'logs'}/%x-%j-%N.out"]
    torchrun = after(srun, "torchrun")
    assert option(torchrun, "--nnodes") == "$SLURM_NNODES"
    assert option(torchrun, "--nproc-per-node") == "4"
    assert option(torchrun, "--rdzv-backend") == "c10d"
    assert option(torchrun, "--rdzv-endpoint") == "$HEAD:29555"
    assert option(torchrun, "--rdzv-id") == "$SLURM_JOB_ID"
    assert torchrun[-3:] == [str(WORKER), "--steps", "3"]
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "GPUCOURSE_BACKEND=gloo" not in text  # GPU nodes: the runtime picks NCCL
    assert f"export GPUCOURSE_RUNS_DIR={runs_dir}" in text


def test_cpu_nodes_script_runs_gloo_ranks(runs_dir):
    text = sbatch_script(WORKER, nodes=3, gpus_per_node=0, procs_per_node=2)
    d = directives(text)
    assert "gpus-per-node" not in d and "partition" not in d and "account" not in d
    assert d["nodes"] == "3" and d["cpus-per-task"] == "2" and d["time"] == "00:30:00"
    assert d["output"].startswith(str(runs_dir / "slurm"))  # default log dir: under the runs dir
    assert option(after(srun_command(text), "torchrun"), "--nproc-per-node") == "2"
    assert "export GPUCOURSE_BACKEND=gloo GPUCOURSE_DEVICE=cpu" in text


def test_restarts_are_passed_to_torchrun_with_an_unshared_store(runs_dir):
    plain = sbatch_script(WORKER, nodes=2, gpus_per_node=1)
    assert option(after(srun_command(plain), "torchrun"), "--max-restarts") == "0"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plain
    text = sbatch_script(WORKER, nodes=2, gpus_per_node=1, max_restarts=3)
    assert option(after(srun_command(text), "torchrun"), "--max-restarts") == "3"
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text  # gloo restarts need their own store


def test_python_option_runs_torchrun_as_a_module(runs_dir):
    srun = srun_command(sbatch_script(WORKER, nodes=1, gpus_per_node=1, python="/opt/my env/bin/python"))
    assert "torchrun" not in srun
    assert after(srun, "/opt/my env/bin/python")[:2] == ["-m", "torch.distributed.run"]


def test_script_passes_bash_syntax_check_and_warns_about_the_store(tmp_path, runs_dir):
    path = write_sbatch(WORKER, nodes=2, gpus_per_node=0, procs_per_node=2, args=ODD_ARGS, port=29600,
                        output_dir=tmp_path / "logs")
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    comments = " ".join(line for line in path.read_text().splitlines() if line.startswith("# "))
    assert "no authentication" in comments.lower() and "29600" in comments and "internal network" in comments


def test_write_sbatch_writes_the_script_and_makes_the_log_dir(tmp_path, runs_dir):
    path = write_sbatch(WORKER, nodes=1, gpus_per_node=2, job_name="my-job", output_dir=tmp_path / "logs")
    assert path == tmp_path / "logs" / "my-job.sbatch" and (tmp_path / "logs").is_dir()
    again = sbatch_script(WORKER, nodes=1, gpus_per_node=2, job_name="my-job", output_dir=tmp_path / "logs")
    def drop_stamp(text):  # the header's date may change between the two calls
        return [line for line in text.splitlines() if "Written by" not in line]

    assert drop_stamp(path.read_text()) == drop_stamp(again)
    assert directives(path.read_text())["job-name"] == "my-job"


STUBS = {
    # scontrol: expand the node list the way Slurm does (only for the list the test sets).
    "scontrol": '[ "$1 $2 $3" = "show hostnames node[07-08]" ] && printf "node07\\nnode08\\n" || exit 9',
    # srun: drop its own options, run the command (as each node's task would).
    "srun": 'while [ "${1#--}" != "$1" ]; do shift; done; exec "$@"',
    # torchrun: report what it was given.
    "torchrun": f'exec {shlex.quote(sys.executable)} -c "import json, os, sys; print(json.dumps('
                '[sys.argv[1:], os.environ.get(\'GPUCOURSE_RUN_DIR\'), os.environ.get(\'GPUCOURSE_BACKEND\')]))" "$@"',
}


def test_script_runs_one_torchrun_with_the_head_node_and_arguments_intact(tmp_path, runs_dir):
    """Run the script with bash, Slurm's commands replaced by stubs: checks expansion and quoting, not just text."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    path = write_sbatch(WORKER, nodes=2, gpus_per_node=0, procs_per_node=3, args=ODD_ARGS, job_name="stub",
                        port=29555, output_dir=tmp_path / "logs")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    argv, run_dir, backend = json.loads(out.stdout.splitlines()[-1])
    assert option(argv, "--nnodes") == "2" and option(argv, "--nproc-per-node") == "3"
    assert option(argv, "--rdzv-endpoint") == "node07:29555" and option(argv, "--rdzv-id") == "4242"
    assert argv[-len(ODD_ARGS) - 1:] == [str(WORKER), *ODD_ARGS]
    assert run_dir == str(runs_dir / "stub-slurm-4242") and Path(run_dir).is_dir()
    assert backend == "gloo"
    assert "job 4242: 2 node(s) x 3 rank(s), rendezvous node07:29555" in out.stdout


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=0, gpus_per_node=1), "nodes=0 is out of range"),
    (dict(nodes=1, gpus_per_node=-1), "gpus_per_node=-1 is out of range"),
    (dict(nodes=1, gpus_per_node=0), "needs procs_per_node"),
    (dict(nodes=1, gpus_per_node=0, procs_per_node=0), "procs_per_node=0 is out of range"),
    (dict(nodes=1, gpus_per_node=4, procs_per_node=2), "one rank per GPU"),
    (dict(nodes=1, gpus_per_node=1, time="30min"), "time '30min' is not a Slurm time limit"),
    (dict(nodes=1, gpus_per_node=1, time="1:2:3:4"), "is not a Slurm time limit"),
    (dict(nodes=1, gpus_per_node=1, job_name="my job"), "job name 'my job' may only contain"),
    (dict(nodes=1, gpus_per_node=1, partition="gpu\n#SBATCH --x"), "partition"),
    (dict(nodes=1, gpus_per_node=1, port=70000), "port=70000 is out of range"),
    (dict(nodes=1, gpus_per_node=1, max_restarts=-1), "max_restarts=-1 is out of range"),
    (dict(nodes=1, gpus_per_node=1, output_dir="/tmp/my logs"), "contains a space"),
    (dict(nodes=1, gpus_per_node=1, args=["--steps", None]), "args[1] is None: each script argument must be a string"),
    (dict(nodes=1, gpus_per_node=1, args="--steps 3"), "args must be a list of strings"),
])
def test_bad_input_is_refused_with_a_clear_message(runs_dir, kwargs, message):
    with pytest.raises(SlurmConfigError, match=re.escape(message)):
        sbatch_script(WORKER, **kwargs)


def test_missing_script_is_refused(runs_dir):
    with pytest.raises(SlurmConfigError, match="script not found: nowhere.py"):
        sbatch_script("nowhere.py", nodes=1, gpus_per_node=1)
    with pytest.raises(SlurmConfigError, match="is a directory: give the path of a Python file in it"):
        sbatch_script(JOBS, nodes=1, gpus_per_node=1)


def test_valid_time_formats_are_accepted(runs_dir):
    for limit in ("30", "30:00", "01:00:00", "2-0", "2-12:00", "1-00:00:00"):
        assert directives(sbatch_script(WORKER, nodes=1, gpus_per_node=1, time=limit))["time"] == limit


# --- the command ---------------------------------------------------------------------------------------------
def test_cli_writes_the_script_and_says_how_to_submit(tmp_path, runs_dir):
    out = run_cli("slurm", WORKER, "--nodes", "2", "--gpus-per-node", "0", "--procs-per-node", "2",
                  "--output-dir", tmp_path / "logs", "--", "--steps", "5", timeout=60)
    assert out.returncode == 0, out.stderr
    path = tmp_path / "logs" / "worker.sbatch"
    assert f"wrote {path}" in out.stdout and f"sbatch {path}" in out.stdout
    assert after(srun_command(path.read_text()), str(WORKER)) == ["--steps", "5"]


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0", "--gpus-per-node", "1"], "nodes=0 is out of range"),
    (["--nodes", "1", "--gpus-per-node", "-2"], "gpus_per_node=-2 is out of range"),
    (["--nodes", "1", "--gpus-per-node", "1", "--time", "soon"], "time 'soon' is not a Slurm time limit"),
    (["--nodes", "1", "--gpus-per-node", "0"], "--procs-per-node"),
    (["--nodes", "two", "--gpus-per-node", "1"], "argument --nodes: invalid int value: 'two'"),
    (["--nodes", "1", "--gpus-per-node", "x"], "argument --gpus-per-node: invalid int value: 'x'"),
    (["--nodes", "1"], "the following arguments are required: --gpus-per-node"),
    (["--nodes", "1", "--gpus-per-node", "1", "--time", ""], "time '' is not a Slurm time limit"),
    (["--nodes", "1", "--gpus-per-node", "1", "--time", "1:2:3:4"], "is not a Slurm time limit"),
    (["--nodes", "1", "--gpus-per-node", "1", "--port", "0"], "port=0 is out of range"),
])
def test_cli_bad_input_one_line_exit_two(runs_dir, args, message):
    out = run_cli("slurm", WORKER, *args, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_existing_files_are_never_overwritten(tmp_path, runs_dir):
    logs, mine = tmp_path / "logs", tmp_path / "mine.sbatch"
    logs.mkdir()
    mine.write_text("#!/bin/bash\n# my own edits\n")
    (logs / "worker.sbatch").write_text("# written earlier, maybe edited since\n")
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    for extra, message in [
        (["-o", mine], f"{mine} already exists and is left untouched: write to another file (-o FILE)"),
        ([], f"{logs / 'worker.sbatch'} already exists"),  # the default path
        (["-o", logs], f"{logs} already exists"),  # a folder
        (["-o", mine / "x.sbatch"], f"cannot write {mine / 'x.sbatch'}"),  # under a file
    ]:
        out = run_cli("slurm", WORKER, "--nodes", "1", "--gpus-per-node", "1", "--output-dir", logs, *extra,
                      timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    with pytest.raises(SlurmConfigError, match="already exists and is left untouched"):
        write_sbatch(WORKER, nodes=1, gpus_per_node=1, path=mine)
    assert {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")} == before


def test_cli_missing_script_exit_two(runs_dir):
    out = run_cli("slurm", "missing.py", "--nodes", "1", "--gpus-per-node", "1", timeout=60)
    assert out.returncode == 2 and "script not found: missing.py" in out.stderr and "Traceback" not in out.stderr


# --- a real Slurm -----------------------------------------------------------------------------------------
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
START_S = 30
STOP_S = 15

SLURM_CONF = """\
# A throw-away one-node cluster for one test: no munge (auth/none), no cgroups, every file under {root}.
ClusterName=gpucourse-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalSlurm:
    """slurmctld + slurmd on this machine, configured and stopped by us (never the system's daemons)."""

    def __init__(self, root: Path):
        self.root = root
        self.ctld_port, self.slurmd_port = free_ports(2)
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> None:
        for sub in ("state", "spool"):
            (self.root / sub).mkdir()
        self.conf.write_text(SLURM_CONF.format(root=self.root, ctld_port=self.ctld_port,
                                               slurmd_port=self.slurmd_port))
        for name, cmd in (("slurmctld", ["slurmctld", "-D", "-i"]), ("slurmd", ["slurmd", "-D", "-N", "localhost"])):
            with open(self.root / f"{name}.out", "w") as out:
                self.daemons.append(subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            for proc, name in zip(self.daemons, ("slurmctld", "slurmd")):
                if proc.poll() is not None:
                    pytest.skip(f"{name} could not start here (exit {proc.returncode}): {self.tail(name)}")
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if state.stdout.strip() == "idle":
                return
            time.sleep(0.3)
        pytest.fail(f"the test's Slurm node never became idle in {START_S} s: {self.tail('slurmd')} "
                    f"| {self.tail('slurmctld')}")

    def tail(self, name: str) -> str:
        text = "".join((self.root / f).read_text(errors="replace") for f in (f"{name}.out", f"{name}.log")
                       if (self.root / f).exists())
        errors = [line for line in text.splitlines() if "error" in line.lower() and "pmix" not in line.lower()]
        return (errors or text.splitlines() or ["(no log)"])[-1]

    def stop(self) -> None:
        """Cancel what is left of the jobs, then SIGTERM the daemons (SIGKILL after STOP_S)."""
        if self.daemons and self.daemons[0].poll() is None:
            subprocess.run(["scancel", "--full", "--quiet", "--user", str(os.getuid())], env=self.env,
                           capture_output=True, timeout=STOP_S)
        for proc in reversed(self.daemons):  # slurmd first, then the controller
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def survivors(self) -> list[psutil.Process]:
        """Live processes of this cluster: daemons, slurmstepd, the job's steps (they all carry our SLURM_CONF)."""
        found = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                    continue
                if proc.environ().get("SLURM_CONF") == str(self.conf) or str(self.root) in " ".join(
                        proc.info["cmdline"] or []):
                    found.append(proc)
            except psutil.Error:
                continue
        return found


def listening(ports) -> list:
    return [c for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in set(ports)]


@pytest.fixture
def local_slurm():
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: apt-get install slurmctld slurmd slurm-client")
    if os.getuid() != 0:
        pytest.skip("a real Slurm test runs slurmd, which must be root to start jobs")
    # A short path: slurmstepd puts unix sockets in the spool dir (108-byte limit), pytest's tmp_path is long.
    root = Path(tempfile.mkdtemp(prefix="gc-slurm-", dir="/tmp"))
    cluster = LocalSlurm(root)
    try:
        yield cluster
    finally:
        cluster.stop()
        for proc in cluster.survivors():  # only if the test failed half-way: processes of our own cluster
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(400)
def test_real_slurm_runs_the_generated_script(local_slurm, tmp_path, runs_dir):
    """sbatch --wait on a one-node cluster: one torchrun, 2 gloo ranks, metrics in one run dir, nothing left."""
    started = time.monotonic()
    local_slurm.start()
    cluster_up = time.monotonic()
    rdzv_port = free_ports(1)[0]
    path = write_sbatch(SLURM_JOB, nodes=1, gpus_per_node=0, procs_per_node=2, job_name="slurm-test",
                        time="00:05:00", port=rdzv_port, python=sys.executable, output_dir=tmp_path / "logs")
    # One host: keep gloo on loopback (the job inherits sbatch's environment).
    env = {**local_slurm.env, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["sbatch", "--wait", "--parsable", str(path)], env=env, capture_output=True, text=True,
                         timeout=300)
    job_id = out.stdout.strip().split(";")[0]
    job_done = time.monotonic()
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "logs").glob(f"*-{job_id}*")}
    assert out.returncode == 0, f"sbatch: {out.stderr.strip()} | logs: {logs}"
    job = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    assert "JobState=COMPLETED" in job and "ExitCode=0:0" in job, job

    # The batch script's own log, and one log per node holding that node's torchrun and its ranks.
    assert f"rendezvous localhost:{rdzv_port}" in logs[f"slurm-test-{job_id}.out"]
    node_logs = [name for name in logs if name.endswith(".out") and name != f"slurm-test-{job_id}.out"]
    assert len(node_logs) == 1, sorted(logs)
    assert "rank 0 of 2: all-reduce 3" in logs[node_logs[0]] and "rank 1 of 2: all-reduce 3" in logs[node_logs[0]]

    # Both ranks logged through gpucourse.run.runtime into the one run dir the script named.
    metrics_dir = runs_dir / f"slurm-test-slurm-{job_id}" / "metrics"
    # Each rank's last record from runtime.log (the runtime's own setup/teardown records aside).
    records = {int(p.stem[4:]): [r for r in map(json.loads, p.read_text().splitlines()) if "event" not in r][-1]
               for p in metrics_dir.glob("rank*.jsonl")}
    assert sorted(records) == [0, 1]
    for rank, rec in records.items():
        assert rec["world_size"] == 2 and rec["backend"] == "gloo" and rec["allreduce"] == 3.0
        assert rec["slurm_job_id"] == job_id and rec["run_id"] == job_id and rec["local_rank"] == rank
    assert records[0]["pid"] != records[1]["pid"]

    local_slurm.stop()
    assert local_slurm.survivors() == []
    assert listening([local_slurm.ctld_port, local_slurm.slurmd_port, rdzv_port]) == []
    print(f"real Slurm test: cluster up in {cluster_up - started:.1f} s, job {job_done - cluster_up:.1f} s, "
          f"checks and stop {time.monotonic() - job_done:.1f} s")
