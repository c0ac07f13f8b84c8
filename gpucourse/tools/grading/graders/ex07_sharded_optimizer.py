"""Grader of ex07 part 1: ShardedOptimizer, ZeRO stage 1 by hand (run it with `gpucourse grade ex07`).

Two real jobs (2 and 4 ranks, side by side, through gpucourse.launch; ex07_sharded_optimizer.py) run
every case on the submission and save the parameters after each step; the tests compare them, here in the grader
process, with the plain torch optimizer stepped here on the same model and batch (`reference`). What is
checked:
- the parameters match the plain torch optimizer step by step (AdamW with weight decay, SGD with momentum,
  an lr changed through param_groups), with tied weights passed twice, and after add_param_group;
- each rank holds about 1/N of the optimizer state (every tensor the object holds, weighed by the grader);
- step() broadcasts each parameter's bytes exactly once and starts no other collective (no all_reduce);
- torch's ZeroRedundancyOptimizer is not used.

In each rank (this file, run by torchrun through gpucourse.launch): the grading job of ex07 part 1
(ShardedOptimizer): every case for this job's world size, in one launch.

    ex07_sharded_optimizer.py SUBMISSION.py [--case-limit SECONDS]

The checks below launch it on 2 and 4 ranks. Every rank runs the same model on the same
full batch (so the gradients agree, as after DDP's all-reduce) and steps the submission's ShardedOptimizer;
each case logs one record per rank and saves the parameters after every step raw. The rank judges nothing: the
grader process steps the plain torch optimizer on the same model and batch itself (`reference`) and compares.

    {"case": "adamw", "group": "equiv", "raw": ["params"], "broadcast_bytes": [8704, ...],
     "ops": [{"broadcast": [16, 8704]}, ...], "state_bytes": 17472, "is_optimizer": true}

Cases: adamw and sgd (momentum) on an MLP whose parameters can be balanced exactly (the lr is halved through
param_groups before step 3, as a scheduler would); tied (the same Parameter passed twice); add_group (a second
group with its own lr added after two steps). state_bytes is every tensor the ShardedOptimizer object holds
(found by walking its attributes; parameters and gradients excluded); the grader weighs the unsharded
optimizer's the same way. The collectives are recorded during step() only.
"""
import ast
import contextlib
import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from gpucourse.tools.grading import jobkit  # what every grading job shares
from gpucourse.tools.grading.graders._ex07_guard import CollectiveGuard, held_tensor_bytes
from gpucourse.tools.grading.records import JobRecords, check, launch_jobs, raw

# --- what runs in each rank ----------------------------------------------------------------------------------------
STEPS = 4
FORBID = {"torch.distributed.optim:ZeroRedundancyOptimizer": "write the sharding yourself",
          "torch.distributed.optim.zero_redundancy_optimizer:ZeroRedundancyOptimizer": "write the sharding yourself"}


# --- models -------------------------------------------------------------------------------------------
def mlp() -> nn.Module:
    """8 layers of 16x16: weights and biases in pairs, so largest-first can balance 2 and 4 ranks exactly
    (and giving the parameters out in turn, rank = index % N, cannot)."""
    torch.manual_seed(1)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(16, 16), nn.Tanh())])


TiedLM = functools.partial(jobkit.TiedLM, vocab=32, dim=16, seed=2)


def batch(model: str):
    gen = torch.Generator().manual_seed(3)
    if model == "tied":
        return torch.randint(0, 32, (16,), generator=gen), torch.randint(0, 32, (16,), generator=gen), \
            nn.CrossEntropyLoss()
    return torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen), nn.MSELoss()


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "sgd": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9})}


def grads_and_params(net):
    params = list(net.parameters())
    return params + [p.grad for p in params if p.grad is not None]


# --- the training both sides run: the submission's optimizer in the rank, torch's in the grader ----------------
def setup(optim: str, model: str, add_group: bool):
    """(model, the parameter list given to the optimizer, its first group, x, y, loss_fn, optimizer class, kwargs)."""
    cls, kwargs = OPTIMIZERS[optim]
    net = TiedLM() if model == "tied" else mlp()
    x, y, loss_fn = batch(model)
    params = list(net.parameters())
    if model == "tied":  # the tied weight passed twice, as `list(a.parameters()) + list(b.parameters())` would
        params = params + [net.out.weight]
    first = params[:len(params) // 2] if add_group else params
    return net, params, first, x, y, loss_fn, cls, kwargs


def train(opt_factory, optim: str, model: str, add_group: bool = False, *, watching=None, after_step=None):
    """STEPS steps of the optimizer opt_factory(params, cls, **kwargs) makes; lr halved through param_groups
    before step 3 (add_group: a group with a quarter of the lr added then instead). The submission's calls run
    under `watching` (the grader's guard); after_step(opt, net) after every step. Returns (net, opt)."""
    watch = watching or contextlib.nullcontext
    net, params, first, x, y, loss_fn, cls, kwargs = setup(optim, model, add_group)
    with watch():
        opt = opt_factory(first, cls, **kwargs)
    for step in range(STEPS):
        if add_group and step == 2:
            with watch():
                opt.add_param_group({"params": params[len(first):], "lr": kwargs["lr"] / 4})
        if step == 2 and not add_group:
            for g in opt.param_groups:  # what an lr scheduler does
                g["lr"] = g["lr"] / 2
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        with watch():
            opt.step()
        after_step(opt, net)
    return net, opt


def reference(optim: str, model: str, add_group: bool = False) -> dict:
    """What the unsharded torch optimizer does in one process (the grader's): the parameters after every step,
    the bytes of the parameters it steps, and the tensor bytes of its state at the end."""
    params, param_bytes = [], []

    def after_step(opt, net):
        params.append([p.detach().clone() for p in net.parameters()])
        param_bytes.append(sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"]))

    def unsharded(first, cls, **kwargs):
        return cls(list(dict.fromkeys(first)), **kwargs)  # torch's own optimizer: each parameter once

    net, opt = train(unsharded, optim, model, add_group, after_step=after_step)
    return {"params": params, "param_bytes": param_bytes,
            "full_state_bytes": held_tensor_bytes(opt, grads_and_params(net))}


# --- the case (inside the rank: what the submission did, nothing judged) ------------------------------------
def case_train(Sharded, guard, optim: str, model: str, add_group: bool = False) -> dict:
    params, ops, bcast = [], [], []

    def after_step(opt, net):
        summary = guard.summary()
        ops.append(summary)
        bcast.append(summary.get("broadcast", [0, 0])[1])
        params.append([p.detach().clone() for p in net.parameters()])

    net, opt = train(Sharded, optim, model, add_group, watching=guard.watching, after_step=after_step)
    return {"raw": {"params": params}, "broadcast_bytes": bcast, "ops": ops,
            "state_bytes": held_tensor_bytes(opt, grads_and_params(net)),
            "is_optimizer": isinstance(opt, torch.optim.Optimizer)}


PLAN = [("adamw", "equiv", dict(optim="adamw", model="mlp")),
        ("sgd", "equiv", dict(optim="sgd", model="mlp")),
        ("tied", "tied", dict(optim="adamw", model="tied")),
        ("add_group", "add_group", dict(optim="adamw", model="mlp", add_group=True))]  # (case, group, setup)


class Ex07ShardedJob(jobkit.GradingJob):
    """ex07 part 1's grading job: each case's training with the submission's ShardedOptimizer."""

    name, wanted = "ex07_sharded_optimizer", ("ShardedOptimizer",)
    case_limit = 20.0
    reason = ("a deadlock (a broadcast from a rank that the others do not expect, or collectives called on some "
              "ranks only), an endless loop, or far too slow")

    def make_guard(self, comm) -> CollectiveGuard:
        return CollectiveGuard(comm, FORBID)

    def plan(self) -> list[tuple]:
        return [(case, group, functools.partial(case_train, **how)) for case, group, how in PLAN]

    def case_args(self, module) -> tuple:
        return module.ShardedOptimizer, self.guard

    def fields(self) -> dict:
        return {"forbidden_used": self.guard.forbidden_used}


# --- what the grader process checks -------------------------------------------------------------------------------
pytestmark = pytest.mark.grader

JOB = Path(__file__)  # the ranks run this file
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
def cached_reference(case: str) -> dict:
    """The unsharded torch optimizer on `case`'s model and batch, in this process (the same on every rank)."""
    how = next(how for name, _, how in PLAN if name == case)
    return reference(**how)


# --- what makes one rank's record wrong (None when right) --------------------------------------------
def equiv_problem(rec) -> str | None:
    if not rec["is_optimizer"]:
        return "ShardedOptimizer must be a torch.optim.Optimizer subclass"
    want = cached_reference(rec["case"])["params"]
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
    steps = zip(other_ops, rec["broadcast_bytes"], cached_reference(rec["case"])["param_bytes"])
    for step, (other, got, want) in enumerate(steps, 1):
        if other:
            return (f"step {step} called {', '.join(other)}: after the local update only dist.broadcast from "
                    f"each parameter's owner is needed (no all_reduce of parameters)")
        if got != want:
            return (f"step {step} broadcast {got} bytes; the parameters hold {want}: broadcast "
                    f"each parameter exactly once (a tied weight once), from its owner")
    return None


def memory_problem(rec) -> str | None:
    world, full, mine = rec["world"], cached_reference(rec["case"])["full_state_bytes"], rec["state_bytes"]
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


if __name__ == "__main__":  # in each rank, run by torchrun
    jobkit.main(Ex07ShardedJob)
