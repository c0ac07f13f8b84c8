"""The chapter notebooks executed with papermill on this machine, one after the other or several at once."""
from __future__ import annotations

from pathlib import Path

from .harness import ROOT, emit, needs, seconds_left


NOTEBOOK_MIN_S = 45  # a notebook is not started with less than this left


def _pick_notebooks(books: list[Path], only: list[str] | None, skip: list[str] | None = None) -> list[Path]:
    """The notebooks to run, in the order of `only`'s prefixes (all of them, in order, without), less those whose
    names start with one of `skip`'s: a chapter added later is run without anyone naming it."""
    picked: list[Path] = []
    for prefix in only or [""]:
        picked += [b for b in books if b.stem.startswith(prefix) and b not in picked]
    return [b for b in picked if not b.stem.startswith(tuple(skip or ()))]


def _notebook_row(run) -> dict:
    return {"status": run.status, "seconds": round(run.duration, 1), "failing_cell": run.failing_cell,
            "error": run.error[:2000]}


@needs(60)
def check_notebooks(smoke: bool = True, only: list[str] | None = None, output: Path | None = None,
                    workers: int = 1, skip: list[str] | None = None):
    """Chapter notebooks executed with papermill on this machine (the launcher picks NCCL or gloo); `only` runs
    the notebooks whose names start so, in that order, `skip` all but those; `workers` > 1 runs that many at once
    (kernels apart)."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import get_context

    from ..course import execute_notebook, find_notebooks

    output = output or ROOT / "executed" / "gpu-check"
    todo, rows = _pick_notebooks(find_notebooks(), only, skip), {}

    def done(path, row):
        rows[path.stem] = row
        print(f"  {path.stem}: {row['status']} in {row.get('seconds', 0):.0f} s {row.get('error', '')[:300]}",
              flush=True)
        emit({"progress": "notebooks", "notebook": path.stem, **row})

    def cell_timeout():
        left = seconds_left()
        return 600 if left is None else int(max(60, min(600, left)))  # papermill takes whole seconds

    def may_start(path) -> bool:
        left = seconds_left()
        if left is not None and left < NOTEBOOK_MIN_S:
            done(path, {"status": "skipped", "seconds": 0, "error": f"not started: {left:.0f} s of the budget left"})
            return False
        return True

    if workers <= 1:
        for path in todo:
            if may_start(path):
                done(path, _notebook_row(execute_notebook(path, output, smoke=smoke, cell_timeout=cell_timeout())))
    else:  # processes, not threads: each papermill run has its own event loop and kernel manager
        queue = list(todo)
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            running = {}
            while queue or running:
                while queue and len(running) < workers:
                    path = queue.pop(0)
                    if may_start(path):
                        running[pool.submit(execute_notebook, path, output, smoke=smoke,
                                            cell_timeout=cell_timeout())] = path
                if not running:
                    continue
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    path = running.pop(future)
                    try:
                        done(path, _notebook_row(future.result()))
                    except Exception as err:  # the worker process died: that notebook failed, the rest go on
                        done(path, {"status": "failed", "seconds": 0, "failing_cell": None,
                                    "error": f"{type(err).__name__}: {err}"})
    rows = {p.stem: rows[p.stem] for p in todo if p.stem in rows}  # in the order asked
    ran = [r for r in rows.values() if r["status"] != "skipped"]
    passed = sum(r["status"] == "ok" for r in ran)
    skipped = len(rows) - len(ran)
    text = (f"{passed} of {len(ran)} notebooks ran to the end ({'smoke' if smoke else 'default'} sizes"
            + (f", {workers} at a time" if workers > 1 else "") + ")"
            + (f"; {skipped} not started (time budget)" if skipped else ""))
    failed = [f"{k} (cell {r['failing_cell']}: {r['error'][:160]})" for k, r in rows.items() if r["status"] == "failed"]
    return passed == len(rows) > 0, text + ("; failed: " + "; ".join(failed) if failed else ""), rows
