"""`gpucourse.launch` (this module is `gpucourse.launcher`): run a script as a real torchrun job, watch every rank, leave nothing behind.

    result = launch("scripts/00_hello.py", nproc=4)

One launcher for notebooks, the CLI, the graders and the benchmarks. The job runs under
`python -m gpucourse.agent` (torchrun's own agent, made leak-proof: see agent.py); this module
validates the request, follows the run directory from the caller's thread, enforces the timeout and
stall limits, kills the whole process tree on any way out, and reads the run back as a RunResult.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import psutil

from . import hardware
from .agent import OPEN_STORE_WARNING, is_loopback_endpoint
from .contract import (BACKEND_ENV, ENV_PREFIX, RUN_DIR_ENV, SCRIPT_ARGS_ENV, agent_log, exit_file, logs_dir,
                       manifest_file, node_suffix)
from .live import make_view
from .paths import new_run_dir, runs_root, slug
from .procs import alive, descendants, rank_of, terminate
from .result import RunResult, load_run

BACKENDS = ("auto", "gloo", "nccl", "mpi")
MAX_NPROC = 256
POLL_S = 0.1
AGENT_GRACE_S = 5.0
STARTUP_GRACE_S = 60.0  # before a rank's first word, stalls are measured with this much extra slack


class LaunchError(RuntimeError):
    """A job that did not finish cleanly. `.result` holds everything it left (logs, metrics, traces)."""

    def __init__(self, message: str, result: RunResult | None = None):
        super().__init__(message)
        self.result = result


class LaunchConfigError(ValueError):
    """The launch request itself is wrong (bad nproc, missing script, ...): nothing was started."""


# --- validation: every bad input gets one clear sentence, before anything starts ----------------
def _check_script(script) -> Path:
    if not isinstance(script, (str, os.PathLike)):
        raise LaunchConfigError(f"script must be the path of a Python file, not {script!r}")
    path = Path(script).expanduser()
    if path.is_dir():
        raise LaunchConfigError(f"script {script} is a directory: give the path of a Python file in it")
    if not path.is_file():
        raise LaunchConfigError(f"script not found: {script} (looked for {path.resolve()})")
    try:
        compile(path.read_bytes(), str(path), "exec")
    except OSError as err:
        raise LaunchConfigError(f"cannot read the script {script}: {err.strerror or err}") from None
    except (SyntaxError, ValueError) as err:  # ValueError: null bytes, on some Pythons
        where = f" at line {err.lineno}" if getattr(err, "lineno", None) else ""
        raise LaunchConfigError(f"{script} has a syntax error{where}: {getattr(err, 'msg', err)}; "
                                "fix it (is it really a Python file?)") from None
    return path.resolve()


def script_args(args) -> list[str]:
    """The script's arguments as strings: numbers and paths are converted, anything else is refused."""
    if not isinstance(args, (list, tuple)):
        raise LaunchConfigError(f"args must be a list of strings, e.g. args=['--steps', '10'], not {args!r}")
    for i, arg in enumerate(args):
        if isinstance(arg, bytes) or not isinstance(arg, (str, int, float, os.PathLike)):
            raise LaunchConfigError(f"args[{i}] is {arg!r}: each script argument must be a string "
                                    "(numbers and paths are converted with str())")
    return [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args]


def _check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LaunchConfigError(f"{name} must be a whole number, not {value!r}")
    if not low <= value <= high:
        raise LaunchConfigError(f"{name}={value} is out of range: use {low} to {high}")
    return value


def _check_seconds(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise LaunchConfigError(f"{name} must be a positive number of seconds or None, not {value!r}")
    return float(value)


def resolve_backend(backend: str, nproc: int) -> str:
    """'auto' → NCCL when every rank gets its own GPU, else gloo; explicit choices are checked."""
    if backend not in BACKENDS:
        raise LaunchConfigError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    gpus = hardware.gpu_count()
    if backend == "auto":
        return "nccl" if 0 < nproc <= gpus else "gloo"
    if backend == "nccl" and nproc > gpus:
        raise LaunchConfigError(
            f"NCCL needs one GPU per rank: {nproc} rank(s) asked, {gpus} GPU(s) here. "
            + ("Use backend='gloo' (CPU processes), or run on a machine with GPUs." if gpus == 0 else
               f"Use nproc<={gpus}, or backend='gloo' to let ranks share GPUs."))
    if backend == "mpi" and not hardware.mpi_available():
        raise LaunchConfigError("this PyTorch build has no MPI support: use backend='gloo' (or 'nccl' on GPUs)")
    return backend


def _writable_run_dir(name: str) -> Path:
    root = runs_root()
    try:
        return new_run_dir(name, root)
    except OSError as err:
        raise LaunchConfigError(f"cannot write the runs directory {root}: {err.strerror or err}. "
                                f"Set GPUCOURSE_RUNS_DIR to a writable folder.") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the job ------------------------------------------------------------------------------------
def _torchrun_args(script: Path, args, run_dir: Path, nproc: int, nnodes: int, node_rank: int,
                   rdzv_endpoint: str | None, max_restarts: int, rdzv_id: str) -> list[str]:
    common = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
              "--logs-specs", "gpucourse", "--log-dir", str(logs_dir(run_dir)), "--redirects", "3"]
    if nnodes == 1 and not rdzv_endpoint:
        nodes = ["--standalone", "--nnodes", "1"]
    else:
        nodes = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return nodes + common + [str(script)]  # the script's own arguments go through SCRIPT_ARGS_ENV


def _job_env(run_dir: Path, backend: str, nproc: int, one_host: bool, extra: dict | None, args) -> dict:
    env = dict(os.environ)
    env.update({RUN_DIR_ENV: str(run_dir), SCRIPT_ARGS_ENV: json.dumps(list(map(str, args))), BACKEND_ENV: backend, "PYTHONUNBUFFERED": "1",
                # Restarts under gloo are unreliable when workers share the agent's store (pytorch#135712).
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if one_host and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every node here: keep gloo's traffic on loopback
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "gpucourse"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _write_manifest(run_dir: Path, manifest: dict) -> None:
    path = manifest_file(run_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, default=str))
    tmp.replace(path)


class _Job:
    """The agents of one run and every process below them, tracked so none can slip away."""

    def __init__(self, agents: list[subprocess.Popen]):
        self.agents = agents
        self.seen: dict[int, psutil.Process] = {}
        self.ranks: dict[int, int] = {}  # pid -> global rank

    def track(self) -> None:
        for agent in self.agents:
            for proc in descendants(agent.pid):
                self.seen.setdefault(proc.pid, proc)
        # Asked again until it answers: a worker caught between fork and exec still carries torchrun's
        # environment, without RANK, and would otherwise never be named.
        for pid, proc in self.seen.items():
            if pid not in self.ranks and (rank := rank_of(proc)) is not None:
                self.ranks[pid] = rank

    def finished(self) -> bool:
        return all(a.poll() is not None for a in self.agents)

    def running_ranks(self) -> list[int]:
        return sorted({self.ranks[p.pid] for p in alive(list(self.seen.values())) if p.pid in self.ranks})

    def all_ranks_ended(self) -> bool:
        """Ranks were started and none is alive any more (the agents may still be reporting)."""
        return bool(self.ranks) and not self.running_ranks()

    def stop(self) -> None:
        """SIGTERM the agents (torchrun forwards it), give them a grace period, then kill the whole tree."""
        self.track()
        agents = [psutil.Process(a.pid) for a in self.agents if a.poll() is None]
        terminate(agents, AGENT_GRACE_S)
        for agent in self.agents:
            agent.wait()
        self.reap()

    def reap(self) -> None:
        self.track()
        terminate(alive(list(self.seen.values())), 1.0)


def launch(script, *, nproc: int = 2, args=(), backend: str = "auto", timeout: float | None = None,
           name: str | None = None, env: dict | None = None, check: bool = True, live=None,
           stall_timeout: float | None = None, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, max_restarts: int = 0) -> RunResult:
    """Run `script` with `nproc` ranks per node under torchrun and return what it left, as a RunResult.

    backend: 'auto' (NCCL when each rank has a GPU of its own, else gloo), 'gloo', 'nccl' or 'mpi'.
    timeout: stop the job after this many seconds. stall_timeout: stop it when no rank has printed or
    logged anything for this long. check: raise LaunchError (with the root cause) unless it succeeded.
    live: how to show it while it runs: None/True (widget in a notebook, text elsewhere), 'text',
    'widget', or False. nnodes > 1 without rdzv_endpoint starts that many torchrun agents here, each a
    "node"; with rdzv_endpoint ("host:port") this process is node `node_rank` of a real multi-host job,
    which meets the other hosts' launches of the same `name` (the rendezvous id).
    Security: a job whose nodes all run here keeps its stores on 127.0.0.1 (see agent.py); a multi-host
    job's stores listen on every interface without authentication (the manifest says so under "warnings").
    """
    nproc = _check_int("nproc", nproc, 1, MAX_NPROC)
    nnodes = _check_int("nnodes", nnodes, 1, 1024)
    node_rank = _check_int("node_rank", node_rank, 0, nnodes - 1)
    max_restarts = _check_int("max_restarts", max_restarts, 0, 100)
    timeout, stall_timeout = _check_seconds("timeout", timeout), _check_seconds("stall_timeout", stall_timeout)
    args = script_args(args)
    if name is not None and not isinstance(name, str):
        raise LaunchConfigError(f"name must be a string (the run's name) or None, not {name!r}")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and k for k in env)):
        raise LaunchConfigError(f"env must be a dict like {{'NAME': 'value'}} or None, not {env!r}")
    if live not in (None, True, False, "auto", "widget", "text", "off"):
        raise LaunchConfigError(f"live must be True, False, 'widget', 'text' or 'off', not {live!r}")
    script = _check_script(script)
    local_nodes = nnodes if not rdzv_endpoint else 1  # agents started on this machine
    backend = resolve_backend(backend, nproc)
    run_dir = _writable_run_dir(name or script.stem)
    world = nproc * nnodes
    endpoint = rdzv_endpoint or (f"127.0.0.1:{_free_port()}" if nnodes > 1 else None)
    one_host = not rdzv_endpoint or is_loopback_endpoint(rdzv_endpoint)
    # Hosts of a real multi-host job must agree on the rendezvous id: the run's name, not its folder.
    rdzv_id = slug(name or script.stem) if rdzv_endpoint else run_dir.name
    job_env = _job_env(run_dir, backend, nproc, one_host, env, args)
    commands = []
    for k in range(local_nodes):
        node = node_rank if rdzv_endpoint else k
        suffix = node_suffix(node) if nnodes > 1 else ""
        targs = _torchrun_args(script, args, run_dir, nproc, nnodes, node, endpoint, max_restarts, rdzv_id)
        commands.append((suffix, [sys.executable, "-m", "gpucourse.agent", str(exit_file(run_dir, suffix)),
                                  "--", *targs]))
    manifest = {
        "name": run_dir.name, "script": str(script), "args": list(map(str, args)), "backend": backend,
        "nproc_per_node": nproc, "nnodes": nnodes, "world_size": world,
        "device": "cuda" if backend == "nccl" or hardware.gpu_count() else "cpu",
        "torchrun": ["torchrun", *commands[0][1][5:], *map(str, args)], "commands": [c for _, c in commands],
        "host": socket.gethostname(), "versions": _versions(), "start": time.time(), "status": "running",
        "warnings": [] if one_host else [OPEN_STORE_WARNING],
        "env": {k: v for k, v in job_env.items()
                if k.startswith((ENV_PREFIX, "OMP_", "GLOO_", "NCCL_", "TORCH_")) and k != SCRIPT_ARGS_ENV}}
    _write_manifest(run_dir, manifest)
    for warning in manifest["warnings"]:
        print(f"gpucourse: warning: {warning}", file=sys.stderr, flush=True)

    header = f"{script.name}: {world} rank(s), backend {backend}, {manifest['device']} — {run_dir}"
    view = make_view(live, header, world)
    agents = []
    for suffix, cmd in commands:
        log = open(agent_log(run_dir, suffix), "wb")
        # A session of its own: Ctrl-C in a terminal reaches us once, and we stop the job in order.
        agents.append(subprocess.Popen(cmd, env=job_env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd()))
        log.close()
    job, started = _Job(agents), time.monotonic()
    from .tail import RunTailer

    tailer, last_activity, heard = RunTailer(run_dir), time.monotonic(), False
    stop_status = stop_reason = None
    running: list[int] = []
    try:
        while not job.finished():
            job.track()
            lines, records = tailer.poll()
            if any(ln.rank is not None for ln in lines) or records:
                last_activity, heard = time.monotonic(), True
            view.update(lines, records, "running")
            now = time.monotonic()
            if timeout and now - started > timeout:
                stop_status, stop_reason = "timeout", f"timed out after {timeout:g} s"
            elif (stall_timeout and now - last_activity > stall_timeout + (0 if heard else STARTUP_GRACE_S)
                  and not job.all_ranks_ended()):
                # Starting torch in every rank can take many seconds on a busy machine: not a stall. Nor is
                # an agent winding down after its ranks ended: its report holds the root cause.
                stop_status, stop_reason = "stalled", f"stalled: no rank printed or logged for {stall_timeout:g} s"
            if stop_reason:
                running = job.running_ranks()
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        stop_status, stop_reason, running = "interrupted", "interrupted (KeyboardInterrupt)", job.running_ranks()
        raise
    finally:
        job.stop() if not job.finished() or stop_reason else job.reap()
        lines, records = tailer.poll(final=True)
        view.update(lines, records, "stopping")
        manifest.update(end=time.time(), duration=round(time.monotonic() - started, 3),
                        agent_returncodes=[a.returncode for a in agents])
        if stop_reason:
            detail = "\n".join(f"rank {r} was still running; its last line: {tailer.last_line.get(r, '(nothing)')}"
                               for r in running) or "no rank was running any more"
            manifest.update(status=stop_status, stop_detail=detail,
                            stop_reason=f"{stop_reason}; ranks still running: {running or 'none'}")
        else:
            manifest["status"] = "ok" if all(a.returncode == 0 for a in agents) else "failed"
        _write_manifest(run_dir, manifest)
        result = load_run(run_dir)
        view.finish(result, stop_status == "interrupted")
    if check and not result.ok:
        raise LaunchError(f"{result.error or result.status} (logs: {run_dir})", result)
    return result
