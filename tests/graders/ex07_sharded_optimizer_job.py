"""The grading job of ex07 part 1 (ShardedOptimizer): every case for this job's world size, in one launch.

    ex07_sharded_optimizer_job.py SUBMISSION.py [--case-limit SECONDS]

test_ex07_sharded_optimizer.py launches it on 2 and 4 ranks. Every rank runs the same model on the same
full batch (so the gradients agree, as after DDP's all-reduce) and steps both the submission's
ShardedOptimizer and the plain torch optimizer on a copy; each case logs one record per rank, e.g.

    {"case": "adamw", "group": "equiv", "max_diff": [2e-9, ...], "broadcast_bytes": [8704, ...],
     "param_bytes": [8704, ...], "ops": [{"broadcast": [16, 8704]}, ...], "state_bytes": 17472, "full_state_bytes": 34944}

Cases: adamw and sgd (momentum) on an MLP whose parameters can be balanced exactly (the lr is halved through
param_groups before step 3, as a scheduler would); tied (the same Parameter passed twice); add_group (a second
group with its own lr added after two steps). state_bytes is every tensor the ShardedOptimizer object holds
(found by walking its attributes; parameters and gradients excluded), full_state_bytes the same for the
unsharded optimizer. The collectives are recorded during step() only.
"""
import argparse
import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

import comm_recorder  # beside this script: what a submission communicates
import jobkit  # beside this script: what every grading job shares
from ex07_job_guard import CollectiveGuard, held_tensor_bytes
from gpucourse import runtime

STEPS = 4
TOLERANCE = 1e-5
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


# --- the case -------------------------------------------------------------------------------------------
def case_train(Sharded, guard, optim: str, model: str, add_group: bool = False):
    """STEPS steps of the submission vs the torch optimizer on a copy; lr halved before step 3."""
    cls, kwargs = OPTIMIZERS[optim]
    net = TiedLM() if model == "tied" else mlp()
    ref = copy.deepcopy(net)  # keeps the tie
    x, y, loss_fn = batch(model)
    params = list(net.parameters())
    if model == "tied":  # the tied weight passed twice, as `list(a.parameters()) + list(b.parameters())` would
        params = params + [net.out.weight]
    first = params[:len(params) // 2] if add_group else params
    ref_params = list(ref.parameters())
    with guard.watching():
        opt = Sharded(first, cls, **kwargs)
    ref_opt = cls(ref_params[:len(first)] if add_group else ref_params, **kwargs)
    max_diff, bcast, ops, unexpected, param_bytes = [], [], [], [], []
    for step in range(STEPS):
        if add_group and step == 2:
            with guard.watching():
                opt.add_param_group({"params": params[len(first):], "lr": kwargs["lr"] / 4})
            ref_opt.add_param_group({"params": ref_params[len(first):], "lr": kwargs["lr"] / 4})
        if step == 2 and not add_group:
            for o in (opt, ref_opt):  # what an lr scheduler does
                for g in o.param_groups:
                    g["lr"] = g["lr"] / 2
        for o, n in ((opt, net), (ref_opt, ref)):
            o.zero_grad()
            loss_fn(n(x), y).backward()
        ref_opt.step()
        param_bytes.append(sum(p.numel() * p.element_size() for g in ref_opt.param_groups for p in g["params"]))
        with guard.watching():
            opt.step()
        summary = guard.summary()
        ops.append(summary)
        bcast.append(summary.get("broadcast", [0, 0])[1])
        unexpected.append(sorted(op for op in summary if op != "broadcast"))
        with torch.no_grad():
            max_diff.append(max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters())))
    exclude = grads_and_params(net)
    return {"max_diff": max_diff, "tolerance": TOLERANCE, "broadcast_bytes": bcast,
            "param_bytes": param_bytes, "ops": ops, "other_ops": unexpected,
            "state_bytes": held_tensor_bytes(opt, exclude), "full_state_bytes": held_tensor_bytes(ref_opt, exclude),
            "is_optimizer": isinstance(opt, torch.optim.Optimizer), "world": dist.get_world_size()}


def plan() -> list[tuple[str, str, object]]:
    return [("adamw", "equiv", functools.partial(case_train, optim="adamw", model="mlp")),
            ("sgd", "equiv", functools.partial(case_train, optim="sgd", model="mlp")),
            ("tied", "tied", functools.partial(case_train, optim="adamw", model="tied")),
            ("add_group", "add_group", functools.partial(case_train, optim="adamw", model="mlp", add_group=True))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("submission")
    parser.add_argument("--case-limit", type=float, default=20.0)
    args = parser.parse_args()
    runtime.setup(seed=0)
    log = jobkit.record_writer()  # before the submission is imported: see record_writer
    guard = CollectiveGuard(comm_recorder.install(), FORBID)
    watchdog = jobkit.Watchdog("a deadlock (a broadcast from a rank that the others do not expect, or "
                               "collectives called on some ranks only), an endless loop, or far too slow", log)
    cases = plan()
    log(case="plan", cases={case: group for case, group, _ in cases})
    module = jobkit.import_or_exit(args.submission, "ex07_sharded_optimizer", ["ShardedOptimizer"], guard.watching,
                                   watchdog, args.case_limit, log)
    jobkit.run_cases(cases, (module.ShardedOptimizer, guard), watchdog, args.case_limit, args.submission, log,
                     fields=lambda: {"forbidden_used": guard.forbidden_used})
    runtime.teardown()


if __name__ == "__main__":
    main()
