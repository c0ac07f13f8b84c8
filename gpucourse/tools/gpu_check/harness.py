"""What every check shares: the course's paths, the time budget and the results file written as outcomes come,
a job launched quietly, a failed run in one line, and the devices each run's ranks used."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ...run.paths import project_root

ROOT = project_root() or Path.cwd()
SCRIPTS = ROOT / "scripts"
DOCTOR_JOB = Path(__file__).parent.parent / "doctor_job.py"


# --- time budget and results written as they come -----------------------------------------------------
_deadline: float | None = None  # time.time() after which no check (and no notebook) is started
_results: Path | None = None  # JSONL: one line per outcome, appended as soon as it is known


def start(deadline: float | None, results: Path | None) -> None:
    """Set this run's time budget (--budget/--deadline) and results file (--results), before any check starts."""
    global _deadline, _results
    _deadline, _results = deadline, results
    if results:
        results.parent.mkdir(parents=True, exist_ok=True)


def needs(seconds: float):
    """Mark a check with the seconds it needs on one H100 (measured 2026-11-25 where a run exists, else estimated):
    it is not started when less than this is left of the budget (it would be cut off and say nothing)."""
    def mark(check):
        check.needs_s = seconds
        return check
    return mark


def seconds_left() -> float | None:
    """Seconds left of the time budget (--budget/--deadline), None without one."""
    return None if _deadline is None else _deadline - time.time()


def emit(record: dict) -> None:
    """Append one record to the results file (if any) at once: a run cut off later still leaves it."""
    if _results is None:
        return
    with open(_results, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def launch(script, **kw):
    """The launcher's launch, quiet, returning a failed job's result instead of raising, 300 s at most unless told."""
    from ...run import launcher

    kw.setdefault("live", False)
    kw.setdefault("check", False)
    kw.setdefault("timeout", 300)
    return launcher.launch(script, **kw)


def failed_run(res) -> str | None:
    return None if res.ok else res.summary().splitlines()[0] + (f" — {res.error.summary}" if res.error else "")


def job_devices(runs_dir: Path) -> list[dict]:
    """Every run under `runs_dir`: its name, status, world size, the launcher's backend and device (manifest),
    and each rank's own backend and device as runtime.setup() recorded them (metrics/rank<r>.jsonl)."""
    from ...run.contract import EVENT_SETUP, manifest_file, metrics_files

    jobs = []
    for run in sorted(p for p in Path(runs_dir).iterdir() if p.is_dir()) if Path(runs_dir).is_dir() else []:
        try:
            manifest = json.loads(manifest_file(run).read_text())
        except (OSError, ValueError):
            continue
        ranks = {}
        for rank, path in metrics_files(run).items():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == EVENT_SETUP:
                    ranks[rank] = {"backend": rec.get("backend"), "device": rec.get("device")}
                    break
        jobs.append({"name": manifest.get("name", run.name), "status": manifest.get("status"),
                     "world_size": manifest.get("world_size"), "backend": manifest.get("backend"),
                     "launcher_device": manifest.get("planned_device", manifest.get("device")),
                     "rank_devices": sorted({str(r["device"]) for r in ranks.values()}),
                     "rank_backends": sorted({str(r["backend"]) for r in ranks.values()})})
    return jobs
