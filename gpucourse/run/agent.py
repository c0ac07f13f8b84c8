"""In the agent's process, the one the launcher starts: torchrun's own agent, run in-process, made leak-proof.

    python -m gpucourse.run.agent EXIT_FILE -- <torchrun options> SCRIPT -- <script arguments>

is `torchrun <torchrun options> SCRIPT <script arguments>` (same parser, same elastic agent, same
rendezvous), plus:
- it becomes a *child subreaper*, so workers orphaned by a crashing agent are re-parented here and
  can still be found and killed (torchrun starts workers in sessions of their own);
- it stops the job when its own parent (the notebook kernel, the shell) dies, even by SIGKILL;
- after the job, it kills anything still alive below it (torchrun can exit without escalating to
  SIGKILL when a second signal arrives during its graceful shutdown);
- the script's arguments are kept from torchrun's parser, which would take some for its own options
  (`--nproc` after the script, for `--nproc-per-node`);
- it writes EXIT_FILE (JSON): every failed rank's exit code, and the root cause as torchrun saw it;
- before torchrun stops the ranks (one failed, a restart, a stop), each one still alive writes its Flight
  Recorder dump and stack into the run directory (run/capture.py);
- with `--logs-specs gpucourse --log-dir DIR`, workers log to `DIR/attempt<k>/rank<r>.{stdout,stderr}`,
  named by *global* rank (the run directory's layout and EXIT_FILE's format: contract.py);
- when every node is on this machine (`--standalone`, or a loopback rendezvous endpoint), no store of
  the job listens beyond 127.0.0.1 (see `_bind_stores_to_loopback`); otherwise it says, once, that the
  stores listen on every interface without authentication.
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import psutil

from .contract import RUN_DIR_ENV, attempt_dir, rank_file, root_rank
from .procs import alive, descendants, terminate

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
GRACE_S = 3.0
OPEN_STORE_WARNING = ("the rendezvous store (and rank 0's store) listen on every network interface, without "
                      "authentication: anyone who can reach them can join or disrupt the job. Keep the cluster "
                      "network private (firewall the ports, or a private network between the hosts).")


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
        pass


def _stop_when_orphaned(parent: int) -> None:
    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        terminate(descendants(os.getpid()), GRACE_S)
        os._exit(143)

    threading.Thread(target=watch, name="gpucourse-agent-watchdog", daemon=True).start()


def _rank_logs_specs():
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest

    class RankLogs(DefaultLogsSpecs):
        """One stdout/stderr/error file per rank, named by global rank, one folder per restart attempt."""

        def reify(self, envs):
            attempt = next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0")
            folder = attempt_dir(self.root_log_dir, attempt)
            folder.mkdir(parents=True, exist_ok=True)
            dest = LogsDest()
            for local_rank, env in envs.items():
                out, err, error = (str(rank_file(folder, env["RANK"], k)) for k in ("stdout", "stderr", "error.json"))
                dest.stdouts[local_rank], dest.stderrs[local_rank] = out, err
                dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = error
            return dest

    return RankLogs


def _tolerate_torn_error_files() -> None:
    """Read a rank's unreadable error file as no error file, instead of letting torchrun itself crash.

    A rank writes its error file while it dies of an exception, and torchrun SIGTERMs every rank still
    running as soon as one has failed. A rank stopped between opening that file and finishing it leaves
    it empty or cut short; torchrun then reads it for its records of the stopped ranks (after close())
    and raises JSONDecodeError, losing the real root cause ("torchrun could not run the job"). A torn
    file only ever belongs to a rank that was stopped, so treating it as absent loses nothing.
    """
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    original = ProcessFailure.__post_init__

    def post_init(self):
        try:
            json.loads(Path(self.error_file).read_text())
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            self.error_file = TORN_ERROR_FILE
        original(self)

    ProcessFailure.__post_init__ = post_init


TORN_ERROR_FILE = "<torn error file>"  # no such file: torchrun then records the rank as having written none


def _failure_record(rank: int, failure) -> dict:
    message = failure.message
    if isinstance(message, dict):
        info = message.get("extraInfo", {})
        message = {"message": message.get("message", ""), "traceback": info.get("py_callstack", "")}
    return {"rank": rank, "local_rank": failure.local_rank, "exitcode": failure.exitcode, "pid": failure.pid,
            "signal": failure.signal_name(), "timestamp": failure.timestamp, "message": message}


def _endpoint_host(endpoint: str) -> str:
    endpoint = endpoint.strip()
    if endpoint.startswith("["):  # [::1]:29400
        return endpoint[1:endpoint.find("]")]
    return endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 else endpoint  # host:port, host, or ::1


def is_loopback_endpoint(endpoint: str | None) -> bool:
    """True when a rendezvous endpoint `host[:port]` is literally loopback (localhost, 127.x, ::1).

    Then every node of the job runs on this machine.
    Host names are not resolved: Debian maps a machine's own name to 127.0.1.1, yet other hosts reach
    that name over the network, so a name must keep torch's default (listen on every interface).
    """
    host = _endpoint_host(endpoint or "")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_listener(port: int = 0) -> tuple[int, int]:
    """(port, fd) of a socket bound to 127.0.0.1: a TCPStore given it as master_listen_fd listens there only.

    Raises OSError when the port is taken.
    """
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock.getsockname()[1], sock.detach()


def _bind_stores_to_loopback() -> None:
    """Make both TCP stores of a single-machine job listen on 127.0.0.1 only.

    torch's TCPStore server binds every interface; its only way to choose the address is
    `master_listen_fd`, a socket we bind ourselves. Two stores are made on the agent side:
    - the rendezvous store, made by the c10d backend's `_create_tcp_store` (node 0's agent hosts it);
    - the workers' store (MASTER_ADDR:MASTER_PORT). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0's
      worker would host it itself, in a process we cannot reach into, so the agent of node 0 hosts a
      fresh one per rendezvous round (`RendezvousStoreInfo.build`: fresh, so no key of an earlier attempt
      survives a restart, pytorch#135712) and workers join it as clients (`use_agent_store`).
    """
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import api, dynamic_rendezvous
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    def rendezvous_store(params):
        host, port = parse_rendezvous_endpoint(params.endpoint, default_port=c10d.DEFAULT_PORT)
        timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
        try:
            port, fd = _loopback_listener(port)
        except OSError:  # another agent on this machine hosts it: join as a client
            return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
        return TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timeout, master_listen_fd=fd)

    workers_store = {}  # the current round's store, kept alive here; replacing it closes the previous one

    def build(rank, store, local_addr, server_port=None):
        if rank == 0:
            port, fd = _loopback_listener()
            workers_store["current"] = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                                                master_listen_fd=fd)
            store.set(api.RendezvousStoreInfo.MASTER_ADDR_KEY, b"127.0.0.1")
            store.set(api.RendezvousStoreInfo.MASTER_PORT_KEY, str(port).encode())
        addr = store.get(api.RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
        return api.RendezvousStoreInfo(addr, int(store.get(api.RendezvousStoreInfo.MASTER_PORT_KEY).decode()))

    c10d._create_tcp_store = rendezvous_store
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # torch's own shared store would bind everything
    api.RendezvousStoreInfo.build = staticmethod(build)
    dynamic_rendezvous.DynamicRendezvousHandler.use_agent_store = property(lambda self: True)


def _dump_before_stopping_workers() -> None:
    """torchrun stops every worker the moment it sees one fail (PContext.close, from its poll): first, each one still
    alive writes its Flight Recorder dump and stack (run/capture.py), the evidence of which collective the job
    was in. Also before a restart, and when the launcher stops the job (it has asked already: they answer again)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    from . import forensics

    close = PContext.close

    def close_after_dumps(self, *args, **kwargs):
        run_dir = os.environ.get(RUN_DIR_ENV)
        if run_dir and forensics.enabled():
            procs = {}
            for local_rank, pid in self.pids().items():
                with contextlib.suppress(psutil.Error, KeyError, ValueError):  # gone already
                    procs[int(self.envs[local_rank]["RANK"])] = psutil.Process(pid)

            def running() -> list[int]:
                return [rank for rank, proc in procs.items() if alive([proc])]

            if running():
                forensics.request_dumps(Path(run_dir), running(), "torchrun stops the ranks", running=running)
        return close(self, *args, **kwargs)

    PContext.close = close_after_dumps


def main(argv: list[str]) -> int:
    exit_file, rest = Path(argv[0]), argv[argv.index("--") + 1:]
    torchrun_args, script_args = rest[:rest.index("--")], rest[rest.index("--") + 1:]
    parent = os.getppid()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before we could watch it
        return 143
    _stop_when_orphaned(parent)

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _tolerate_torn_error_files()
    _dump_before_stopping_workers()
    args = torchrun.parse_args(torchrun_args)
    if args.standalone or (args.rdzv_backend == "c10d" and is_loopback_endpoint(args.rdzv_endpoint)):
        _bind_stores_to_loopback()
    else:
        print(f"gpucourse agent: warning: {OPEN_STORE_WARNING}", file=sys.stderr, flush=True)
    args.training_script_args = script_args
    default_specs = torchrun._get_logs_specs_class
    torchrun._get_logs_specs_class = lambda name: _rank_logs_specs() if name == "gpucourse" else default_specs(name)
    record, code = {"status": "ok", "failures": []}, 0
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        failures = [_failure_record(r, f) for r, f in sorted(err.failures.items())]
        record = {"status": "failed", "root_rank": root_rank(failures), "failures": failures}
        code = 1
    except BaseException as err:  # SignalException, rendezvous errors, bad torchrun arguments
        record = {"status": "agent_error", "failures": [], "message": f"{type(err).__name__}: {err}"}
        code = getattr(err, "sigval", None) and 128 + int(err.sigval) or 1
        print(f"gpucourse agent: {type(err).__name__}: {err}", file=sys.stderr)
    finally:
        terminate(descendants(os.getpid()), GRACE_S)
        tmp = exit_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(exit_file)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
