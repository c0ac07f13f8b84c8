"""What a training run's records say, and the two assumptions behind the linear scaling rule, measured
(chapter 04: large batches).

    from gpucourse.models import training
    runs = training.curves(result.metrics[0])          # {rule: {"header": {...}, "points": [records]}}
    training.at_epoch(runs["warmup"]["points"], 1.0)   # the evaluation nearest epoch 1
    training.sgd_assumptions(make_model, states, (X, Y), [32, 64], lr=0.0125)   # noise ∝ 1/B, k steps ≈ one
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: chapters' tables read records only
    import torch
    from torch import nn


# --- a run's records ---------------------------------------------------------------------------------
def curves(records: list[dict]) -> dict[str, dict]:
    """{rule: {"header": its header record, "points": its evaluation records in order}} from one rank's records
    (04_large_batch.py logs a header per rule, then records with "test_acc")."""
    out: dict[str, dict] = {}
    for rec in records:
        if rec.get("header"):
            out[rec["rule"]] = {"header": rec, "points": []}
        elif "test_acc" in rec:
            if rec["rule"] not in out:
                raise ValueError(f"a record of rule {rec['rule']!r} comes before its header record")
            out[rec["rule"]]["points"].append(rec)
    return out


def at_epoch(points: list[dict], epoch: float) -> dict:
    """The evaluation record nearest `epoch`."""
    return min(points, key=lambda p: abs(p["epoch"] - epoch))


def early_max_loss(points: list[dict]) -> float:
    """The largest loss of a single step in the first epoch (each averaged over the global batch)."""
    return max(loss for p in points if p["epoch"] <= 1 for loss in p["step_losses"])


def first_loss(points: list[dict]) -> float:
    """The loss of the very first step: the initial weights' loss on that batch."""
    return next(p["step_losses"][0] for p in points if p["step_losses"])


# --- the linear scaling rule's assumptions, measured -----------------------------------------------------
def gradient(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The cross-entropy gradient of all of net's parameters on (x, y), flattened into one vector."""
    import torch
    from torch import nn
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def gradient_noise(net, data, batch: int, draws: int = 32, generator=None) -> tuple[float, float]:
    """(mean of ‖g_B − G‖² over `draws` random batches of `batch` samples, ‖G‖²): G is the full-data gradient.
    data: (inputs, labels); batches are drawn with replacement."""
    import torch
    x, y = data
    full = gradient(net, x, y)
    diffs = []
    for _ in range(draws):
        idx = torch.randint(0, len(x), (batch,), generator=generator)
        diffs.append((gradient(net, x[idx], y[idx]) - full).pow(2).sum().item())
    return sum(diffs) / draws, full.pow(2).sum().item()


def k_steps_vs_one(net, data, k: int, lr: float, batch: int, draws: int = 8, generator=None) -> float:
    """‖k plain SGD steps of lr on k batches − one step of k·lr on their union‖ / ‖that one step‖, averaged over
    `draws` draws, each from net's current weights (restored afterwards)."""
    import torch
    x, y = data
    start = [p.detach().clone() for p in net.parameters()]
    w0 = torch.cat([s.flatten() for s in start])
    ratios = []
    for _ in range(draws):
        batches = [torch.randint(0, len(x), (batch,), generator=generator) for _ in range(k)]
        for idx in batches:  # k small steps
            gradient(net, x[idx], y[idx])
            with torch.no_grad():
                for p in net.parameters():
                    p -= lr * p.grad
        small = torch.cat([p.detach().flatten() for p in net.parameters()])
        with torch.no_grad():
            for p, s in zip(net.parameters(), start):
                p.copy_(s)
        union = torch.cat(batches)
        big_step = -k * lr * gradient(net, x[union], y[union])  # one big step, from the same start
        ratios.append(((small - (w0 + big_step)).norm() / big_step.norm()).item())
    return sum(ratios) / len(ratios)


def sgd_assumptions(make_model, states: dict, data, batches: list[int], *, lr: float, ks=(2, 4),
                    generator=None) -> dict[str, dict]:
    """Both assumptions at each state of the weights. states: {where: state_dict}, loaded into make_model().

    Returns {where: {"g2": ‖G‖², "b_noise": {B: B × mean ‖g_B − G‖²}, "trace": tr(Σ) estimated as the mean of
    b_noise, "noise_scale": tr(Σ)/‖G‖² (samples), "ks": {k: k_steps_vs_one at the smallest batch}}}."""
    if not batches:
        raise ValueError("sgd_assumptions needs at least one batch size")
    measured = {}
    for where, state in states.items():
        net = make_model()
        net.load_state_dict(state)
        noise = {b: gradient_noise(net, data, b, generator=generator) for b in batches}
        b_noise = {b: b * noise[b][0] for b in batches}
        trace, g2 = sum(b_noise.values()) / len(batches), noise[batches[0]][1]
        measured[where] = {"g2": g2, "b_noise": b_noise, "trace": trace, "noise_scale": trace / g2,
                           "ks": {k: k_steps_vs_one(net, data, k, lr, batches[0], generator=generator) for k in ks}}
    return measured
