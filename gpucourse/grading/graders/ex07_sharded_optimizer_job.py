"""The grading job of ex07 part 1 (ShardedOptimizer): every case for this job's world size, in one launch.

    ex07_sharded_optimizer_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex07_sharded_optimizer.py launches it on 2 and 4 ranks. Every rank runs the same model on the same
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
import contextlib
import functools

import torch
from torch import nn

from gpucourse.grading import jobkit  # what every grading job shares
from gpucourse.grading.graders.ex07_job_guard import CollectiveGuard, held_tensor_bytes

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


if __name__ == "__main__":
    jobkit.main(Ex07ShardedJob)
