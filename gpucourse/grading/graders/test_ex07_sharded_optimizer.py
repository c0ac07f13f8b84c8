"""Grader of ex07 part 1: ShardedOptimizer, ZeRO stage 1 by hand (run it with `gpucourse grade ex07`).

Two real jobs (2 and 4 ranks, side by side, through gpucourse.launch; ex07_sharded_optimizer_job.py) run
every case on the submission and save the parameters after each step; the tests compare them, here in the grader
process, with the plain torch optimizer stepped here on the same model and batch (`CASES.reference`). What is
checked:
- the parameters match the plain torch optimizer step by step (AdamW with weight decay, SGD with momentum,
  an lr changed through param_groups), with tied weights passed twice, and after add_param_group;
- each rank holds about 1/N of the optimizer state (every tensor the object holds, weighed by the grader);
- step() broadcasts each parameter's bytes exactly once and starts no other collective (no all_reduce);
- torch's ZeroRedundancyOptimizer is not used.
"""
import ast
import functools
from pathlib import Path

import pytest

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex07_sharded_optimizer_job.py")
CASES = job_module(JOB)  # its models, batches and training loop: the reference is stepped here
TOLERANCE = 1e-5
WORLD_SIZES = (2, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 150
BALANCE = 1.10  # a rank may hold at most 10 % more than an exact 1/N share of the state (+ STATE_SLACK)
STATE_SLACK = 256  # bytes: per-parameter step counters and the like


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex07-sharded-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


@functools.lru_cache(maxsize=None)
def reference(case: str) -> dict:
    """The unsharded torch optimizer on `case`'s model and batch, in this process (the same on every rank)."""
    how = next(how for name, _, how in CASES.PLAN if name == case)
    return CASES.reference(**how)


# --- what makes one rank's record wrong (None when right) --------------------------------------------
def equiv_problem(rec) -> str | None:
    if not rec["is_optimizer"]:
        return "ShardedOptimizer must be a torch.optim.Optimizer subclass"
    want = reference(rec["case"])["params"]
    got = raw(rec)["params"]
    if len(got) != len(want):
        return f"{len(got)} steps recorded, {len(want)} expected"
    for step, (mine, ref) in enumerate(zip(got, want), 1):
        if len(mine) != len(ref) or any(a.shape != b.shape for a, b in zip(mine, ref)):
            return f"after step {step}, the model's parameters changed in number or shape"
        diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(mine, ref))
        if not diff <= TOLERANCE:  # NaN is wrong too
            return (f"after step {step}, parameters differ from the unsharded optimizer by {diff:.2g} "
                    f"(tolerance {TOLERANCE:g}): every rank must get every updated parameter from its "
                    f"owner, and the inner groups must take the lr of self.param_groups")
    return None


def comm_problem(rec) -> str | None:
    other_ops = [sorted(op for op in ops if op != "broadcast") for ops in rec["ops"]]
    steps = zip(other_ops, rec["broadcast_bytes"], reference(rec["case"])["param_bytes"])
    for step, (other, got, want) in enumerate(steps, 1):
        if other:
            return (f"step {step} called {', '.join(other)}: after the local update only dist.broadcast from "
                    f"each parameter's owner is needed (no all_reduce of parameters)")
        if got != want:
            return (f"step {step} broadcast {got} bytes; the parameters hold {want}: broadcast "
                    f"each parameter exactly once (a tied weight once), from its owner")
    return None


def memory_problem(rec) -> str | None:
    world, full, mine = rec["world"], reference(rec["case"])["full_state_bytes"], rec["state_bytes"]
    if full == 0:
        return "the reference optimizer holds no state (grader bug: report it)"
    limit = BALANCE * full / world + STATE_SLACK
    if mine > limit:
        return (f"this rank's optimizer holds {mine} bytes of tensors; the unsharded optimizer holds {full}, so "
                f"1/{world} is {full / world:.0f}: keep state only for this rank's parameters, shards balanced by "
                f"size (largest first, to the least-loaded rank)")
    if mine == 0:
        return "this rank's optimizer holds no state at all after stepping: the inner optimizer must do the update"
    return None


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_matches_unsharded_optimizer(jobs, optim):
    """4 steps on every rank reach the torch optimizer's parameters (lr halved through param_groups at step 3)."""
    check(jobs, [optim], equiv_problem)


@pytest.mark.points(1)
def test_tied_parameter_given_twice(jobs):
    """An embedding tied to the output layer, passed twice, is updated (and broadcast) once."""
    check(jobs, ["tied"], lambda rec: equiv_problem(rec) or comm_problem(rec))


@pytest.mark.points(1)
def test_add_param_group(jobs):
    """A group added after 2 steps, with its own lr, is sharded and stepped like torch's."""
    check(jobs, ["add_group"], lambda rec: equiv_problem(rec) or comm_problem(rec))


@pytest.mark.points(2)
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_state_is_sharded(jobs, optim):
    """Each rank holds at most ~1/N of the optimizer state (AdamW: m and v; SGD: the momentum buffer)."""
    check(jobs, [optim], lambda rec: equiv_problem(rec) or memory_problem(rec))


@pytest.mark.points(2)
def test_broadcast_only(jobs):
    """step() broadcasts each parameter's bytes once and calls no other collective."""
    check(jobs, ["adamw", "sgd"], lambda rec: equiv_problem(rec) or comm_problem(rec))


@pytest.mark.points(1)
def test_no_zero_redundancy_optimizer(jobs, submission):
    """torch's ZeroRedundancyOptimizer is neither in the source nor called; and the basic case runs."""
    tree = ast.parse(submission.read_text(errors="replace"))
    names = [node.lineno for node in ast.walk(tree)
             if (isinstance(node, ast.Name) and node.id == "ZeroRedundancyOptimizer")
             or (isinstance(node, ast.Attribute) and node.attr == "ZeroRedundancyOptimizer")
             or (isinstance(node, ast.ImportFrom) and any(a.name == "ZeroRedundancyOptimizer" for a in node.names))]
    assert not names, f"the submission uses torch's ZeroRedundancyOptimizer (line {names[0]}): shard the state yourself"
    used = [c for job in jobs.values() for c in job.cases() for rec in job.ranks(c) if rec.get("forbidden_used")]
    assert not used, f"case {used[0]} called torch's ZeroRedundancyOptimizer"
    check(jobs, ["adamw"], equiv_problem)  # something must run
