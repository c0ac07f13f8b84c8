"""Grader of ex06: column- and row-parallel linear layers and the Megatron MLP (run it with `gpucourse grade ex06`).

One real job per world size (1, 2 and 4 ranks, through gpucourse.launch; ex06_job.py), side by side. Every
rank loads the same dense nn.Linear weights into the submission's layers (from_dense) and saves its outputs
and gradients raw; the tests below compare them, here in the grader process, with the dense layers' (or the
matching slices), recomputed from the job's own seeds. What is checked:
- ColumnParallelLinear (gather_output False/True) and RowParallelLinear (input_is_parallel True/False), with
  and without bias: output, input gradient, weight-shard and bias gradients;
- the row-parallel bias is added once, after the reduction;
- ParallelMLP equals nn.Sequential(fc1, GELU, fc2), and starts exactly one all_reduce (of the activations)
  in forward and one in backward, and no other collective (2 and 4 ranks; every torch.distributed
  collective is recorded);
- sizes the group does not divide raise ValueError naming both sizes;
- 4 ranks as two tensor-parallel groups of 2: the layers use their group, not the whole world.
"""
import re
from pathlib import Path

import pytest
import torch

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex06_job.py")
CASES = job_module(JOB)  # its plan, seeds and comparison: the dense layers' values are computed here
WORLD_SIZES = (1, 2, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    """{world size: JobRecords}: the three jobs run side by side (their start-up waits overlap)."""
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex06-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- what makes one rank's record of a case wrong (None when it is right) ---------------------------
def equal_problem(rec, world) -> str | None:
    """The first of the rank's raw results that differs from the dense layers' (divisible cases: the error)."""
    kind, options = CASES.spec(world, rec["case"])
    if kind == "divisible":
        return divisible_problem(rec, world, options["which"])
    if options.get("bias") is False and rec.get("has_bias"):
        return "bias=False but the layer has a bias"
    got = raw(rec)
    pairs = CASES.expected(world, rec["rank"], rec["case"])
    if kind == "bias-once":
        n = CASES.tensor_parallel(world, rec["rank"], rec["case"])[0]
        y, want = got["the output"], pairs[0][1]
        if isinstance(y, torch.Tensor) and y.shape == want.shape and n > 1 and torch.allclose(y, want * n):
            return (f"with zero weights the output is {n} × the bias: the bias was added on every rank before the "
                    f"all-reduce; add it once, after the reduction")
    for label, want, hint in pairs:
        if why := CASES.compare(label, got.get(label), want, hint):
            return why
    return None


def divisible_problem(rec, world, which: str) -> str | None:
    """Creating the layer raised ValueError whose message names both sizes."""
    n = CASES.tensor_parallel(world, rec["rank"], rec["case"])[0]
    bad, call = CASES.undivisible(which, n)
    if rec.get("raised") is None:
        return f"{call} on {n} ranks was created: {bad} is not divisible by {n}; raise ValueError"
    if not rec.get("value_error"):
        return f"{call} on {n} ranks raised {rec.get('line')}, not ValueError"
    text = rec.get("message", "")
    if not all(re.search(rf"(?<!\d){v}(?!\d)", text) for v in (bad, n)):
        return f"{call} on {n} ranks raised ValueError({text[:150]!r}): name both sizes ({bad} and {n})"
    return None


def collectives_problem(rec, world) -> str | None:
    """Equal to the dense MLP, and exactly one all_reduce of the activations in forward, one in backward, nothing
    else."""
    if why := equal_problem(rec, world):
        return why
    size = CASES.ACTIVATION_BYTES
    for phase in ("forward", "backward"):
        calls = [c for c in rec["calls"] if c["phase"] == phase]
        ops = ", ".join(f"{c['op']} ({c['bytes']} B)" for c in calls) or "none"
        if len(calls) != 1 or calls[0]["op"] != "all_reduce":
            what = "the output of fc2 (g)" if phase == "forward" else "the input gradient (f)"
            return (f"ParallelMLP's {phase} started {len(calls)} collective(s): {ops}; expected exactly one "
                    f"all_reduce, of {what}")
        if calls[0]["bytes"] != size:
            return (f"ParallelMLP's {phase} all_reduce moved a {calls[0]['bytes']}-byte tensor; expected the "
                    f"activations, batch × seq × hidden × 4 = {size} bytes")
    return None


def judge(jobs, worlds, cases: str, problem) -> None:
    """job_records.check over these world sizes' jobs, each record judged by problem(rec, its job's world size)
    (known from the run folder the grader read the record from, not from anything the rank wrote)."""
    world_of = {str(jobs[w].result.run_dir): w for w in worlds}
    check({w: jobs[w] for w in worlds}, cases, lambda rec: problem(rec, world_of[str(rec["run_dir"])]))


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_column_parallel_equals_dense(jobs, world):
    """Output (split or gathered), x.grad, and the weight/bias shards' gradients equal the dense layer's slices."""
    judge(jobs, [world], "column", equal_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_row_parallel_equals_dense(jobs, world):
    """Input split or full: output on every rank, x.grad (slice or full), weight-column and bias gradients."""
    judge(jobs, [world], "row", equal_problem)


@pytest.mark.points(2)
def test_row_parallel_bias_added_once(jobs):
    """Zero weights: the output is the bias itself, not world size × bias (added after the all-reduce)."""
    judge(jobs, WORLD_SIZES, "bias-once", equal_problem)


@pytest.mark.points(2)
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_parallel_mlp_equals_dense(jobs, world):
    """ParallelMLP.from_dense(fc1, fc2): output, x.grad and every shard's gradient equal the dense MLP's."""
    judge(jobs, [world], "mlp", equal_problem)


@pytest.mark.points(3)
def test_parallel_mlp_one_all_reduce_forward_one_backward(jobs):
    """2 and 4 ranks: forward starts one all_reduce of batch×seq×hidden floats, backward one, nothing else."""
    judge(jobs, [2, 4], "mlp", collectives_problem)


@pytest.mark.points(1)
def test_sizes_not_divisible_raise_value_error(jobs):
    """ColumnParallelLinear(8, 5) on 2 ranks (and the row/MLP cases): ValueError naming 5 and 2."""
    judge(jobs, [2, 4], "divisible", equal_problem)


@pytest.mark.points(2)
def test_layers_use_their_process_group(jobs):
    """4 ranks as two tensor-parallel groups of 2 (group=...): each group's MLP equals its dense MLP."""
    def problem(rec, world):
        why = collectives_problem(rec, world)
        return why and (f"{why} — with group=..., use that group's size and rank (dist.get_world_size(group), "
                        f"dist.get_rank(group)) and pass group= to every collective")

    judge(jobs, [4], "groups", problem)
