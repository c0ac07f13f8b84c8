"""What a run left on disk, read back: `RunResult` (also for runs of earlier sessions).

A run directory holds:
    manifest.json                    command, backend, world size, versions, times, status, exit codes
    agent[-node<k>].log              torchrun's own output
    exit[-node<k>].json              per failed rank: exit code, signal, error message (gpucourse.agent)
    logs/attempt<a>/rank<r>.stdout   each rank's output (and .stderr, .error.json)
    metrics/rank<r>.jsonl            what the script recorded with runtime.log()
    traces/rank<r>.json              chrome traces written by runtime.profile()
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .paths import runs_root

STATUS_TEXT = {"ok": "finished", "failed": "failed", "timeout": "timed out", "stalled": "stalled",
               "interrupted": "interrupted", "running": "running", "unknown": "unknown"}


@dataclass
class RootCause:
    """Why a run did not finish: the first failing rank and what it raised, or why the launcher stopped it."""

    summary: str
    rank: int | None = None
    exitcode: int | None = None
    exception: str = ""
    traceback: str = ""

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
        attempts = sorted((self.run_dir / "logs").glob("attempt*"), key=lambda p: int(p.name[7:]))
        folder = (self.run_dir / "logs" / f"attempt{attempt}") if attempt is not None else (
            attempts[-1] if attempts else self.run_dir / "logs" / "attempt0")
        return folder / f"rank{rank}.{stream}"

    def log(self, rank: int = 0, stream: str = "stdout", attempt: int | None = None) -> str:
        """What `rank` printed (stream: 'stdout' or 'stderr'; latest restart attempt unless given)."""
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"stream must be 'stdout' or 'stderr', not {stream!r}")
        if not 0 <= rank < max(self.world_size, 1):
            raise ValueError(f"rank {rank} is not in this run (world size {self.world_size})")
        path = self.log_path(rank, stream, attempt)
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def metrics(self) -> dict[int, list[dict]]:
        """Records each rank wrote with `runtime.log`, by rank (setup records left out)."""
        out: dict[int, list[dict]] = {r: [] for r in range(self.world_size)}
        for path in sorted((self.run_dir / "metrics").glob("rank*.jsonl")):
            rank = int(path.stem[4:])
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:  # a rank killed mid-write leaves half a line
                    continue
                if rec.get("event") != "setup":
                    out.setdefault(rank, []).append(rec)
        return out

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
        for path in (self.run_dir / "traces").glob(f"{name}*.json"):
            m = re.fullmatch(re.escape(name) + r"(\d+)", path.stem)
            if m:
                out[int(m.group(1))] = path
        return dict(sorted(out.items()))

    # --- display ---------------------------------------------------------------------------------
    def summary(self) -> str:
        m = self.manifest
        dur = f"{self.duration:.1f} s" if self.duration is not None else "?"
        head = (f"{self.name}: {STATUS_TEXT.get(self.status, self.status)} in {dur} — "
                f"{self.world_size} rank(s), backend {m.get('backend', '?')}, device {m.get('device', '?')}")
        codes = ", ".join(f"{r}:{'?' if c is None else c}" for r, c in sorted(self.returncodes.items()))
        lines = [head, f"exit codes by rank: {codes}", f"run directory: {self.run_dir}"]
        if self.error:
            lines.insert(1, f"root cause: {self.error.summary}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.ok else "#c62828"
        rows = "".join(f"<tr><td>rank {r}</td><td>{'?' if c is None else c}</td></tr>"
                       for r, c in sorted(self.returncodes.items()))
        err = f"<pre style='color:{colour}'>{html.escape(str(self.error))}</pre>" if self.error else ""
        return (f"<div><b style='color:{colour}'>{html.escape(self.summary().splitlines()[0])}</b>{err}"
                f"<table><tr><th>rank</th><th>exit code</th></tr>{rows}</table>"
                f"<code>{html.escape(str(self.run_dir))}</code></div>")


def _root_cause_from_exit(run_dir: Path, exits: list[dict]) -> RootCause | None:
    failed = [e for e in exits if e.get("status") == "failed"]
    if failed:
        exit_rec = failed[0]
        root_rank = exit_rec["root_rank"]
        failure = next(f for f in exit_rec["failures"] if f["rank"] == root_rank)
        msg = failure["message"]
        attempts = sorted((run_dir / "logs").glob("attempt*"), key=lambda p: int(p.name[7:]))
        stderr_path = (attempts[-1] if attempts else run_dir / "logs") / f"rank{root_rank}.stderr"
        tb = msg.get("traceback", "") if isinstance(msg, dict) else ""
        if not tb and stderr_path.exists():
            tb = last_traceback(stderr_path.read_text(errors="replace"))
        exception = (msg.get("message") if isinstance(msg, dict) else "") or (tb.splitlines()[-1] if tb else "")
        if not exception:
            signal = failure.get("signal")
            exception = f"killed by {signal}" if signal and signal != "<N/A>" else "no traceback was written"
        summary = f"rank {root_rank} failed (exit code {failure['exitcode']}): {exception}"
        return RootCause(summary, root_rank, failure["exitcode"], exception, tb)
    broken = [e for e in exits if e.get("status") == "agent_error"]
    if broken:
        return RootCause(f"torchrun could not run the job: {broken[0].get('message', '')}",
                         exception=broken[0].get("message", ""))
    return None


def load_run(run_dir: str | Path) -> RunResult:
    """Read a run directory back into a RunResult."""
    run_dir = Path(run_dir).resolve()
    manifest = _read_json(run_dir / "manifest.json")
    if manifest is None:
        raise FileNotFoundError(f"{run_dir} is not a gpucourse run directory (no readable manifest.json)")
    world = int(manifest.get("world_size", 0))
    exits = [e for p in sorted(run_dir.glob("exit*.json")) if (e := _read_json(p))]
    status = manifest.get("status", "running")
    error = None
    if manifest.get("stop_reason"):
        error = RootCause(manifest["stop_reason"], traceback=manifest.get("stop_detail", ""))
    elif status == "failed":
        error = _root_cause_from_exit(run_dir, exits)
    codes: dict[int, int | None] = {r: (0 if status == "ok" else None) for r in range(world)}
    for e in exits:
        for f in e.get("failures", []):
            codes[f["rank"]] = f["exitcode"]
    return RunResult(run_dir, status, codes, manifest.get("duration"), world, error, manifest)


def list_runs(root: str | Path | None = None) -> list[RunResult]:
    """Every run under the runs directory, oldest first (unreadable folders skipped)."""
    root = Path(root) if root else runs_root()
    out = []
    for path in sorted(root.glob("*/manifest.json")):
        try:
            out.append(load_run(path.parent))
        except (FileNotFoundError, ValueError, KeyError):
            continue
    return sorted(out, key=lambda r: r.manifest.get("start", 0))
