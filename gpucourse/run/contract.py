"""Both sides: the contract between the launcher, the agent, the ranks and whoever reads a run back.

The launcher (launcher.py) starts the agent (agent.py), the agent starts the ranks, the ranks write
through the runtime (runtime.py), and the launcher, the live view (tail.py) and RunResult (result.py)
read the same files back, also for runs of earlier sessions. Every name they share lives here, so
that a change to the layout is made in one place.

Environment (set by the launcher for the agent and every rank):
    GPUCOURSE_RUNS_DIR     where runs are written (default: <project>/runs)
    GPUCOURSE_RUN_DIR      this run's directory; every rank of every node writes into it
    GPUCOURSE_BACKEND      'gloo', 'nccl', 'mpi' or 'auto' (the runtime chooses)
    GPUCOURSE_DEVICE       'cpu' forces CPU ranks even where GPUs are present

Run directory:
    manifest.json                       the launcher's plan (command, backend, world size, ...), versions, times,
                                        status, and the devices the ranks reported
    agent[-node<k>].log                 torchrun's own output (one per agent started here)
    exit[-node<k>].json                 the agent's report: see "Exit file" below
    logs/attempt<a>/rank<r>.stdout      rank r's output in restart attempt a (named by *global* rank)
    logs/attempt<a>/rank<r>.stderr
    logs/attempt<a>/rank<r>.error.json  torchrun's error file: the uncaught exception, if any
    metrics/rank<r>.jsonl               one JSON record per line: {"rank", "time", ...} from
                                        runtime.log(); runtime.setup() and runtime.teardown() add
                                        {"event": "setup"} and {"event": "teardown"} (all attempts
                                        append to the same file)
    traces/<name><r>.json               chrome traces from runtime.profile(name=...) (default "rank")
    forensics/fr/rank_<r>               rank r's Flight Recorder dump (pickle, as torch writes it), written when the
                                        launcher asks (forensics/request) or an exception ends the rank (capture.py)
    forensics/stacks/rank<r>.json       rank r's main-thread Python stack at that moment, and why it dumped
    forensics/request                   the launcher's request for dumps, which every rank polls for
    raw/rank<r>/<sub>/<case>.pt         grading jobs only: the tensors a case produced on rank r for submission
                                        number <sub>, saved raw (torch.save of a dict) for the grader to check
The `-node<k>` suffix appears only when one launch starts several agents (nnodes > 1).

Exit file (JSON, written atomically by the agent when torchrun returns):
    status     'ok', 'failed' (some rank exited non-zero) or 'agent_error' (torchrun itself failed)
    root_rank  ('failed' only) the global rank that failed first by itself (root_rank, below)
    failures   one record per failed rank, by rank: rank, local_rank, exitcode (negative: -signal),
               pid, signal (name, or '<N/A>'), timestamp (seconds), message (a string, or
               {"message", "traceback"} when the rank left an error file)
    message    ('agent_error' only) what went wrong
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

ENV_PREFIX = "GPUCOURSE_"
RUNS_ENV = "GPUCOURSE_RUNS_DIR"
RUN_DIR_ENV = "GPUCOURSE_RUN_DIR"
BACKEND_ENV = "GPUCOURSE_BACKEND"
DEVICE_ENV = "GPUCOURSE_DEVICE"
# runtime.setup() makes its process group on this key prefix of the job's store: a grading job's rank forks one
# process per submission, each with a process group of its own, one after the other (grading/jobkit.py).
STORE_PREFIX_ENV = "GPUCOURSE_STORE_PREFIX"
# `gpucourse dryrun` (run/dryrun.py): DRYRUN_ENV=1 makes runtime.setup() join a fake process group (no peers, no
# data moved); COUNT_FILE_ENV, in a dry run or a real one, makes each rank count its steps' collectives, memory
# and FLOPs and write them to that path ("{rank}" in it becomes the rank; a relative path is in the run folder) when
# the script ends.
DRYRUN_ENV = "GPUCOURSE_DRYRUN"
# With DRYRUN_ENV, FAKE_TENSORS_ENV=1 makes every tensor the rank makes after setup() a FakeTensor: shapes, dtypes
# and devices, no storage (run/fake.py's enter_fake_tensors).
FAKE_TENSORS_ENV = "GPUCOURSE_FAKE_TENSORS"
COUNT_FILE_ENV = "GPUCOURSE_COUNT_FILE"
RANK_FIELD = "{rank}"  # in COUNT_FILE_ENV's path: the rank's number

MANIFEST = "manifest.json"
RAW_DIR = "raw"
LOGS_DIR, METRICS_DIR, TRACES_DIR = "logs", "metrics", "traces"
FORENSICS_DIR = "forensics"
FR_PREFIX = "rank_"  # torch's own name for a Flight Recorder dump file: <prefix><rank> (TORCH_FR_DUMP_TEMP_FILE)
STREAMS = ("stdout", "stderr")  # what RunResult.log shows; "error.json" sits beside them
EVENT_SETUP, EVENT_TEARDOWN = "setup", "teardown"  # values of a metrics record's "event" key
RUNTIME_EVENTS = (EVENT_SETUP, EVENT_TEARDOWN)  # written by the runtime, not by the script

_ATTEMPT = re.compile(r"attempt(\d+)")
_RANK_FILE = re.compile(r"rank(\d+)\.(.+)")


def node_suffix(node: int) -> str:
    """'-node<k>': tells apart the files of the agents that one launch starts (nnodes > 1)."""
    return f"-node{node}"


def manifest_file(run_dir: Path) -> Path:
    return Path(run_dir) / MANIFEST


def agent_log(run_dir: Path, suffix: str = "") -> Path:
    return Path(run_dir) / f"agent{suffix}.log"


def agent_logs(run_dir: Path) -> list[Path]:
    return sorted(Path(run_dir).glob("agent*.log"))


def exit_file(run_dir: Path, suffix: str = "") -> Path:
    return Path(run_dir) / f"exit{suffix}.json"


def exit_files(run_dir: Path) -> list[Path]:
    return sorted(Path(run_dir).glob("exit*.json"))


# Who failed first: how an exit file's failure records are read.
PEER_REPORTS = ("remote worker", "Connection closed by peer", "Connection reset by peer", "Broken pipe")
# How torchrun stops the ranks still running once one has failed (SIGTERM, then SIGKILL after its grace
# period), and what it forwards when it is stopped itself. A rank ended by one of these did not fail, except a
# SIGKILL that came first: nothing was being stopped yet, so it was killed from outside (the kernel's OOM killer, a
# machine that dies, a script that kills itself as chapter 08b's crash does). See `stopped`.
STOP_SIGNALS = ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP")


OWN, PEER, STOPPED = "failed on its own", "reported a peer's failure", "stopped by torchrun"


def signal_name(exitcode: int | None) -> str:
    """The signal that ended a rank ('SIGKILL' for exit code -9: below zero, an exit code is minus the signal, as
    torchrun and subprocess report it); '' when no signal did."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


# torchrun's SIGTERM grace period: PContext.close sends SIGKILL only to the ranks still alive this long after its
# SIGTERM (LocalElasticAgent._shutdown's timeout; tests/unit/run/test_contract.py holds it to torch's).
TORCHRUN_KILL_AFTER_S = 30


def stopped(exitcode: int | None, ended: float | None = None, first_other: float | None = None) -> bool:
    """The one rule for "this rank did not fail by itself, it was stopped" (torchrun, or the launcher), shared by
    the launcher's blame (failure_kind, root_rank) and forensics' reader (diagnose).

    A stop signal (STOP_SIGNALS) stops, except SIGKILL: torchrun sends it only to the ranks that outlived its
    SIGTERM by TORCHRUN_KILL_AFTER_S, so that long after another rank's failure (`ended`, `first_other`:
    torchrun's timestamps, whole seconds, hence the second's margin). A SIGKILL sooner than that, or one without
    the timestamps to tell, is the rank's own end: killed from outside (the OOM killer, a script that kills itself).
    Judged by the gap, not the order: a rank killed from outside is stamped when torchrun notices, its peers with
    the moment they raised, so under load its stamp can come a second after theirs. An exit code (1, 3, ...) or
    another signal (SIGABRT, SIGSEGV) is its own."""
    name = signal_name(exitcode)
    if name == "SIGKILL":
        return ended is not None and first_other is not None and ended - first_other >= TORCHRUN_KILL_AFTER_S - 1
    return name in STOP_SIGNALS


def failed_by_itself(exitcode: int | None, rank: int | None = None, failures: list[dict] = ()) -> bool:
    """Whether a rank that ended with `exitcode` failed by itself: it ended non-zero and was not `stopped`. `failures`,
    the run's exit-file records where known (exit_failures), tell when it and the others ended."""
    if exitcode in (None, 0):
        return False
    mine = next((f for f in failures if f["rank"] == rank), None)
    first_other = min((f["timestamp"] for f in failures if f["rank"] != rank), default=None)
    return not stopped(exitcode, mine["timestamp"] if mine else None, first_other)


def failure_kind(failure: dict, failures: list[dict] = ()) -> str:
    """How a rank of an exit file's failure records ended: stopped by torchrun (`stopped`; `failures`, the run's
    records, say whether a SIGKILL came after another rank's failure), reporting a peer's failure (its message is
    gloo's "Connection closed by peer", ...), or failed on its own (anything else: an exception, a crash signal, a
    non-zero exit code)."""
    if not failed_by_itself(failure["exitcode"], failure["rank"], failures):
        return STOPPED
    return PEER if any(text in json.dumps(failure["message"]) for text in PEER_REPORTS) else OWN


def blame_key(failure: dict, failures: list[dict] = ()) -> tuple:
    """Sort key of an exit file's failure records (`failures`: all of the run's): the first one is the root cause
    (see root_rank)."""
    kind = failure_kind(failure, failures)
    return (kind == STOPPED, kind == PEER, failure["timestamp"], not isinstance(failure["message"], dict),
            failure["rank"])


def root_rank(failures: list[dict]) -> int:
    """The rank that failed first *by itself*, from the exit file's failure records.

    torchrun orders by timestamps of one-second resolution, so ties are common, and a rank that
    aborts (SIGABRT) or crashes (SIGSEGV) ties with the innocent ranks torchrun then SIGTERMs. So:
    first the ranks that failed on their own (an exception, a crash signal, a non-zero exit code, a SIGKILL
    that came first), then those that only report a peer's death (gloo: "typically caused by a remote worker
    crashing"), then those torchrun stopped; within each, the earliest, one with a traceback, the
    lowest rank.
    """
    return min(failures, key=lambda f: blame_key(f, failures))["rank"]


def exit_failures(run_dir: Path) -> list[dict]:
    """Every failure record of a run's exit files (those of status 'failed'), all agents together."""
    out = []
    for path in exit_files(run_dir):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("status") == "failed":
            out.extend(record.get("failures", []))
    return out


def logs_dir(run_dir: Path) -> Path:
    """The folder given to torchrun as --log-dir."""
    return Path(run_dir) / LOGS_DIR


def attempt_dir(log_dir: Path, attempt: int | str) -> Path:
    """`<log_dir>/attempt<a>`: one folder per restart attempt (log_dir is torchrun's --log-dir)."""
    return Path(log_dir) / f"attempt{attempt}"


def rank_file(folder: Path, rank: int | str, kind: str) -> Path:
    """`<folder>/rank<r>.<kind>`, kind 'stdout', 'stderr', 'error.json' or 'jsonl'."""
    return Path(folder) / f"rank{rank}.{kind}"


def rank_of_file(path: Path) -> tuple[int, str] | None:
    """(rank, kind) of a `rank<r>.<kind>` file name; None for any other name."""
    m = _RANK_FILE.fullmatch(Path(path).name)
    return (int(m.group(1)), m.group(2)) if m else None


def attempts(run_dir: Path) -> list[int]:
    """The restart attempts that left a log folder, in order."""
    found = (_ATTEMPT.fullmatch(p.name) for p in logs_dir(run_dir).glob("attempt*"))
    return sorted(int(m.group(1)) for m in found if m)


def latest_attempt(run_dir: Path) -> int | None:
    found = attempts(run_dir)
    return found[-1] if found else None


def rank_log(run_dir: Path, attempt: int | None, rank: int, stream: str) -> Path:
    """`logs/attempt<a>/rank<r>.<stream>`; attempt None: the latest attempt (0 before any started)."""
    if attempt is None:
        attempt = latest_attempt(run_dir) or 0
    return rank_file(attempt_dir(logs_dir(run_dir), attempt), rank, stream)


def metrics_file(run_dir: Path, rank: int) -> Path:
    return rank_file(Path(run_dir) / METRICS_DIR, rank, "jsonl")


def metrics_files(run_dir: Path) -> dict[int, Path]:
    """Every rank's metrics file, by rank."""
    found = {}
    for path in (Path(run_dir) / METRICS_DIR).glob("rank*.jsonl"):
        parsed = rank_of_file(path)
        if parsed and parsed[1] == "jsonl":
            found[parsed[0]] = path
    return dict(sorted(found.items()))


def raw_file(run_dir: Path, rank: int, case: str, sub: int = 0) -> Path:
    """Where a grading job saves one case's raw results on one rank for its submission number `sub`."""
    if not re.fullmatch(r"[\w.+=-]+", case):
        raise ValueError(f"case name {case!r} cannot be a file name: use letters, digits and . + = - _")
    return Path(run_dir) / RAW_DIR / f"rank{rank}" / str(int(sub)) / f"{case}.pt"


def forensics_dir(run_dir: Path) -> Path:
    return Path(run_dir) / FORENSICS_DIR


def fr_file(run_dir: Path, rank: int) -> Path:
    return forensics_dir(run_dir) / "fr" / f"{FR_PREFIX}{rank}"


def stack_file(run_dir: Path, rank: int) -> Path:
    return rank_file(forensics_dir(run_dir) / "stacks", rank, "json")


def request_file(run_dir: Path) -> Path:
    return forensics_dir(run_dir) / "request"


def count_file(template: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its counts: COUNT_FILE_ENV's path, RANK_FIELD in it replaced by the rank."""
    return Path(str(template).replace(RANK_FIELD, str(rank)))


def traces_dir(run_dir: Path) -> Path:
    return Path(run_dir) / TRACES_DIR


def trace_file(run_dir: Path, name: str, rank: int) -> Path:
    return traces_dir(run_dir) / f"{name}{rank}.json"
