"""The grader side of a grading job: the records it left, by case and rank, and why it stopped early.

Every exNN_job.py logs `{"case": "plan", "cases": {case: group}}` first, `{"case": "import", "error": ...}`
if the submission cannot be loaded, then one record per case and rank. The tests ask for a case's records
and get one per rank, with a made-up record (and the reason) for a rank that ended during the case.

A grader launches its job with `launch_jobs` (once per world size, side by side) in a module fixture and
fails a test with `check` (the first failing case, one line).
"""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpucourse.launcher import launch

from .conftest import TIMING_ENV

# In the test suite (TIMING_ENV=report) the limits only catch hangs and endless loops: they get this much more
# room, so that a correct case on a machine loaded far beyond two burners is never cut off (a mutant's 20 s
# memory case once was, and the cases after it lost their points too). Learners' grading keeps the limits as set.
REPORT_SLACK = 2


class JobRecords:
    def __init__(self, result, world: int, label: str | None = None):
        self.result, self.world = result, world
        self.label = label or f"{world} rank(s)"  # how a failure names the job
        self.records: dict[str, dict[int, dict]] = {}
        for rank, records in result.metrics.items():
            for rec in records:
                if "case" in rec:
                    self.records.setdefault(rec["case"], {})[rank] = rec
        plans = self.records.get("plan", {})
        self.plan: dict[str, str] = next(iter(plans.values()))["cases"] if plans else {}

    def why_stopped(self) -> str:
        for rec in self.records.get("import", {}).values():
            return f"the submission could not be loaded: {rec['error']}"
        started = [case for case in self.plan if case in self.records]
        if started:
            return f"the job stopped at case {started[-1]}"
        return self.result.error.summary if self.result.error else f"the job ended early ({self.result.status})"

    def cases(self, group: str | None = None) -> list[str]:
        """The cases this job planned (of one group, or all), or fail with why the job never planned any."""
        if not self.plan:
            pytest.fail(f"{self.label}: {self.why_stopped()}", pytrace=False)
        return [case for case, g in self.plan.items() if group in (None, g)]

    def ranks(self, case: str) -> list[dict]:
        """Every rank's record of `case`. When some ranks have one and others not, those ended during it."""
        got = self.records.get(case, {})
        if not got:
            return [{"case": case, "rank": 0, "error": f"not run: {self.why_stopped()}"}]
        return [got.get(r) or self._silent(case, r) for r in range(self.world)]

    def _silent(self, case: str, rank: int) -> dict:
        """A rank that left no record of a case others reached: it ended by itself, or was stopped."""
        code = self.result.returncodes.get(rank)
        if code in (-9, -15):  # SIGKILL/SIGTERM: torchrun shutting the job down after another rank failed
            return {"case": case, "rank": rank, "peer_lost": True, "error": "stopped when another rank failed"}
        how = f"exit code {code}" if code is not None else "os._exit? a crash?"
        return {"case": case, "rank": rank, "ended": True, "error": f"the process ended during this case ({how})"}


def launch_jobs(job_file, submission, world_sizes, *, name: str, case_limit: float, timeout: float,
                stall_timeout: float, env: dict | None = None, extra_args=()) -> dict:
    """{world size: JobRecords}: the grading job launched once per world size, side by side (their start-up
    waits overlap on two cores). `name` may hold `{world}` (and `{key}`); the job gets the submission,
    --case-limit and extra_args.

    Jobs of one world size that differ otherwise (ex09's 2x1 and 1x2 meshes) are given as a dict instead,
    {key: (world size, that job's own extra args)}, and come back as {key: JobRecords} labelled by their key.
    """

    if os.environ.get(TIMING_ENV) == "report":
        case_limit, timeout, stall_timeout = (REPORT_SLACK * t for t in (case_limit, timeout, stall_timeout))
    jobs = world_sizes if isinstance(world_sizes, dict) else {w: (w, ()) for w in world_sizes}

    def run(key) -> JobRecords:
        world, own = jobs[key]
        args = [str(submission), "--case-limit", str(case_limit), *extra_args, *own]
        result = launch(job_file, nproc=world, args=args, name=name.format(world=world, key=key), timeout=timeout,
                        stall_timeout=stall_timeout, env=env, check=False, live=False)
        return JobRecords(result, world, f"{key} mesh" if isinstance(world_sizes, dict) else None)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


def check(jobs, cases, problem, worlds=None) -> None:
    """Fail with the first failing case (one line, its most telling rank), counting the others.

    jobs: one job's JobRecords, or {world size: JobRecords} (each failure then names its world size; `worlds`
    picks some of them). cases: the case names, or a group's name (every case of that group the job planned).
    problem(rec) -> None when a rank's record of a case is right, else why not. A rank that raised is
    reported before one that was stopped because of it.
    """
    several = isinstance(jobs, dict)
    failures = []
    for job in [jobs[w] for w in (worlds or jobs)] if several else [jobs]:
        for case in job.cases(cases) if isinstance(cases, str) else cases:
            found = []
            for rec in job.ranks(case):
                why = rec.get("error") or problem(rec)
                if why:
                    found.append((bool(rec.get("peer_lost")), rec.get("rank", 0), why))
            if found:
                _, rank, why = min(found)
                failures.append(f"{job.label}, " * several + f"{case}, rank {rank}: {why}")
    if failures:
        more = f" (and {len(failures) - 1} more failing case(s))" if len(failures) > 1 else ""
        pytest.fail(failures[0] + more, pytrace=False)
