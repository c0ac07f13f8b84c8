"""Grader of ex07 part 2: FSDP, ZeRO stage 3 by hand (run it with `gpucourse grade ex07`).

Three real jobs (1, 2 and 4 ranks, side by side, through gpucourse.launch; ex07_fsdp.py) run every case on
the submission and save what it produced (the full parameters after each step, raw); the tests compare that, here
in the grader process, with one process training the unwrapped model (`reference`). What is checked:
- the full parameters (gather_full_params) match one process on the whole batch after each of 3 steps, with
  AdamW and with SGD, for layer sizes that need padding and for a tied embedding;
- each rank's parameters (the shards) hold ~1/N of the model, the wrapper keeps no other copy, and no full
  parameter stays alive after forward (before backward) or after finish_gradient_synchronization;
- forward and backward all-gather and reduce-scatter, and never all-reduce;
- compute_dtype=torch.bfloat16 runs the layers in bf16 with fp32 shards and gradients, and stays close;
- torch's FSDP is not used.

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex07 part 2 (FSDP): every
case for this job's world size, in one launch.

    ex07_fsdp.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it on 1, 2 and 4 ranks. Each rank logs one record per case and saves what the
submission produced raw; the rank judges nothing. The grader process trains the unwrapped model in one process
itself (`reference`) and compares, e.g.

    {"case": "mlp", "group": "equiv", "raw": ["full"], "ops": [{"all_gather_into_tensor": [12, 4096], ...}, ...]}

Cases:
  mlp, tied    N ranks on their slices of a batch of 8 (mean loss); gather_full_params() after each of 3 steps is
               saved raw, for the grader to compare with one process training the unwrapped model with AdamW
               (mlp-sgd: SGD, which, unlike Adam, notices unaveraged gradients) on all 8; the layer
               sizes are not multiples of 4 (padding); tied: an embedding shared with the output layer.
               The collectives of forward + backward + finish_gradient_synchronization are recorded.
  memory       4 layers of 128x128: the bytes of the wrapper's parameters (the shards), tensors the wrapper holds
               besides them, and every tensor of at least one full weight's size created from forward to the end
               of finish_gradient_synchronization (a TorchDispatchMode keeps weak references): how many bytes of
               them are still alive after forward, and after finishing.
  bf16         compute_dtype=torch.bfloat16, SGD: the dtype a layer sees, the shards' and gradients' dtype, and the
               full parameters after each of 3 steps (the grader compares them with the fp32 one-process run).
"""
import ast
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.graders._ex07_guard import CollectiveGuard, held_tensor_bytes
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
STEPS = 3
GLOBAL_BATCH = 8
WHY = "write the sharding yourself"
FORBID = {"torch.distributed.fsdp:fully_shard": WHY, "torch.distributed.fsdp:FullyShardedDataParallel": WHY,
          "torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel": WHY,
          "torch.distributed._composable.fsdp:fully_shard": WHY}
WEIGHT_BYTES = 128 * 128 * 4  # one full weight of the memory case's model


# --- models -----------------------------------------------------------------------------------------
def mlp() -> nn.Module:
    torch.manual_seed(1)  # sizes not divisible by 4: the shards need padding
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3))


TiedLM = functools.partial(jobkit.TiedLM, vocab=30, dim=10, seed=2)


def data(model: str):
    gen = torch.Generator().manual_seed(3)
    if model == "tied":
        return torch.randint(0, 30, (GLOBAL_BATCH,), generator=gen), \
            torch.randint(0, 30, (GLOBAL_BATCH,), generator=gen), nn.CrossEntropyLoss()
    if model == "memory":
        return torch.randn(GLOBAL_BATCH, 128, generator=gen), torch.randn(GLOBAL_BATCH, 128, generator=gen), \
            nn.MSELoss()
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen), nn.MSELoss()


def build(model: str) -> nn.Module:
    if model == "tied":
        return TiedLM()
    if model == "memory":
        torch.manual_seed(4)
        return nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    return mlp()


# --- the reference (in the grader process) and the cases (in the rank) ---------------------------------------
def make_optimizer(name: str, params):
    # SGD as well as AdamW: Adam divides by the gradient's size, so it hides a gradient not averaged over ranks
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def reference(model: str, optim: str = "adamw") -> list[dict]:
    """One process, the unwrapped model on the whole batch: {name: parameter} after each of STEPS steps."""
    net = build(model)
    x, y, loss_fn = data(model)
    opt = make_optimizer(optim, net.parameters())
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return out


def train(FSDP, guard, model: str, optim: str = "adamw", compute_dtype=None):
    """STEPS steps of FSDP on this rank's slice; gather_full_params() after each, saved raw."""
    net = build(model)
    x, y, loss_fn = data(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // world
    mine = slice(rank * local, (rank + 1) * local)
    seen = {}
    first = next(m for m in net.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    first.register_forward_hook(lambda m, args, out: seen.update(
        input=str(args[0].dtype), weight=str(getattr(m, "weight", torch.empty(0)).dtype), output=str(out.dtype)))
    with guard.watching():
        fsdp = FSDP(net) if compute_dtype is None else FSDP(net, compute_dtype=compute_dtype)
    shards = list(fsdp.parameters())
    opt = make_optimizer(optim, shards)
    gathered, ops = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        with guard.watching():
            loss_fn(fsdp(x[mine]), y[mine]).backward()
            fsdp.finish_gradient_synchronization()
        ops.append(guard.summary())
        opt.step()
        with guard.watching():
            full = fsdp.gather_full_params()
        if not isinstance(full, dict):
            raise TypeError(f"gather_full_params() returned a {type(full).__name__}, not a dict of name: tensor")
        gathered.append({str(n): t.detach().clone() if isinstance(t, torch.Tensor) else torch.full((0,), torch.nan)
                         for n, t in full.items()})
    return {"raw": {"full": gathered}, "ops": ops, "seen": seen,
            "shard_dtypes": sorted({str(p.dtype) for p in shards}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in shards if p.grad is not None})}


def case_memory(FSDP, guard):
    net = build("memory")
    x, y, loss_fn = data("memory")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // world
    with guard.watching():
        fsdp = FSDP(net)
    shards = list(fsdp.parameters())
    opt = torch.optim.AdamW(shards, lr=1e-2)
    records = {}
    for step in range(2):
        allocs = jobkit.Allocations(min_numel=128 * 128)  # one full weight
        opt.zero_grad()
        with guard.watching(), allocs:
            loss = loss_fn(fsdp(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local])
            after_forward = allocs.alive_bytes(exclude=shards)
            loss.backward()
            fsdp.finish_gradient_synchronization()
        del loss
        after_finish = allocs.alive_bytes(exclude=shards + [p.grad for p in shards])
        opt.step()
        records[step] = (after_forward, after_finish)
    state = [{k: v for k, v in vars(m).items() if k != "_modules"} for m in fsdp.modules()]
    extra = held_tensor_bytes(state, exclude=shards + [p.grad for p in shards])
    return {"shard_bytes": sum(p.numel() * p.element_size() for p in shards), "params": len(shards),
            "after_forward": [r[0] for r in records.values()], "after_finish": [r[1] for r in records.values()],
            "held_besides_shards": extra}


PLAN = [("mlp", "equiv", dict(model="mlp")),
        ("mlp-sgd", "equiv", dict(model="mlp", optim="sgd")),
        ("tied", "tied", dict(model="tied")),
        ("memory", "memory", None),
        ("bf16", "bf16", dict(model="mlp", optim="sgd", compute_dtype=torch.bfloat16))]  # (case, group, train's)


class Ex07FsdpJob(jobkit.GradingJob):
    """ex07 part 2's grading job: training, memory and bf16 cases with the submission's FSDP."""

    name, wanted = "ex07_fsdp", ("FSDP",)
    case_limit = 20.0
    reason = ("a deadlock (a collective some ranks call and others do not, e.g. a gather in backward on one rank "
              "only), an endless loop, or far too slow")

    def make_guard(self, comm) -> CollectiveGuard:
        return CollectiveGuard(comm, FORBID)

    def plan(self) -> list[tuple]:
        return [(case, group, case_memory if how is None else functools.partial(train, **how))
                for case, group, how in PLAN]

    def case_args(self, module) -> tuple:
        return module.FSDP, self.guard

    def fields(self) -> dict:
        return {"forbidden_used": self.guard.forbidden_used}


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
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
    return next(how for name, _, how in PLAN if name == case)


@functools.lru_cache(maxsize=None)
def cached_reference(model: str, optim: str = "adamw") -> list[dict]:
    """One process training the unwrapped model on the whole batch, here: {name: parameter} after each step."""
    return reference(model, optim)


def full_bytes(model: str) -> int:
    """The fp32 bytes of the model's parameters (as built, before any wrapping)."""
    return sum(p.numel() * 4 for p in build(model).parameters())


# --- what makes one rank's record wrong (None when right) --------------------------------------------
def equiv_problem(rec) -> str | None:
    setup = how(rec["case"])
    want = cached_reference(setup["model"], setup.get("optim", "adamw"))
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
    if rec["held_besides_shards"] > WEIGHT_BYTES // 2:
        return (f"besides its shards the wrapper (and the wrapped modules) hold {rec['held_besides_shards']} bytes "
                f"of tensors between steps: do not keep the full parameters")
    return None


def freed_problem(rec) -> str | None:
    for step, (fwd, fin) in enumerate(zip(rec["after_forward"], rec["after_finish"]), 1):
        if fwd:
            return (f"step {step}: after forward, {fwd} bytes of full-size tensors are still alive (a full weight "
                    f"is {WEIGHT_BYTES} bytes): free each gathered parameter after its module's forward and "
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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex07FsdpJob)
