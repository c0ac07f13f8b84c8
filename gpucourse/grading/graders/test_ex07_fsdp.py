"""Grader of ex07 part 2: FSDP, ZeRO stage 3 by hand (run it with `gpucourse grade ex07`).

Three real jobs (1, 2 and 4 ranks, side by side, through gpucourse.launch; ex07_fsdp_job.py) run every case on
the submission and save what it produced (the full parameters after each step, raw); the tests compare that, here
in the grader process, with one process training the unwrapped model (`CASES.reference`). What is checked:
- the full parameters (gather_full_params) match one process on the whole batch after each of 3 steps, with
  AdamW and with SGD, for layer sizes that need padding and for a tied embedding;
- each rank's parameters (the shards) hold ~1/N of the model, the wrapper keeps no other copy, and no full
  parameter stays alive after forward (before backward) or after finish_gradient_synchronization;
- forward and backward all-gather and reduce-scatter, and never all-reduce;
- compute_dtype=torch.bfloat16 runs the layers in bf16 with fp32 shards and gradients, and stays close;
- torch's FSDP is not used.
"""
import ast
import functools
from pathlib import Path

import pytest

from gpucourse.grading.records import JobRecords, check, job_module, launch_jobs, raw

pytestmark = pytest.mark.grader

JOB = Path(__file__).with_name("ex07_fsdp_job.py")
CASES = job_module(JOB)  # its models, batches and optimizers: the one-process reference is trained here
TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2  # bf16 keeps ~3 significant digits: SGD steps from weights ~0.3 stay well within this
WORLD_SIZES = (1, 2, 4)
CASE_LIMIT_S = 20
JOB_TIMEOUT_S = 150
FORBIDDEN = {"fully_shard", "FullyShardedDataParallel"}


@pytest.fixture(scope="module")
def jobs(submission) -> dict[int, JobRecords]:
    return launch_jobs(JOB, submission, WORLD_SIZES, name="grade-ex07-fsdp-w{world}", case_limit=CASE_LIMIT_S,
                       timeout=JOB_TIMEOUT_S, stall_timeout=3 * CASE_LIMIT_S, env={"OMP_NUM_THREADS": "1"})


def how(case: str) -> dict:
    return next(how for name, _, how in CASES.PLAN if name == case)


@functools.lru_cache(maxsize=None)
def reference(model: str, optim: str = "adamw") -> list[dict]:
    """One process training the unwrapped model on the whole batch, here: {name: parameter} after each step."""
    return CASES.reference(model, optim)


def full_bytes(model: str) -> int:
    """The fp32 bytes of the model's parameters (as built, before any wrapping)."""
    return sum(p.numel() * 4 for p in CASES.build(model).parameters())


# --- what makes one rank's record wrong (None when right) --------------------------------------------
def equiv_problem(rec) -> str | None:
    setup = how(rec["case"])
    want = reference(setup["model"], setup.get("optim", "adamw"))
    tolerance = BF16_TOLERANCE if setup.get("compute_dtype") is not None else TOLERANCE
    got = raw(rec)["full"]
    if len(got) != len(want):
        return f"{len(got)} steps recorded, {len(want)} expected"
    for step, (full, ref) in enumerate(zip(got, want), 1):
        missing = [n for n in ref if n not in full]
        if missing:
            return f"gather_full_params() has no entry for {missing[0]!r}: use the names of named_parameters()"
        wrong = [n for n, p in ref.items() if full[n].shape != p.shape]
        if wrong:
            return (f"gather_full_params()[{wrong[0]!r}] has shape {tuple(full[wrong[0]].shape)}, the parameter "
                    f"{tuple(ref[wrong[0]].shape)}: drop the padding and reshape")
        diff = max((full[n].double() - p.double()).abs().max().item() for n, p in ref.items())
        if not diff <= tolerance:  # NaN is wrong too
            return (f"after step {step}, the full parameters differ from one process on the whole batch by "
                    f"{diff:.2g} (tolerance {tolerance:g}): reduce-scatter the summed gradients, divide by "
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
        want = full_bytes(how(rec["case"])["model"])
        if moved < want:
            return (f"step {step}: {moved} bytes were reduce-scattered; the model's gradients hold "
                    f"{want}: every gradient must be reduce-scattered")
    return None


def memory_problem(rec) -> str | None:
    world, full, shard = rec["world"], full_bytes("memory"), rec["shard_bytes"]
    padding = 4 * world * rec["params"]  # at most world - 1 padded elements per parameter
    if shard > full / world + padding:
        return (f"this rank's parameters hold {shard} bytes; the model holds {full}, so 1/{world} is "
                f"{full / world:.0f} (+ padding): model.parameters() must be this rank's shards only")
    if rec["held_besides_shards"] > CASES.WEIGHT_BYTES // 2:
        return (f"besides its shards the wrapper (and the wrapped modules) hold {rec['held_besides_shards']} bytes "
                f"of tensors between steps: do not keep the full parameters")
    return None


def freed_problem(rec) -> str | None:
    for step, (fwd, fin) in enumerate(zip(rec["after_forward"], rec["after_finish"]), 1):
        if fwd:
            return (f"step {step}: after forward, {fwd} bytes of full-size tensors are still alive (a full weight "
                    f"is {CASES.WEIGHT_BYTES} bytes): free each gathered parameter after its module's forward and "
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
