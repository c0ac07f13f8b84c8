"""Chapter 04, large batches: the tables and figures it shows from its runs.

`notebooks/04_large_batch.ipynb` imports it by its short name:

    from gpucourse.chapters import ch04
    ch04.lr_rules_plot(runs, baseline, names=names, labels=labels)

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure

from ..models import training
from ..viz.plots import log_y
from ..viz.tables import as_table


@as_table
def large_batch_runs(runs: dict, *, names: dict, early: float) -> pd.DataFrame:
    """One row per (world size, rule): global batch, learning rate (after warmup), optimizer steps, the first
    step's loss and the largest step loss of epoch 1, test accuracy at epoch `early` and at the end, the final
    test loss and the run's seconds. runs: {world size: training.curves(...)}; names: {rule: its name}; a
    1-rank run is the baseline (all rules are one there)."""
    rows = []
    for n, by_rule in runs.items():
        for rule, run in by_rule.items():
            h, pts = run["header"], run["points"]
            rows.append({"ranks": n, "rule": "baseline (all rules are one)" if n == 1 else names[rule],
                         "global batch": h["global_batch"],
                         "lr (after warmup)": h["target_lr"] if rule != "keep" else h["base_lr"],
                         "steps": pts[-1]["opt_step"], "loss: step 1": training.first_loss(pts),
                         "max, epoch 1": training.early_max_loss(pts),
                         f"test acc @ epoch {early:.2g}": training.at_epoch(pts, early)["test_acc"],
                         "final test acc": pts[-1]["test_acc"], "final test loss": pts[-1]["test_loss"],
                         "time (s)": pts[-1]["seconds"]})
    return pd.DataFrame(rows).set_index(["ranks", "rule"]).round(
        {"loss: step 1": 2, "max, epoch 1": 2, f"test acc @ epoch {early:.2g}": 3, "final test acc": 3,
         "final test loss": 3, "time (s)": 1})


@as_table
def large_batch_vs_baseline(runs: dict, baseline: dict, *, names: dict, early: float) -> pd.DataFrame:
    """One row per (world size > 1, rule): test accuracy at epoch `early` and at the end, each with its
    difference from the 1-rank baseline, the first step's loss, the largest step loss of epoch 1, and whether
    the run diverged (final test loss not finite, or accuracy under 0.15: chance is 0.1). runs: {world size:
    training.curves(...)}; baseline: the 1-rank run's curve; names: {rule: its name}."""
    base = baseline["points"]
    early_base, final_base = training.at_epoch(base, early)["test_acc"], base[-1]["test_acc"]
    rows = []
    for n, by_rule in runs.items():
        for rule in (names if n > 1 else ()):
            pts = by_rule[rule]["points"]
            acc_early, acc_final = training.at_epoch(pts, early)["test_acc"], pts[-1]["test_acc"]
            rows.append({"ranks": n, "rule": names[rule], f"test acc @ epoch {early:.2g}": acc_early,
                         "Δ vs 1 rank (early)": acc_early - early_base, "final test acc": acc_final,
                         "Δ vs 1 rank (final)": acc_final - final_base, "loss: step 1": training.first_loss(pts),
                         "max, epoch 1": training.early_max_loss(pts),
                         "diverged": not math.isfinite(pts[-1]["test_loss"]) or acc_final < 0.15})
    return pd.DataFrame(rows).set_index(["ranks", "rule"]).round(3)


@as_table
def sgd_assumptions(measured: dict) -> pd.DataFrame:
    """One row per state of the weights: ‖G‖², B × mean ‖g_B − G‖² per batch size B (constant in B where the
    noise goes as 1/B), the noise scale tr(Σ)/‖G‖² (samples), each to three significant digits, and how far k
    small steps end from one k× step (% of that step, whole). measured: training.sgd_assumptions(...)."""
    def g3(v):  # three significant digits: the quantities span orders of magnitude
        return float(f"{v:.3g}")

    rows = []
    for where, m in measured.items():
        rows.append({"weights": where, "‖G‖²": g3(m["g2"]),
                     **{f"B×noise, B={b}": g3(v) for b, v in m["b_noise"].items()},
                     "noise scale (samples)": g3(m["noise_scale"]),
                     **{f"k={k}: k steps vs one (%)": round(100 * r) for k, r in m["ks"].items()}})
    return pd.DataFrame(rows).set_index("weights")


@as_table
def warmup_lrs(schedule, runs: dict) -> pd.DataFrame:
    """One row per world size: the global batch, the warmup steps, and the learning rate the schedule gives at
    step 0, at the end of warmup and as scaled_lr (5 significant digits). schedule: a module with warmup_lr and
    scaled_lr (exercise ex04); runs: {world size: (warmup_lr's keyword arguments, total steps)}."""
    rows = []
    for n, (kwargs, total) in runs.items():
        end = min(kwargs["warmup_steps"], total)
        rows.append({"ranks": n, "global batch": kwargs["global_batch"], "warmup steps": kwargs["warmup_steps"],
                     "lr at step 0": schedule.warmup_lr(0, **kwargs),
                     "lr at end of warmup": schedule.warmup_lr(end, **kwargs),
                     "scaled_lr": schedule.scaled_lr(kwargs["base_lr"], kwargs["base_batch"], kwargs["global_batch"])})
    df = pd.DataFrame(rows).set_index("ranks")
    return df.map(lambda v: float(f"{v:.5g}") if isinstance(v, float) else v)


@as_table
def best_rules(runs: dict, *, names: dict, early: float) -> pd.DataFrame:
    """One row per world size > 1: the rule with the best test accuracy at epoch `early` and the one with the
    best at the end, each with that accuracy. runs: {world size: training.curves(...)}; names: {rule: its name}."""
    rows = []
    for n, by_rule in runs.items():
        if n == 1:
            continue
        acc_early = {rule: training.at_epoch(by_rule[rule]["points"], early)["test_acc"] for rule in names}
        acc_end = {rule: by_rule[rule]["points"][-1]["test_acc"] for rule in names}
        first, last = max(acc_early, key=acc_early.get), max(acc_end, key=acc_end.get)
        rows.append({"ranks": n, f"best at epoch {early:.2g}": names[first], "its test acc (early)": acc_early[first],
                     "best at the end": names[last], "its test acc (end)": acc_end[last]})
    return pd.DataFrame(rows).set_index("ranks").round(3)


@as_table
def noise_spread(measured: dict) -> pd.DataFrame:
    """One row per state of the weights (training.sgd_assumptions): how far B × noise spans over the batch sizes
    (max / min, 1.00 where the noise goes exactly as 1/B) and the noise scale (samples, 3 significant digits)."""
    rows = [{"weights": where,
             "B × noise, max / min": round(max(m["b_noise"].values()) / min(m["b_noise"].values()), 2),
             "batch sizes B": f"{min(m['b_noise'])}..{max(m['b_noise'])}",
             "noise scale (samples)": float(f"{m['noise_scale']:.3g}")} for where, m in measured.items()]
    return pd.DataFrame(rows).set_index("weights")


LR_RULE_COLOURS = {"keep": "tab:blue", "linear": "tab:red", "warmup": "tab:green"}


def lr_schedule_plot(schedules: dict, *, title: str = ""):
    """A learning-rate schedule per world size, against optimizer steps (left) and epochs (right).

    schedules: {name: {"constant": [lr at step 0..T], "cosine": [the same with cosine decay],
    "steps_per_epoch": int}}; the cosine variant is dashed, in its run's colour.
    """
    if not schedules:
        raise ValueError("lr_schedule_plot needs {name: {'constant', 'cosine', 'steps_per_epoch'}}")
    fig = Figure(figsize=(11, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    for name, s in schedules.items():
        steps = list(range(len(s["constant"])))
        for ax, xs in zip(axes, (steps, [x / s["steps_per_epoch"] for x in steps])):
            line, = ax.plot(xs, s["constant"], label=name)
            ax.plot(xs, s["cosine"], "--", color=line.get_color(), lw=1)
    axes[0].set(xlabel="optimizer step", ylabel="learning rate", title=title)
    axes[1].set(xlabel="epoch", ylabel="learning rate", title="the same, against epochs")
    axes[0].legend(fontsize=8)
    return fig


def _rule_lines(baseline: dict, by_rule: dict, names: dict):
    """(curve, style) for the 1-rank baseline (black, dashed) then each rule's run in its colour."""
    yield baseline, {"color": "black", "ls": "--", "lw": 1.5, "label": "1 rank (baseline)"}
    for i, (rule, curve) in enumerate(by_rule.items()):
        yield curve, {"color": LR_RULE_COLOURS.get(rule, f"C{i}"), "lw": 1.5, "label": names.get(rule, rule)}


def lr_rules_plot(runs: dict, baseline: dict, *, names: dict, labels: dict):
    """Training loss (log) and test accuracy against epochs: one column per world size, a line per rule.

    runs: {world size: {rule: {"header": {...}, "points": [records]}}} as 04_large_batch.py logs them (rank
    0), without the 1-rank run; baseline: the 1-rank run's {"header", "points"}, dashed black in every column.
    names: {rule: legend name}; labels: {world size: plots.run_label of that run}.
    """
    if not runs:
        raise ValueError("lr_rules_plot needs the runs of at least one world size above 1")
    fig = Figure(figsize=(5.5 * len(runs), 7), layout="constrained")
    axes = fig.subplots(2, len(runs), sharex=True, squeeze=False)
    for col, (n, by_rule) in enumerate(runs.items()):
        loss_ax, acc_ax = axes[0][col], axes[1][col]
        for curve, style in _rule_lines(baseline, by_rule, names):
            pts = [p for p in curve["points"] if p["train_loss"] is not None]
            loss_ax.plot([p["epoch"] for p in pts], [p["train_loss"] for p in pts], **style)
            acc_ax.plot([p["epoch"] for p in curve["points"]], [p["test_acc"] for p in curve["points"]], **style)
        h = next(iter(by_rule.values()))["header"]
        log_y(loss_ax)
        loss_ax.set(ylabel="training loss", title=f"{labels.get(n, '')}\nglobal batch {h['global_batch']} = "
                    f"{n} × {h['base_batch']}, k = {h['global_batch'] // h['base_batch']}")
        acc_ax.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
        acc_ax.axhline(0.1, color="0.7", lw=0.8)
        acc_ax.text(0.02, 0.11, "chance", color="0.5", fontsize=8, transform=acc_ax.get_yaxis_transform())
        loss_ax.legend(fontsize=8)
    return fig


def running_mean(values, width: int) -> list[float]:
    """The mean of the last `width` values at each position (fewer at the start)."""
    if width < 1:
        raise ValueError(f"width must be at least 1, not {width}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def first_epoch_plot(by_rule: dict, baseline: dict, *, names: dict, label: str = ""):
    """The first epoch step by step: each step's loss (faint, with a running mean over ~1/32 epoch) and the
    learning rate each rule used. by_rule, baseline, names: as lr_rules_plot's, for one world size."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    loss_ax, lr_ax = fig.subplots(1, 2)
    for curve, style in _rule_lines(baseline, by_rule, names):
        spe = curve["header"]["steps_per_epoch"]
        losses = [x for p in curve["points"] for x in p["step_losses"]][:spe]
        lrs = [x for p in curve["points"] for x in p["lrs"]][:spe]
        epochs = [(i + 1) / spe for i in range(len(losses))]
        loss_ax.plot(epochs, losses, color=style["color"], alpha=0.25, lw=0.8)
        loss_ax.plot(epochs, running_mean(losses, max(2, spe // 32)), color=style["color"], lw=1.5,
                     label=style["label"])
        lr_ax.plot(epochs, lrs, color=style["color"], lw=1.5, ls=style.get("ls", "-"), label=style["label"])
    log_y(loss_ax)
    loss_ax.set(xlabel="epoch", ylabel="loss of each step", title=f"first epoch, {label}" if label else "first epoch")
    lr_ax.set(xlabel="epoch", ylabel="learning rate", title="learning rate of each step")
    loss_ax.legend(fontsize=8)
    return fig
