"""The graders on the GPU machine: `gpucourse grade` for the GPU-relevant exercises, and which backend and device
each grading job's ranks used."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .harness import job_devices, needs


# --- graders on the GPU machine -----------------------------------------------------------------------
GRADED = ("ex02_ddp", "ex06_tensor_parallel", "ex07_sharded_optimizer", "ex07_fsdp")


def _job_exercise(job_name: str, exercises) -> str | None:
    """Which exercise a grading job's run belongs to: 'grade-ex07-fsdp-w2-...' -> 'ex07_fsdp' (longest match)."""
    name = job_name.lower().replace("_", "-")
    best = None
    for ex in exercises:
        num, _, rest = ex.partition("_")
        words = [num] + rest.split("_")
        # the run names use the exercise number and, where one chapter has two exercises, its first word
        for n in range(len(words), 0, -1):
            tag = "-".join(words[:n])
            if f"-{tag}-" in f"-{name}-" or name.startswith(f"grade-{tag}"):
                if best is None or n > best[1]:
                    best = (ex, n)
                break
    return best[0] if best else None


@needs(120)
def check_graders(exercises=GRADED, target: str = "solutions", workers: int = 4):
    """`gpucourse grade EX --target solutions` for the GPU-relevant exercises, on this machine (full marks
    expected); which backend and device each grading job's ranks used, read from its runs."""
    from concurrent.futures import ThreadPoolExecutor

    from .. import grading
    from ...run.contract import RUNS_ENV

    runs = Path(tempfile.mkdtemp(prefix="gpucheck-grade-"))
    before = os.environ.get(RUNS_ENV)
    os.environ[RUNS_ENV] = str(runs)  # the grading subprocess keeps its jobs' runs there (read below)
    figures: dict = {}
    try:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            futures = {ex: pool.submit(grading.grade, ex, target) for ex in exercises}
            for ex, future in futures.items():
                try:
                    report = future.result()
                    figures[ex] = {"score": report.score, "max_score": report.max_score, "problems": report.problems,
                                   "seconds": round(report.duration, 1),
                                   "not_passed": [f"{t.name}: {t.outcome} {t.why}"[:300] for t in report.tests
                                                  if not t.passed]}
                except Exception as err:
                    figures[ex] = {"error": f"{type(err).__name__}: {err}"[:1000]}
                print(f"  {ex}: {figures[ex]}", flush=True)
    finally:
        if before is None:
            os.environ.pop(RUNS_ENV, None)
        else:
            os.environ[RUNS_ENV] = before
    jobs = job_devices(runs)
    for job in jobs:
        ex = _job_exercise(job["name"], exercises)
        figures.setdefault(ex or "unattributed", {}).setdefault("jobs", []).append(job)
    figures["runs_dir"] = str(runs)
    ok = all(f.get("score") == f.get("max_score") and f.get("max_score") and not f.get("problems")
             for ex, f in figures.items() if ex in exercises)
    texts = []
    for ex in exercises:
        f = figures.get(ex, {})
        used = sorted({f"{j['backend']}/{','.join(j['rank_devices']) or '?'}" for j in f.get("jobs", [])})
        score = f"{f['score']:g}/{f['max_score']:g}" if "score" in f else f.get("error", "no result")[:200]
        texts.append(f"{ex} {score} ({'; '.join(used) or 'no jobs seen'})")
    return ok, "; ".join(texts), figures
