"""The grader side of a grading job: the records it left, by case and rank, and why it stopped early.

Every grader's job logs `{"case": "plan", "cases": {case: group}}` first, `{"case": "import", "error": ...}`
if the submission cannot be loaded, then one record per case and rank. The tests ask for a case's records
and get one per rank, with a made-up record (and the reason) for a rank that ended during the case.

A rank decides nothing: what the submission produced comes back raw (`JobRecords.raw`: the tensors a case
saved) and the tests compare it with what the grader process computes itself from the case's inputs, which it
takes from the job script's own plan (`job_module`).

A grader launches its job with `launch_jobs` (once per world size, side by side) in a module fixture and
fails a test with `check` (the first failing case, one line).

Batches: when $GPUCOURSE_GRADE_BATCH names a folder whose batch.json lists several submissions (the test suite's
mutants of one exercise), the first grading of any of them launches each job once for all of them, and every
grading of the batch reads its own submission's records from those runs (jobkit forks a process per submission).
"""
import fcntl
import functools
import hashlib
import importlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gpucourse.run.contract import DEVICE_ENV, raw_file
from gpucourse.run.launcher import launch
from gpucourse.run.result import load_run

from gpucourse.tools.grading.plugin import BATCH_ENV, BATCH_FILE, TIMING_ENV

# In the test suite (TIMING_ENV=report) the limits only catch hangs and endless loops: they get this much more
# room, so that a correct case on a machine loaded far beyond its cores is never cut off. Learners' grading keeps
# the limits as set.
REPORT_SLACK = 2


class RawResultsError(Exception):
    """A case's raw results file is missing, unreadable or not what its record names."""


@functools.lru_cache(maxsize=64)
def _load_raw(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def raw(rec: dict) -> dict:
    """The raw results a rank's record of a case saved ({name: tensor or plain value}); {} if it saved none.

    Loaded with weights_only=True: the file was written inside the submission's process, so it is read as data,
    never as code. (Tests must not modify what they get: it is cached.)"""
    if not rec.get("raw"):
        return {}
    try:
        values = _load_raw(raw_file(rec["run_dir"], rec["rank"], rec["case"], rec["sub"]))
    except Exception as err:  # noqa: BLE001 - a missing or unreadable file fails that case, not the grader
        raise RawResultsError(f"its raw results cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(values, dict) or sorted(values) != sorted(rec["raw"]):
        raise RawResultsError("its raw results are not the ones its record names")
    return values


def job_module(job_file: Path):
    """The grading job script imported in the grader process, for its plan and inputs: the tests recompute from
    them what each case should have produced. (Its imports of jobkit and comm_recorder install nothing: only a
    job's run() does.)"""
    return importlib.import_module(f"{__package__}.graders.{Path(job_file).stem}")


class JobRecords:
    """One job's records of submission number `sub`, {case: {rank: record}}. Every record carries the grader's own
    facts, whatever the rank wrote: its run_dir and rank (from the file it was read from), sub, and world, the job's
    world size as launched. `exits` holds how each rank's process for this submission ended ({rank: exit code})."""

    def __init__(self, result, world: int, label: str | None = None, sub: int = 0):
        self.result, self.world, self.sub = result, world, sub
        self.label = label or f"{world} rank(s)"  # how a failure names the job
        self.records: dict[str, dict[int, dict]] = {}
        self.exits: dict[int, int] = {}
        for rank, records in result.metrics.items():
            for rec in records:
                if "case" not in rec or rec.get("sub") != sub:
                    continue
                if rec["case"] == "exit":
                    self.exits[rank] = rec["code"]
                    continue
                # The grader's own facts, whatever the rank wrote: raw() reads there, the tests read the world size
                rec["run_dir"], rec["rank"], rec["world"], rec["sub"] = result.run_dir, rank, world, sub
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
            return [{"case": case, "rank": 0, "world": self.world, "error": f"not run: {self.why_stopped()}"}]
        return [got.get(r) or self._silent(case, r) for r in range(self.world)]

    def _silent(self, case: str, rank: int) -> dict:
        """A rank that left no record of a case others reached: it ended by itself, or was stopped."""
        code = self.exits.get(rank, self.result.returncodes.get(rank))
        if code in (-9, -15):  # SIGKILL/SIGTERM: torchrun shutting the job down after another rank failed
            return {"case": case, "rank": rank, "world": self.world, "peer_lost": True,
                    "error": "stopped when another rank failed"}
        how = f"exit code {code}" if code is not None else "os._exit? a crash?"
        return {"case": case, "rank": rank, "world": self.world, "ended": True,
                "error": f"the process ended during this case ({how})"}


def launch_jobs(job_file, submission, world_sizes, *, name: str, case_limit: float, timeout: float,
                stall_timeout: float, env: dict | None = None, extra_args=()) -> dict:
    """{world size: JobRecords}: the grading job launched once per world size, side by side (their start-up
    waits overlap on two cores). `name` may hold `{world}` (and `{key}`); the job gets the submission (or the
    whole batch, see the module's docstring), --case-limit and extra_args. `timeout` is per submission.

    Jobs of one world size that differ otherwise (ex09's 2x1 and 1x2 meshes) are given as a dict instead,
    {key: (world size, that job's own extra args)}, and come back as {key: JobRecords} labelled by their key.
    """

    if os.environ.get(TIMING_ENV) == "report":
        case_limit, timeout, stall_timeout = (REPORT_SLACK * t for t in (case_limit, timeout, stall_timeout))
    jobs = world_sizes if isinstance(world_sizes, dict) else {w: (w, ()) for w in world_sizes}
    batch = Batch.of(submission)
    submissions = batch.submissions if batch else [str(submission)]
    sub = submissions.index(str(Path(submission).resolve())) if batch else 0

    def run(key) -> JobRecords:
        world, own = jobs[key]
        args = [*submissions, "--case-limit", str(case_limit), *extra_args, *own]

        def start():  # gloo ranks on the CPU wherever it is graded: a GPU machine gives the same verdict
            return launch(job_file, nproc=world, args=args, name=name.format(world=world, key=key), live=False,
                          timeout=timeout * len(submissions), stall_timeout=stall_timeout, check=False,
                          backend="gloo", env={DEVICE_ENV: "cpu", **(env or {})})

        result = batch.run(job_file, world, args, start) if batch else start()
        return JobRecords(result, world, f"{key} mesh" if isinstance(world_sizes, dict) else None, sub)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


class Batch:
    """Gradings that share their jobs' launches: $GPUCOURSE_GRADE_BATCH's folder, its batch.json listing them."""

    def __init__(self, folder: Path, submissions: list[str]):
        self.folder, self.submissions = folder, submissions

    @classmethod
    def of(cls, submission) -> "Batch | None":
        """The batch `submission` belongs to, or None (no batch, or it is not in the batch's list). Its
        submissions are the listed files of the same exercise (file name): a class's batch lists them all."""
        folder = os.environ.get(BATCH_ENV)
        if not folder:
            return None
        path = Path(submission).resolve()
        listed = json.loads((Path(folder) / BATCH_FILE).read_text())["submissions"]
        return cls(Path(folder), [s for s in listed if Path(s).name == path.name]) if str(path) in listed else None

    def run(self, job_file, world: int, args: list[str], start):
        """The run of this job for the whole batch: launched by the first grading that needs it (start()), read
        back by every other. A lock per job keeps two gradings from launching the same one."""
        key = hashlib.sha1(json.dumps([str(job_file), world, args]).encode()).hexdigest()[:16]
        launched = []

        def launch_it() -> dict:
            launched.append(start())
            return {"run_dir": str(launched[0].run_dir)}

        found = self.once(key, launch_it)
        return launched[0] if launched else load_run(found["run_dir"])

    def once(self, key: str, make) -> dict:
        """make()'s value (a dict of JSON values) for the whole batch: computed by the first grading that asks for
        `key`, read back by every other. A lock per key keeps two gradings from computing the same one."""
        with open(self.folder / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = self.folder / f"{key}.json"
            if done.exists():
                return json.loads(done.read_text())
            value = make()
            done.write_text(json.dumps(value))
            return value


def telling(rec: dict) -> int:
    """How much a failing rank's record says about the cause (lower: more). A rank that ended mid-case beats one
    that raised or returned a wrong result, then one that waited and timed out, then one whose peer died."""
    return 3 if rec.get("peer_lost") else 2 if rec.get("timed_out") else 0 if rec.get("ended") else 1


def check(jobs, cases, problem, worlds=None, *, only_cases_that_ran: bool = False) -> None:
    """Fail with the first failing case (one line, its most telling rank), counting the others.

    jobs: one job's JobRecords, or {world size: JobRecords} (each failure then names its world size; `worlds`
    picks some of them). cases: the case names, a group's name (every case of that group the job planned), or
    None (every case planned).
    problem(rec) -> None when a rank's record of a case is right, else why not; it may read the case's tensors
    with raw(rec). only_cases_that_ran: judge a property (in place, traffic, ...) on the cases that did not
    raise, which the correctness tests already fail; a job in which no case ran still fails.
    """
    several = isinstance(jobs, dict)
    failures = []
    for job in [jobs[w] for w in (worlds or jobs)] if several else [jobs]:
        ran, crashes = 0, []
        for case in job.cases(cases) if cases is None or isinstance(cases, str) else cases:
            records = job.ranks(case)
            crashed = only_cases_that_ran and _most_telling(records, lambda rec: None)
            if crashed:
                crashes.append(f"{job.label}, " * several + f"{case}, rank {crashed[0]}: {crashed[1]}")
                continue
            ran += 1
            failed = _most_telling(records, problem)
            if failed:
                failures.append(f"{job.label}, " * several + f"{case}, rank {failed[0]}: {failed[1]}")
        if crashes and not ran:
            failures.append(f"no case ran to the end; {crashes[0]}")
    if failures:
        more = f" (and {len(failures) - 1} more failing case(s))" if len(failures) > 1 else ""
        pytest.fail(failures[0] + more, pytrace=False)


def _most_telling(records, problem) -> tuple[int, str] | None:
    """(rank, why) of the failing rank whose record says most (an error before problem()), or None."""
    found = []
    for rec in records:
        try:
            why = rec.get("error") or problem(rec)
        except RawResultsError as err:
            why = str(err)
        if why:
            found.append((telling(rec), rec.get("rank", 0), why))
    return min(found)[1:] if found else None
