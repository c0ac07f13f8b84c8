"""In the launcher's process (or any reader, later): what a run left on disk, read back, `RunResult` (also for runs of
earlier sessions).

A run directory holds (contract.py has the names and the formats):
    manifest.json                    command, backend, world size, versions, times, status, exit codes
    agent[-node<k>].log              torchrun's own output
    exit[-node<k>].json              per failed rank: exit code, signal, error message (gpucourse.run.agent)
    logs/attempt<a>/rank<r>.stdout   each rank's output (and .stderr, .error.json)
    metrics/rank<r>.jsonl            what the script recorded with runtime.log()
    traces/rank<r>.json              chrome traces written by runtime.profile()
    forensics/fr/rank_<r>            Flight Recorder dumps of a stalled or failed run (run/forensics.py)
"""
from __future__ import annotations

import html
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .contract import (EVENT_SETUP, EVENT_TEARDOWN, MANIFEST, RUNTIME_EVENTS, STOPPED, STREAMS, blame_key,
                       exit_failures, exit_files, failure_kind, manifest_file, metrics_files, rank_log, root_rank,
                       traces_dir)
from .forensics import KINDS, diagnose, forensics_dir
from .paths import project_root, runs_root

STATUS_TEXT = {"ok": "finished", "failed": "failed", "timeout": "timed out", "stalled": "stalled",
               "interrupted": "interrupted", "running": "running", "unknown": "unknown"}


@dataclass
class RootCause:
    """Why a run did not finish: the first failing rank and what it raised, or why the launcher stopped it.

    after_work_finished: every rank had written its teardown record before `rank` failed (typically
    gloo aborting at interpreter exit), so the run's results on disk are complete.
    """

    summary: str
    rank: int | None = None
    exitcode: int | None = None
    exception: str = ""
    traceback: str = ""
    signal: str = ""
    after_work_finished: bool = False

    def __str__(self) -> str:
        return self.summary + (f"\n\n{self.traceback.rstrip()}" if self.traceback else "")


def last_traceback(text: str) -> str:
    """The last Python traceback in a log, up to its final exception line."""
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return ""
    lines = text[start:].splitlines()
    end = len(lines)
    for i in range(1, len(lines)):  # the exception line is the first unindented line after the frames
        if lines[i] and not lines[i].startswith((" ", "\t")):
            end = i + 1
            break
    return "\n".join(lines[:end])


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _records(path: Path) -> list[dict]:
    """The records of one metrics file (a rank killed mid-write leaves half a line: skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def _work_finished(run_dir: Path, world_size: int) -> bool:
    """True when every rank of the last attempt wrote its teardown record (runtime.teardown).

    All attempts append to one metrics file per rank: a rank finished when its last setup record is
    followed by a teardown record.
    """
    files = metrics_files(run_dir)
    if world_size < 1 or not set(range(world_size)) <= set(files):
        return False
    for rank in range(world_size):
        events = [rec["event"] for rec in _records(files[rank]) if rec.get("event") in RUNTIME_EVENTS]
        if not events or events[-1] != EVENT_TEARDOWN:
            return False
    return True


def reported_devices(run_dir: Path) -> dict[int, str]:
    """The device each rank said it computes on ('cpu', 'cuda:0', ...), by rank: its last runtime.setup record."""
    out = {}
    for rank, path in metrics_files(run_dir).items():
        setups = [rec for rec in _records(path) if rec.get("event") == EVENT_SETUP and "device" in rec]
        if setups:
            out[rank] = str(setups[-1]["device"])
    return out


def device_kinds(devices: dict[int, str]) -> str:
    """'cpu', 'cuda', or 'cpu+cuda' when ranks differ; '' when no rank reported."""
    return "+".join(sorted({d.partition(":")[0] for d in devices.values()}))


@dataclass(frozen=True)
class RankEnd:
    """How one failed rank ended, as its agent recorded it (the exit file): what the launcher's root cause is
    chosen from (contract.root_rank).

    kind: contract.OWN, PEER or STOPPED (contract.failure_kind). second: when torchrun saw it fail, in whole
    seconds (torchrun's resolution) after the first failure of the run. message: the last line of what it raised.
    """

    rank: int
    exitcode: int
    signal: str
    second: int
    kind: str
    message: str
    root_cause: bool


@dataclass
class RunResult:
    run_dir: Path
    status: str
    returncodes: dict[int, int | None]
    duration: float | None
    world_size: int
    error: RootCause | None = None
    manifest: dict = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def name(self) -> str:
        return self.run_dir.name

    # --- what the ranks wrote ------------------------------------------------------------------
    def log_path(self, rank: int, stream: str = "stdout", attempt: int | None = None) -> Path:
        return rank_log(self.run_dir, attempt, rank, stream)

    def log(self, rank: int = 0, stream: str = "stdout", attempt: int | None = None) -> str:
        """What `rank` printed (stream: 'stdout' or 'stderr'; latest restart attempt unless given)."""
        if stream not in STREAMS:
            raise ValueError(f"stream must be 'stdout' or 'stderr', not {stream!r}")
        if not 0 <= rank < max(self.world_size, 1):
            raise ValueError(f"rank {rank} is not in this run (world size {self.world_size})")
        path = self.log_path(rank, stream, attempt)
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def metrics(self) -> dict[int, list[dict]]:
        """Records each rank wrote with `runtime.log`, by rank (the runtime's setup/teardown records left out)."""
        out: dict[int, list[dict]] = {r: [] for r in range(self.world_size)}
        for rank, path in metrics_files(self.run_dir).items():
            out.setdefault(rank, []).extend(rec for rec in _records(path) if rec.get("event") not in RUNTIME_EVENTS)
        return out

    @property
    def devices(self) -> dict[int, str]:
        """The device each rank computed on, as it reported it (runtime.setup), by rank."""
        return reported_devices(self.run_dir)

    @property
    def device(self) -> str:
        """Where the ranks computed ('cpu', 'cuda', 'cpu+cuda'), as they reported it. No rank reported (a crash
        before runtime.setup, or a script without it): the launcher's guess, marked as such."""
        return device_kinds(self.devices) or f"device not reported (planned {self.manifest.get('device', '?')})"

    @property
    def failures(self) -> list[RankEnd]:
        """Every rank that failed, by rank, with how it ended and whether the launcher names it the root cause
        (empty for a run that finished, or one the launcher stopped itself)."""
        records = exit_failures(self.run_dir)
        if not records:
            return []
        root, first = root_rank(records), min(f["timestamp"] for f in records)
        out = []
        for f in sorted(records, key=lambda f: f["rank"]):
            msg = f["message"]
            text = msg.get("message", "") if isinstance(msg, dict) else str(msg or "")
            signal = f.get("signal") if f.get("signal") not in (None, "<N/A>") else ""
            out.append(RankEnd(f["rank"], f["exitcode"], signal, int(f["timestamp"] - first), failure_kind(f, records),
                               _last_line(text), f["rank"] == root))
        return out

    @property
    def command(self) -> str:
        """The torchrun command a person would type for this job, from the course's folder: what the launcher ran,
        less its own options (per-rank log files, no restarts) and its agent. The manifest keeps the exact one."""
        m = self.manifest
        script = Path(m.get("script", "?"))
        root = project_root()
        if root and script.is_relative_to(root):
            script = script.relative_to(root)
        if m.get("nnodes", 1) > 1:
            nodes = ["--nnodes", str(m["nnodes"]), "--node-rank", str(m.get("node_rank", 0)), "--rdzv-backend",
                     "c10d", "--rdzv-endpoint", str(m.get("rdzv_endpoint")), "--rdzv-id", str(m.get("rdzv_id"))]
        else:
            nodes = ["--standalone"]
        restarts = ["--max-restarts", str(m["max_restarts"])] if m.get("max_restarts") else []
        return shlex.join(["torchrun", *nodes, "--nproc-per-node", str(m.get("nproc_per_node", self.world_size)),
                           *restarts, str(script), *m.get("args", [])])

    def metric(self, key: str, rank: int = 0) -> list:
        """The values of one metric logged by `rank`, in order."""
        return [rec[key] for rec in self.metrics.get(rank, []) if key in rec]

    @property
    def traces(self) -> dict[int, Path]:
        """Chrome traces written by `runtime.profile()` (default name), by rank."""
        return self.traces_named("rank")

    def traces_named(self, name: str) -> dict[int, Path]:
        """Traces written by `runtime.profile(name=...)`: `traces/<name><rank>.json`, by rank."""
        out = {}
        for path in traces_dir(self.run_dir).glob(f"{name}*.json"):
            m = re.fullmatch(re.escape(name) + r"(\d+)", path.stem)
            if m:
                out[int(m.group(1))] = path
        return dict(sorted(out.items()))

    def diagnosis(self):
        """What the ranks' Flight Recorder dumps point to (run/forensics.py): the rank(s), the collective, the kind of
        fault. None when the run finished, or when it stopped without the launcher asking for dumps."""
        if self.ok or not forensics_dir(self.run_dir).is_dir():
            return None
        return diagnose(self.run_dir, self.world_size, self.returncodes)

    # --- display ---------------------------------------------------------------------------------
    def summary(self) -> str:
        m = self.manifest
        dur = f"{self.duration:.1f} s" if self.duration is not None else "?"
        status = STATUS_TEXT.get(self.status, self.status)
        if self.error and self.error.after_work_finished:  # the process failed, the work did not
            status += " at exit, after every rank had finished its work,"
        head = (f"{self.name}: {status} in {dur} — "
                f"{self.world_size} rank(s), backend {m.get('backend', '?')}, device {self.device}")
        codes = ", ".join(f"{r}:{'?' if c is None else c}" for r, c in sorted(self.returncodes.items()))
        lines = [head, f"exit codes by rank: {codes}", f"run directory: {self.run_dir}"]
        if self.error:
            lines.insert(1, f"root cause: {self.error.summary}")
        found = self.diagnosis()
        if found is not None and found.kind in KINDS:
            lines.insert(2, f"flight recorder: {str(found).splitlines()[0]} (gpucourse diagnose {self.run_dir})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        done = bool(self.error and self.error.after_work_finished)  # failed, but the results are complete
        colour = "#2e7d32" if self.ok else "#ef6c00" if done else "#c62828"
        rows = "".join(f"<tr><td>rank {r}</td><td>{'?' if c is None else c}</td></tr>"
                       for r, c in sorted(self.returncodes.items()))
        err = f"<pre style='color:{colour}'>{html.escape(str(self.error))}</pre>" if self.error else ""
        if done:
            err += "<p><b>The results on disk are complete:</b> every rank finished its work before the failure.</p>"
        return (f"<div><b style='color:{colour}'>{html.escape(self.summary().splitlines()[0])}</b>{err}"
                f"<table><tr><th>rank</th><th>exit code</th></tr>{rows}</table>"
                f"<code>{html.escape(str(self.run_dir))}</code></div>")


def _after_work(rank: int, code: int, signal: str, exception: str, reason: str, stopped: bool) -> str:
    """The summary of a failure that came after every rank had finished its work."""
    tail = "after every rank had finished its work; the results on disk are complete"
    if exception:  # a Python exception after runtime.teardown()
        return f"rank {rank} failed (exit code {code}) {tail}: {exception}"
    if signal:
        how = "aborted" if signal == "SIGABRT" else "was stopped" if stopped else "crashed"
        detail = f"{signal}: {reason}" if reason else signal
    else:
        how, detail = f"exited with code {code}", reason
    return f"rank {rank} {how} at interpreter exit" + (f" ({detail})" if detail else "") + f" {tail}"


def _root_cause_from_exit(run_dir: Path, exits: list[dict], world_size: int) -> RootCause | None:
    failed = [e for e in exits if e.get("status") == "failed"]
    if failed:
        # Each agent (one per node started here) names its own root rank: the same order picks among them.
        records = [f for e in failed for f in e["failures"]]
        failure = min((next(f for f in e["failures"] if f["rank"] == e["root_rank"]) for e in failed),
                      key=lambda f: blame_key(f, records))
        rank, code, msg = failure["rank"], failure["exitcode"], failure["message"]
        signal = failure.get("signal") if failure.get("signal") not in (None, "<N/A>") else ""
        stderr_path = rank_log(run_dir, None, rank, "stderr")
        stderr = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
        reason = _last_line(stderr)  # for a crash, often the only word: "terminate called ...", "Segmentation fault"
        tb = msg.get("traceback", "") if isinstance(msg, dict) else ""
        if not tb:
            tb = last_traceback(stderr)
        if _work_finished(run_dir, world_size):
            exception = msg.get("message", "") if isinstance(msg, dict) else ""
            summary = _after_work(rank, code, signal, exception, reason, failure_kind(failure, records) == STOPPED)
            return RootCause(summary, rank, code, exception or reason, tb if exception else "", signal, True)
        exception = (msg.get("message") if isinstance(msg, dict) else "") or (tb.splitlines()[-1] if tb else "")
        if not exception:
            exception = f"killed by {signal}" if signal else "no traceback was written"
            exception += f"; its last stderr line: {reason}" if reason else ""
        summary = f"rank {rank} failed (exit code {code}): {exception}"
        return RootCause(summary, rank, code, exception, tb, signal)
    broken = [e for e in exits if e.get("status") == "agent_error"]
    if broken:
        return RootCause(f"torchrun could not run the job: {broken[0].get('message', '')}",
                         exception=broken[0].get("message", ""))
    return None


def load_run(run_dir: str | Path) -> RunResult:
    """Read a run directory back into a RunResult."""
    run_dir = Path(run_dir).resolve()
    manifest = _read_json(manifest_file(run_dir))
    if manifest is None:
        raise FileNotFoundError(f"{run_dir} is not a gpucourse run directory (no readable manifest.json)")
    world = int(manifest.get("world_size", 0))
    exits = [e for p in exit_files(run_dir) if (e := _read_json(p))]
    status = manifest.get("status", "running")
    error = None
    if manifest.get("stop_reason"):
        error = RootCause(manifest["stop_reason"], traceback=manifest.get("stop_detail", ""))
    elif status == "failed":
        error = _root_cause_from_exit(run_dir, exits, world)
    codes: dict[int, int | None] = {r: (0 if status == "ok" else None) for r in range(world)}
    for e in exits:
        for f in e.get("failures", []):
            codes[f["rank"]] = f["exitcode"]
    return RunResult(run_dir, status, codes, manifest.get("duration"), world, error, manifest)


def list_runs(root: str | Path | None = None) -> list[RunResult]:
    """Every run under the runs directory, oldest first (unreadable folders skipped)."""
    root = Path(root) if root else runs_root()
    out = []
    for path in sorted(root.glob(f"*/{MANIFEST}")):
        try:
            out.append(load_run(path.parent))
        except (FileNotFoundError, ValueError, KeyError):
            continue
    return sorted(out, key=lambda r: r.manifest.get("start", 0))
