"""Grader of ex07 part 2: FSDP, ZeRO stage 3 by hand (run it with `gpucourse grade ex07`).

Three real jobs (1, 2 and 4 ranks, side by side, through gpucourse.launch; ex07_fsdp_job.py) run every case on
the submission; the tests read their records. What is checked:
- the full parameters (gather_full_params) match one process on the whole batch after each of 3 steps, with
  AdamW and with SGD, for layer sizes that need padding and for a tied embedding;
- each rank's parameters (the shards) hold ~1/N of the model, the wrapper keeps no other copy, and no full
  parameter stays alive after forward (before backward) or after finish_gradient_synchronization;
- forward and backward all-gather and reduce-scatter, and never all-reduce;
- compute_dtype=torch.bfloat16 runs the layers in bf16 with fp32 shards and gradients, and stays close;
- torch's FSDP is not used.
"""
import ast
from pathlib import Path

import pytest

from .job_records import JobRecords, check, launch_jobs

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex07_fsdp_job.py")
WORLD_SIZES = (1, 2, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 150
FORBIDDEN = {"fully_shard", "FullyShardedDataParallel"}


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex07-fsdp-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


# --- what makes one rank's record wrong (None when right) --------------------------------------------
def equiv_problem(rec) -> str | None:
    if rec["missing"]:
        return f"gather_full_params() has no entry for {rec['missing'][0]!r}: use the names of named_parameters()"
    for step, diff in enumerate(rec["max_diff"], 1):
        if not diff <= rec["tolerance"]:  # NaN is wrong too
            return (f"after step {step}, the full parameters differ from one process on the whole batch by "
                    f"{diff:.2g} (tolerance {rec['tolerance']:g}): reduce-scatter the summed gradients, divide by "
                    f"the world size, and put each shard's part in shard.grad")
    return None


def collective_problem(rec) -> str | None:
    for step, ops in enumerate(rec["ops"], 1):
        if "all_reduce" in ops:
            return (f"step {step}: forward/backward called all_reduce ({ops['all_reduce'][0]} times): "
                    f"reduce-scatter the gradients instead, each rank needs only its shard's")
        gathers = sum(v[0] for op, v in ops.items() if "all_gather" in op or op == "_all_gather_base")
        scatters = sum(v[0] for op, v in ops.items() if "reduce_scatter" in op)
        if not gathers:
            return f"step {step}: no all_gather during forward and backward: gather each parameter before use"
        if not scatters:
            return f"step {step}: no reduce_scatter during backward/finish: reduce-scatter the gradients"
        moved = sum(v[1] for op, v in ops.items() if "reduce_scatter" in op)
        if moved < rec["full_bytes"]:
            return (f"step {step}: {moved} bytes were reduce-scattered; the model's gradients hold "
                    f"{rec['full_bytes']}: every gradient must be reduce-scattered")
    return None


def memory_problem(rec) -> str | None:
    world, full, shard = rec["world"], rec["full_bytes"], rec["shard_bytes"]
    padding = 4 * world * rec["params"]  # at most world - 1 padded elements per parameter
    if shard > full / world + padding:
        return (f"this rank's parameters hold {shard} bytes; the model holds {full}, so 1/{world} is "
                f"{full / world:.0f} (+ padding): model.parameters() must be this rank's shards only")
    if rec["held_besides_shards"] > rec["weight_bytes"] // 2:
        return (f"besides its shards the wrapper (and the wrapped modules) hold {rec['held_besides_shards']} bytes "
                f"of tensors between steps: do not keep the full parameters")
    return None


def freed_problem(rec) -> str | None:
    for step, (fwd, fin) in enumerate(zip(rec["after_forward"], rec["after_finish"]), 1):
        if fwd:
            return (f"step {step}: after forward, {fwd} bytes of full-size tensors are still alive (a full weight "
                    f"is {rec['weight_bytes']} bytes): free each gathered parameter after its module's forward and "
                    f"gather it again in backward (saved_tensors_hooks)")
        if fin:
            return (f"step {step}: after finish_gradient_synchronization, {fin} bytes of full-size tensors (full "
                    f"parameters or gradients) are still alive: free them once reduce-scattered")
    return None


def bf16_problem(rec) -> str | None:
    seen = rec["seen"]
    if seen.get("weight") != "torch.bfloat16" or seen.get("input") != "torch.bfloat16":
        return (f"with compute_dtype=torch.bfloat16 the first layer saw input {seen.get('input')} and weight "
                f"{seen.get('weight')}: gather the parameters in bf16 and cast the inputs")
    if rec["shard_dtypes"] != ["torch.float32"] or rec["grad_dtypes"] != ["torch.float32"]:
        return (f"shards {rec['shard_dtypes']}, gradients {rec['grad_dtypes']}: keep fp32 master shards and fp32 "
                f"gradients with compute_dtype")
    return equiv_problem(rec)


# --- the tests ------------------------------------------------------------------------------------
@pytest.mark.points(2)
@pytest.mark.parametrize("case", ["mlp", "mlp-sgd"])
def test_matches_single_process(jobs, case):
    """1, 2, 4 ranks: full parameters after each of 3 steps = one process on the whole batch (padding needed)."""
    check(jobs, [case], equiv_problem)


@pytest.mark.points(1)
def test_tied_parameter(jobs):
    """An embedding tied to the output layer: one shard, gradients of both uses accumulated."""
    check(jobs, ["tied"], equiv_problem)


@pytest.mark.points(2)
def test_parameters_are_sharded(jobs):
    """2 and 4 ranks: each rank holds ~1/N of the parameters, and nothing else of them, between steps."""
    check(jobs, ["memory"], memory_problem, worlds=(2, 4))


@pytest.mark.points(2)
def test_full_parameters_freed(jobs):
    """No full-size tensor survives forward (until backward) or finish_gradient_synchronization."""
    check(jobs, ["memory"], freed_problem, worlds=(2, 4))


@pytest.mark.points(2)
def test_all_gather_and_reduce_scatter_only(jobs):
    """Forward/backward all-gather the parameters and reduce-scatter every gradient; no all_reduce."""
    check(jobs, ["mlp", "tied"], lambda rec: equiv_problem(rec) or collective_problem(rec))


@pytest.mark.points(1)
def test_bf16_compute(jobs):
    """compute_dtype=torch.bfloat16: layers compute in bf16, shards and grads stay fp32, result stays close."""
    check(jobs, ["bf16"], bf16_problem)


@pytest.mark.points(1)
def test_no_torch_fsdp(jobs, submission):
    """torch's fully_shard / FullyShardedDataParallel are neither in the source nor called; the basic case runs."""
    tree = ast.parse(submission.read_text(errors="replace"))
    lines = [node.lineno for node in ast.walk(tree)
             if (isinstance(node, ast.Name) and node.id in FORBIDDEN)
             or (isinstance(node, ast.Attribute) and node.attr in FORBIDDEN)
             or (isinstance(node, ast.ImportFrom) and any(a.name in FORBIDDEN for a in node.names))]
    assert not lines, f"the submission uses torch's FSDP (line {lines[0]}): shard the parameters yourself"
    used = [c for job in jobs.values() for c in job.cases() for rec in job.ranks(c) if rec.get("forbidden_used")]
    assert not used, f"case {used[0]} called torch's FSDP"
    check(jobs, ["mlp"], equiv_problem)
