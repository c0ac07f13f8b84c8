"""In the launcher's process (a notebook, the CLI): `gpucourse.launch` (this module: `gpucourse.run.launcher`) runs a
script as a real torchrun job, watches every rank, leaves nothing behind.

    result = launch("scripts/00_hello.py", nproc=4)

One launcher for notebooks, the CLI, the graders and the benchmarks. The job runs under
`python -m gpucourse.run.agent` (torchrun's own agent, made leak-proof: see agent.py). `launch` reads as
plan → start → supervise → finish: it checks the request and decides the job once (a JobPlan: the
agents' command lines, the ranks' environment and the manifest come from it), starts one agent per
node, follows the run directory from the caller's thread while enforcing the timeout and stall limits,
and on any way out kills the whole process tree and reads the run back as a RunResult.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import psutil

from . import forensics, hardware
from .agent import OPEN_STORE_WARNING, is_loopback_endpoint
from .contract import (BACKEND_ENV, DEVICE_ENV, ENV_PREFIX, RUN_DIR_ENV, agent_log, exit_file, logs_dir, manifest_file,
                       node_suffix)
from .live import LIVE_ENV, StatusLine, in_notebook, make_view
from .paths import new_run_dir, runs_root, slug
from .procs import alive, descendants, rank_of, terminate
from .result import RunResult, device_kinds, load_run, reported_devices
from .tail import RunTailer

BACKENDS = ("auto", "gloo", "nccl", "mpi")
MAX_NPROC = 256
POLL_S = 0.1
AGENT_GRACE_S = 5.0
STARTUP_GRACE_S = 60.0  # before any rank's first word, stalls get this much more, from the last rank's start


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


def _placement(backend: str, nproc: int, cpu_only: bool) -> hardware.Placement:
    """hardware.placement for this request, once it is checked: a backend this machine cannot run is refused."""
    if backend not in BACKENDS:
        raise LaunchConfigError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    gpus = hardware.gpu_count()
    if backend == "nccl" and nproc > gpus:
        raise LaunchConfigError(
            f"NCCL needs one GPU per rank: {nproc} rank(s) asked, {gpus} GPU(s) here. "
            + ("Use backend='gloo' (CPU processes), or run on a machine with GPUs." if gpus == 0 else
               f"Use nproc<={gpus}, or backend='gloo' to let ranks share GPUs."))
    if backend == "mpi" and not hardware.mpi_available():
        raise LaunchConfigError("this PyTorch build has no MPI support: use backend='gloo' (or 'nccl' on GPUs)")
    return hardware.placement(backend, nproc, gpus=gpus, cpu_only=cpu_only)


def resolve_backend(backend: str, nproc: int, *, cpu_only: bool = False) -> str:
    """The backend a launch of `nproc` ranks per node gets: 'auto' decided by hardware.placement, others checked."""
    return _placement(backend, nproc, cpu_only).backend


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


# --- the plan: everything decided before anything starts -----------------------------------------
@dataclass(frozen=True)
class JobPlan:
    """One job, decided once: the agents' command lines, the ranks' environment and the manifest are read from it."""

    script: Path
    args: tuple[str, ...]  # the script's own arguments
    run_dir: Path
    nproc: int  # ranks per node
    nnodes: int
    node_rank: int  # this host's node of a multi-host job; 0 when every node runs here
    backend: str  # 'gloo', 'nccl' or 'mpi' (hardware.placement)
    device: str  # 'cuda' or 'cpu': the plan's guess; each rank reports where it really computes
    rdzv_endpoint: str | None  # None: one node, --standalone
    multi_host: bool  # the caller gave the endpoint: this launch is node `node_rank`, other hosts start the rest
    one_host: bool  # every node runs on this machine (simulated nodes, or a loopback endpoint)
    rdzv_id: str
    max_restarts: int
    timeout: float | None
    stall_timeout: float | None
    env: dict = field(repr=False)  # the agents' (and so the ranks') whole environment

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def local_nodes(self) -> list[int]:
        """The node ranks whose agents this launch starts: all of them, unless this is one host of several."""
        return [self.node_rank] if self.multi_host else list(range(self.nnodes))

    def suffix(self, node: int) -> str:
        return node_suffix(node) if self.nnodes > 1 else ""

    def torchrun_args(self, node: int) -> list[str]:
        """torchrun's options for `node`, ending with the script (its own arguments come after)."""
        if self.rdzv_endpoint is None:
            nodes = ["--standalone", "--nnodes", "1"]
        else:
            nodes = ["--nnodes", str(self.nnodes), "--node-rank", str(node), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
        return nodes + ["--nproc-per-node", str(self.nproc), "--max-restarts", str(self.max_restarts),
                        "--logs-specs", "gpucourse", "--log-dir", str(logs_dir(self.run_dir)), "--redirects", "3",
                        str(self.script)]

    def torchrun_line(self, node: int) -> list[str]:
        """The plain torchrun command that node `node`'s agent stands for."""
        return ["torchrun", *self.torchrun_args(node), *self.args]

    def agent_command(self, node: int) -> list[str]:
        """How node `node`'s agent is started: see agent.py for the two `--` separators."""
        return [sys.executable, "-m", "gpucourse.run.agent", str(exit_file(self.run_dir, self.suffix(node))),
                "--", *self.torchrun_args(node), "--", *self.args]

    def record(self) -> dict:
        """The plan as the manifest records it."""
        return {"name": self.run_dir.name, "script": str(self.script), "args": list(self.args),
                "backend": self.backend, "planned_device": self.device, "device": self.device,
                "nproc_per_node": self.nproc, "nnodes": self.nnodes, "node_rank": self.node_rank,
                "world_size": self.world_size, "rdzv_endpoint": self.rdzv_endpoint, "rdzv_id": self.rdzv_id,
                "max_restarts": self.max_restarts, "timeout": self.timeout, "stall_timeout": self.stall_timeout,
                "torchrun": self.torchrun_line(self.local_nodes[0]),
                "torchrun_per_node": [self.torchrun_line(n) for n in self.local_nodes],
                "commands": [self.agent_command(n) for n in self.local_nodes],
                "env": {k: v for k, v in self.env.items()
                        if k.startswith((ENV_PREFIX, "OMP_", "GLOO_", "NCCL_", "TORCH_"))}}


def _job_env(run_dir: Path, backend: str, nproc: int, one_host: bool, extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update({RUN_DIR_ENV: str(run_dir), BACKEND_ENV: backend, "PYTHONUNBUFFERED": "1",
                # Restarts under gloo are unreliable when workers share the agent's store (pytorch#135712).
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault(forensics.FR_BUFFER_ENV, str(forensics.FR_ENTRIES))  # what each rank's collectives were
    if one_host and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every node here: keep gloo's traffic on loopback
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def plan_job(script, *, nproc: int = 2, args=(), backend: str = "auto", timeout: float | None = None,
             name: str | None = None, env: dict | None = None, stall_timeout: float | None = None,
             nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None,
             max_restarts: int = 0) -> JobPlan:
    """Check a launch request (LaunchConfigError, nothing started) and decide the job: `launch`'s arguments."""
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
    script = _check_script(script)
    cpu_only = str({**os.environ, **(env or {})}.get(DEVICE_ENV)) == "cpu"
    backend, device = _placement(backend, nproc, cpu_only)
    run_dir = _writable_run_dir(name or script.stem)
    endpoint = rdzv_endpoint or (f"127.0.0.1:{_free_port()}" if nnodes > 1 else None)
    one_host = not rdzv_endpoint or is_loopback_endpoint(rdzv_endpoint)
    # Hosts of a real multi-host job must agree on the rendezvous id: the run's name, not its folder.
    rdzv_id = slug(name or script.stem) if rdzv_endpoint else run_dir.name
    return JobPlan(script=script, args=tuple(args), run_dir=run_dir, nproc=nproc, nnodes=nnodes,
                   node_rank=node_rank if rdzv_endpoint else 0, backend=backend, device=device.partition(":")[0],
                   rdzv_endpoint=endpoint, multi_host=bool(rdzv_endpoint), one_host=one_host, rdzv_id=rdzv_id,
                   max_restarts=max_restarts, timeout=timeout, stall_timeout=stall_timeout,
                   env=_job_env(run_dir, backend, nproc, one_host, env))


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
        self.started = time.monotonic()

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


@dataclass(frozen=True)
class _Stop:
    """Why the launcher stopped a job itself, and which ranks were still running then."""

    status: str  # 'timeout', 'stalled' or 'interrupted'
    reason: str
    running: list[int]


def launch(script, *, nproc: int = 2, args=(), backend: str = "auto", timeout: float | None = None,
           name: str | None = None, env: dict | None = None, check: bool = True, live=None,
           stall_timeout: float | None = None, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, max_restarts: int = 0,
           cancel: threading.Event | None = None) -> RunResult:
    """Run `script` with `nproc` ranks per node under torchrun and return what it left, as a RunResult.

    backend: 'auto' (NCCL when each rank has a GPU of its own, else gloo), 'gloo', 'nccl' or 'mpi'.
    timeout: stop the job after this many seconds. stall_timeout: stop it when no rank has printed or
    logged anything for this long (before any rank's first word, STARTUP_GRACE_S more, from the last rank's
    start: importing torch on a busy machine is not a stall). check: raise LaunchError (with the root cause)
    unless it succeeded.
    live: how to show it while it runs: None/True (widget in a notebook, text elsewhere), 'text',
    'widget', or False (or a view factory: launch_all's status lines). cancel: stop the job, as interrupted,
    once this event is set (how launch_all stops a batch on Ctrl-C). nnodes > 1 without rdzv_endpoint starts
    that many torchrun agents here, each a "node"; with rdzv_endpoint ("host:port") this process is node
    `node_rank` of a real multi-host job, which meets the other hosts' launches of the same `name` (the
    rendezvous id).
    Security: a job whose nodes all run here keeps its stores on 127.0.0.1 (see agent.py); a multi-host
    job's stores listen on every interface without authentication (the manifest says so under "warnings").
    """
    if not callable(live) and live not in (None, True, False, "auto", "widget", "text", "off"):
        raise LaunchConfigError(f"live must be True, False, 'widget', 'text' or 'off', not {live!r}")
    plan = plan_job(script, nproc=nproc, args=args, backend=backend, timeout=timeout, name=name, env=env,
                    stall_timeout=stall_timeout, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                    max_restarts=max_restarts)
    manifest = _record_plan(plan)
    view = make_view(live, f"{plan.script.name}: {plan.world_size} rank(s), backend {plan.backend}, "
                           f"{plan.device} — {plan.run_dir}", plan.world_size)
    job = _start(plan)
    tailer, stop = RunTailer(plan.run_dir), None
    try:
        stop = _supervise(plan, job, tailer, view, cancel)
    except KeyboardInterrupt:
        stop = _Stop("interrupted", "interrupted (KeyboardInterrupt)", job.running_ranks())
        raise
    finally:
        result = _finish(plan, job, tailer, view, manifest, stop)
    if check and not result.ok:
        raise LaunchError(f"{result.error or result.status} (logs: {plan.run_dir})", result)
    return result


def _record_plan(plan: JobPlan) -> dict:
    """Write the manifest of a job about to start, say its warnings, and return the manifest."""
    manifest = {**plan.record(), "host": socket.gethostname(), "versions": _versions(), "start": time.time(),
                "status": "running", "warnings": [] if plan.one_host else [OPEN_STORE_WARNING]}
    _write_manifest(plan.run_dir, manifest)
    for warning in manifest["warnings"]:
        print(f"gpucourse: warning: {warning}", file=sys.stderr, flush=True)
    return manifest


def _start(plan: JobPlan) -> _Job:
    """Start one agent per node that runs here."""
    agents = []
    for node in plan.local_nodes:
        log = open(agent_log(plan.run_dir, plan.suffix(node)), "wb")
        # A session of its own: Ctrl-C in a terminal reaches us once, and we stop the job in order.
        agents.append(subprocess.Popen(plan.agent_command(node), env=plan.env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True, cwd=os.getcwd()))
        log.close()
    return _Job(agents)


def _supervise(plan: JobPlan, job: _Job, tailer: RunTailer, view, cancel=None) -> _Stop | None:
    """Follow the run until its agents end (None), or until it runs out of time, stalls or is cancelled (why it
    must stop)."""
    last_activity, heard, named = time.monotonic(), False, 0
    while not job.finished():
        if cancel is not None and cancel.is_set():
            return _Stop("interrupted", "interrupted (the batch it ran in was interrupted)", job.running_ranks())
        job.track()
        lines, records = tailer.poll()
        if any(ln.rank is not None for ln in lines) or records:
            last_activity, heard = time.monotonic(), True
        elif not heard and len(job.ranks) > named:  # a rank just started: its start-up grace counts from now
            last_activity, named = time.monotonic(), len(job.ranks)
        view.update(lines, records, "running")
        now = time.monotonic()
        if plan.timeout and now - job.started > plan.timeout:
            return _Stop("timeout", f"timed out after {plan.timeout:g} s", job.running_ranks())
        # Starting torch in every rank can take many seconds on a busy machine: not a stall. Nor is an
        # agent winding down after its ranks ended: its report holds the root cause.
        if (plan.stall_timeout and now - last_activity > plan.stall_timeout + (0 if heard else STARTUP_GRACE_S)
                and not job.all_ranks_ended()):
            return _Stop("stalled", f"stalled: no rank printed or logged for {plan.stall_timeout:g} s",
                         job.running_ranks())
        time.sleep(POLL_S)
    return None


def _finish(plan: JobPlan, job: _Job, tailer: RunTailer, view, manifest: dict, stop: _Stop | None) -> RunResult:
    """Leave no process behind, complete the manifest (status, the devices the ranks reported) and read the run."""
    if stop and stop.status in ("timeout", "stalled") and stop.running and forensics.enabled(plan.env):
        view.update([], [], "collecting each rank's Flight Recorder dump")
        forensics.request_dumps(plan.run_dir, stop.running, stop.status, running=job.running_ranks)
    job.stop() if not job.finished() or stop else job.reap()
    lines, records = tailer.poll(final=True)
    view.update(lines, records, "stopping")
    manifest.update(end=time.time(), duration=round(time.monotonic() - job.started, 3),
                    agent_returncodes=[a.returncode for a in job.agents])
    if stop:
        detail = "\n".join(f"rank {r} was still running; its last line: {tailer.last_line.get(r, '(nothing)')}"
                           for r in stop.running) or "no rank was running any more"
        manifest.update(status=stop.status, stop_detail=detail,
                        stop_reason=f"{stop.reason}; ranks still running: {stop.running or 'none'}")
    else:
        manifest["status"] = "ok" if all(a.returncode == 0 for a in job.agents) else "failed"
    devices = reported_devices(plan.run_dir)
    manifest.update(devices=devices, device=device_kinds(devices) or plan.device)
    _write_manifest(plan.run_dir, manifest)
    result = load_run(plan.run_dir)
    view.finish(result, stop is not None and stop.status == "interrupted")
    return result


def launch_all(jobs: list[dict], *, parallel: int | None = None) -> list[RunResult]:
    """Several launches side by side, each given as launch()'s keyword arguments ({"script": ..., "nproc": 2, ...}),
    their RunResults returned in the same order. They run in threads, `parallel` at a time (default: all), so
    their start-ups overlap. Each shows as one live line (state, seconds, steps, its last printed line), made
    here in the calling cell; outside a notebook each prints one summary line as it ends. Interrupting (Ctrl-C,
    the notebook's stop button) stops every job still running, leaves no process behind and re-raises. A job
    with check=True (the default) that failed raises LaunchError once every job has ended."""
    if not jobs:
        return []
    bad = [i for i, job in enumerate(jobs) if not isinstance(job, dict) or "script" not in job or "live" in job]
    if bad:
        raise LaunchConfigError(f"launch_all: job {bad[0]} must be a dict of launch()'s arguments with a 'script' "
                                "(and no 'live': each job gets its own status line)")
    cancel, lines = threading.Event(), _status_lines(len(jobs))

    def run(i: int) -> RunResult:
        job = {**jobs[i], "check": False}
        view = (lambda header, world: StatusLine(lines[i], header, world)) if lines else "off"
        return launch(**job, live=view, cancel=cancel)

    with ThreadPoolExecutor(parallel or len(jobs)) as pool:
        futures = [pool.submit(run, i) for i in range(len(jobs))]
        try:
            results = [f.result() for f in futures]
        except BaseException:  # KeyboardInterrupt from the notebook: stop them all, wait for their clean-up
            cancel.set()
            wait(futures)
            raise
    if not lines:
        for result in results:
            print(result.summary().splitlines()[0], flush=True)
    for job, result in zip(jobs, results):
        if job.get("check", True) and not result.ok:
            raise LaunchError(f"{result.error or result.status} (logs: {result.run_dir})", result)
    return results


def _status_lines(count: int) -> list:
    """One HTML widget per job, shown now in the calling cell (a notebook), or [] elsewhere."""
    if os.environ.get(LIVE_ENV, "auto") in ("text", "off") or not in_notebook():
        return []
    try:
        import ipywidgets as w
        from IPython.display import display
    except ImportError:
        return []
    lines = [w.HTML() for _ in range(count)]
    display(w.VBox(lines))
    return lines

