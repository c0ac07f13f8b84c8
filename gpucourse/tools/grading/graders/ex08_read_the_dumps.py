"""Grader of ex08 part 2: read the Flight Recorder dumps (run it with `gpucourse grade ex08_read_the_dumps`).

Ten faults are injected into real 4-rank jobs of chapter 08b's scripts/08b_hangs.py (--mode, --rank, --step), run
once (5 side by side) for every submission of a grading batch; the submission's `diagnose` reads each job's dumps
and exit codes, and one test per fault scores its answer against what was injected (not against gpucourse's own
diagnosis). The faults come from a seed: random
per grading, shown in every test's note, and replayed by `gpucourse grade ex08_read_the_dumps --seed N`.

Faults: each kind twice (missing: a skipped collective; straggler: a rank busy in its own code; order: another
operation; shape: other sizes; crash: a SIGKILL), at a random step (0, 1 or 2; the collective of step s is number
s + 1 of the default group). The culprit is a random rank other than 0 in the first five and rank 0 in the last
five: every kind is seen with rank 0 at fault, the rank a reader blames or trusts by habit, and with another one.
Each job runs until the fault and one step past it (a rank whose call went through moves on to the next
collective, as in a real job); a skip is the last step (the rank that skips it finishes, the others wait).

Threat model: the submission runs in a Python process of its own (`python -I`: no PYTHON* variables, no user
site), started with an almost empty environment in an empty folder, given the dumps and exit codes on its standard
input and nothing else: no run directory, no launcher arguments, no seed. It cannot import gpucourse (whose own
diagnosis would answer for it). Each call has a time limit. The injected truth stays in this process (and, in a
batch of gradings that share their launches, in the batch's folder, whose name the submission is not given).
"""
import functools
import os
import random
import secrets
from pathlib import Path

import pytest

from gpucourse.run import forensics
from gpucourse.run.contract import DEVICE_ENV
from gpucourse.run.launcher import launch_all
from gpucourse.tools.exercises import course_root
from gpucourse.tools.grading.graders._child import answers_in_child
from gpucourse.tools.grading.plugin import SEED_ENV, TIMING_ENV
from gpucourse.tools.grading.records import REPORT_SLACK, Batch

pytestmark = pytest.mark.grader

WORLD = 4
KINDS = ("missing", "straggler", "order", "shape", "crash")
MODES = {"missing": "skip", "straggler": "straggler", "order": "mismatch", "shape": "shape", "crash": "crash"}
FAULTS = 2 * len(KINDS)
STEPS = 3  # a fault strikes at step 0, 1 or 2
STALL_S = 8  # seconds of silence before the launcher stops a job and asks its ranks for their dumps
JOB_TIMEOUT_S = 120
# Jobs at a time (20 ranks): 40 ranks importing torch at once on 2 busy cores were silent past the launcher's
# start-up grace (68 s, counted from the last rank's start) and stopped before their first collective.
PARALLEL = 5
CALL_LIMIT_S = 5  # one diagnose call; a few milliseconds are enough


def draw(seed: int) -> list[dict]:
    """The faults of `seed`: [{kind, rank, step}], the kinds in a fixed order (so each test names its kind)."""
    rng = random.Random(seed)
    return [{"kind": KINDS[i % len(KINDS)], "rank": rng.randrange(1, WORLD) if i < len(KINDS) else 0,
             "step": rng.randrange(STEPS)} for i in range(FAULTS)]


def job(fault: dict, number: int) -> dict:
    """The launch of one fault: 08b_hangs.py with its mode, culprit and step, stopped after STALL_S of silence."""
    steps = fault["step"] + (1 if fault["kind"] == "missing" else 2)
    args = ["--mode", MODES[fault["kind"]], "--rank", str(fault["rank"]), "--step", str(fault["step"]),
            "--steps", str(steps)]
    return {"script": course_root() / "scripts" / "08b_hangs.py", "nproc": WORLD, "args": args, "backend": "gloo",
            "name": f"grade-ex08-dumps-{number}-{fault['kind']}", "stall_timeout": STALL_S,
            "timeout": JOB_TIMEOUT_S, "check": False, "env": {DEVICE_ENV: "cpu", "OMP_NUM_THREADS": "1"}}


def inject(seed: int) -> dict:
    """Run the seed's faults, PARALLEL at a time: {"seed", "faults": [{kind, rank, step, run_dir, exits}]}."""
    faults = draw(seed)
    results = launch_all([job(f, i) for i, f in enumerate(faults)], parallel=PARALLEL)
    return {"seed": seed, "faults": [{**f, "run_dir": str(r.run_dir), "exits": [r.returncodes.get(k)
                                                                               for k in range(WORLD)]}
                                     for f, r in zip(faults, results)]}


@functools.lru_cache(maxsize=None)
def injected(batch_folder: str | None) -> dict:
    """This grading's faults, run once: in a batch of gradings, by the first that asks, for all of them."""
    seed = int(os.environ[SEED_ENV]) if os.environ.get(SEED_ENV) else secrets.randbelow(10**6)
    if batch_folder is None:
        return inject(seed)
    return Batch(Path(batch_folder), []).once("ex08-read-the-dumps", lambda: inject(seed))


# --- the submission, in a process of its own -----------------------------------------------------------------
def answers_of(submission: Path, faults: list[dict]) -> list[dict]:
    """The submission's diagnose on every fault's dumps and exit codes, in a fresh `python -I` process (_child.py):
    [{"answer": ...} or {"error": one line}]."""
    limit = CALL_LIMIT_S * (REPORT_SLACK if os.environ.get(TIMING_ENV) == "report" else 1)
    cases = [(forensics.read_dumps(Path(f["run_dir"]), WORLD), dict(enumerate(f["exits"]))) for f in faults]
    return answers_in_child(submission, "diagnose", cases, limit)


@pytest.fixture(scope="module")
def graded(submission) -> dict:
    """{"seed", "faults" (with the truth), "answers" (the submission's)}."""
    batch = Batch.of(submission)
    runs = injected(str(batch.folder) if batch else None)
    return {**runs, "answers": answers_of(submission, runs["faults"])}


def problem(fault: dict, got: dict) -> str | None:
    """None when the answer names the injected culprit, collective and kind; else what was wrong, with the truth."""
    truth = ([fault["rank"]], fault["step"] + 1, fault["kind"])
    injected_as = (f"injected: 08b_hangs.py --mode {MODES[fault['kind']]} --rank {fault['rank']} --step "
                   f"{fault['step']}, so ranks {truth[0]}, collective #{truth[1]}, {truth[2]}")
    if "error" in got:
        return f"{got['error']} ({injected_as})"
    answer = got["answer"]
    if not (isinstance(answer, list) and len(answer) == 3 and isinstance(answer[0], list)
            and all(isinstance(r, int) and not isinstance(r, bool) for r in answer[0])):
        return f"diagnose returned {answer!r}: return (a list of ranks, a sequence number, a kind) ({injected_as})"
    ranks, seq, kind = answer
    if (sorted(ranks), seq, kind) != truth:
        return f"you answered ranks {sorted(ranks)}, collective #{seq}, {kind!r}; {injected_as}"
    return None


@pytest.mark.points(1)
@pytest.mark.parametrize("number", range(FAULTS), ids=lambda i: f"{i}-{KINDS[i % len(KINDS)]}")
def test_names_the_fault(graded, number, record_property):
    """One injected fault: the culprit ranks, the collective's sequence number and the kind, all three right."""
    record_property("note", f"faults of seed {graded['seed']} (replay: --seed {graded['seed']})")
    why = problem(graded["faults"][number], graded["answers"][number])
    if why:
        pytest.fail(f"fault {number}: {why}", pytrace=False)
