"""What chapter 04 (large batches) shows, `gpucourse/chapters/ch04.py`, built from hand-made records."""
import pytest

from gpucourse.chapters import ch04


# --- chapter 04 ---------------------------------------------------------------------------------------
RULES = {"keep": "(a) keep η", "warmup": "(c) warmup"}


def run(rule, lr, accs, losses, final_loss=0.5):
    head = {"global_batch": 64, "base_lr": 0.1, "target_lr": lr}
    pts = [{"epoch": e, "opt_step": 10 * i, "step_losses": ls, "test_acc": a, "test_loss": final_loss,
            "seconds": 1.25 * i} for i, (e, a, ls) in enumerate(zip((0.0, 0.5, 1.0, 2.0), accs, losses))]
    return {"header": {**head, "rule": rule}, "points": pts}


def large_batch_runs():
    losses = ([], [2.3, 2.5], [1.0], [0.5])
    base = run("keep", 0.1, (0.1, 0.5, 0.7, 0.9), losses)
    return {1: {"keep": base}, 2: {"keep": run("keep", 0.1, (0.1, 0.4, 0.6, 0.8), losses),
                                   "warmup": run("warmup", 0.2, (0.1, 0.1, 0.1, 0.1), ([], [9.0], [8.0], [7.0]),
                                                 final_loss=float("nan"))}}, base


def test_large_batch_runs_have_a_row_per_world_size_and_rule():
    runs, _ = large_batch_runs()
    df = ch04.large_batch_runs(runs, names=RULES, early=0.5)
    assert list(df.columns) == ["global batch", "lr (after warmup)", "steps", "loss: step 1", "max, epoch 1",
                                "test acc @ epoch 0.5", "final test acc", "final test loss", "time (s)"]
    assert list(df.index) == [(1, "baseline (all rules are one)"), (2, "(a) keep η"), (2, "(c) warmup")]
    row = df.loc[(2, "(c) warmup")]
    assert row["lr (after warmup)"] == 0.2 and row["steps"] == 30 and row["max, epoch 1"] == 9.0
    assert df.loc[(1, "baseline (all rules are one)"), "time (s)"] == 3.8  # 3.75 at one decimal


def test_large_batch_vs_baseline_gives_differences_and_divergence():
    runs, base = large_batch_runs()
    df = ch04.large_batch_vs_baseline(runs, base, names=RULES, early=0.5)
    assert list(df.index) == [(2, "(a) keep η"), (2, "(c) warmup")]
    assert df.loc[(2, "(a) keep η"), "Δ vs 1 rank (early)"] == -0.1
    assert df.loc[(2, "(a) keep η"), "Δ vs 1 rank (final)"] == -0.1
    assert not df.loc[(2, "(a) keep η"), "diverged"] and df.loc[(2, "(c) warmup"), "diverged"]
    assert df.loc[(2, "(c) warmup"), "loss: step 1"] == 9.0


def test_sgd_assumptions_table_shows_percent_and_the_noise_scale():
    measured = {"initial weights": {"g2": 4.0, "b_noise": {32: 8.0, 64: 8.81234}, "trace": 8.4,
                                    "noise_scale": 2.1, "ks": {2: 0.05, 4: 0.2549}}}
    df = ch04.sgd_assumptions(measured)
    assert list(df.columns) == ["‖G‖²", "B×noise, B=32", "B×noise, B=64", "noise scale (samples)",
                                "k=2: k steps vs one (%)", "k=4: k steps vs one (%)"]
    assert df.loc["initial weights", "k=4: k steps vs one (%)"] == 25.0
    assert df.loc["initial weights", "noise scale (samples)"] == 2.1
    assert df.loc["initial weights", "B×noise, B=64"] == 8.81  # three significant digits


# --- chapter 04: large batches ----------------------------------------------------------------------------------------
def test_warmup_lrs_reads_the_schedule_at_step_0_the_end_of_warmup_and_scaled_lr():
    from types import SimpleNamespace

    def warmup_lr(step, *, base_lr, base_batch, global_batch, warmup_steps, total_steps=None):
        target = base_lr * global_batch / base_batch
        return target if step >= warmup_steps else base_lr + (target - base_lr) * step / warmup_steps
    schedule = SimpleNamespace(warmup_lr=warmup_lr, scaled_lr=lambda lr, b, g: lr * g / b)
    kwargs = {n: (dict(base_lr=0.0125, base_batch=32, global_batch=32 * n, warmup_steps=w), t)
              for n, w, t in ((1, 256, 512), (4, 64, 3))}  # 4 ranks: the run ends (step 3) before warmup does
    df = ch04.warmup_lrs(schedule, kwargs)
    assert df.loc[1].tolist() == [32, 256, 0.0125, 0.0125, 0.0125]
    assert df.loc[4, "lr at end of warmup"] == float(f"{0.0125 + 0.0375 * 3 / 64:.5g}")
    assert df.loc[4, "scaled_lr"] == 0.05


def test_best_rules_and_noise_spread():
    runs, _ = large_batch_runs()
    df = ch04.best_rules(runs, names=RULES, early=0.5)
    assert list(df.index) == [2]  # one rank is the baseline, not a contest
    assert df.loc[2, "best at epoch 0.5"] == "(a) keep η" and df.loc[2, "best at the end"] == "(a) keep η"
    assert df.loc[2, "its test acc (end)"] == 0.8
    measured = {"initial weights": {"b_noise": {32: 8.0, 64: 8.81234, 128: 10.0}, "noise_scale": 2.1234}}
    spread = ch04.noise_spread(measured)
    assert spread.loc["initial weights"].tolist() == [1.25, "32..128", 2.12]


LABEL = "cpu · gloo · 4 ranks"


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_lr_schedule_plot_steps_left_epochs_right_cosine_dashed_in_the_same_colour():
    schedules = {"1 rank(s)": {"constant": [1, 2, 2, 2, 2], "cosine": [1, 2, 1.5, 0.5, 0], "steps_per_epoch": 2},
                 "2 rank(s)": {"constant": [1, 4, 4], "cosine": [1, 4, 0], "steps_per_epoch": 1}}
    steps_ax, epochs_ax = ch04.lr_schedule_plot(schedules, title="warmup_lr (reference)").axes
    assert legend_texts(steps_ax) == list(schedules)
    assert len(steps_ax.lines) == len(epochs_ax.lines) == 4  # constant and cosine per world size
    solid, dashed = steps_ax.lines[:2]
    assert dashed.get_linestyle() == "--" and dashed.get_color() == solid.get_color()
    assert list(steps_ax.lines[2].get_xdata()) == [0, 1, 2]
    assert list(epochs_ax.lines[0].get_xdata()) == [0, 0.5, 1, 1.5, 2]  # steps / steps_per_epoch
    assert (steps_ax.get_xlabel(), epochs_ax.get_xlabel()) == ("optimizer step", "epoch")


def lr_run(rule, lr, n, losses, acc):
    """A 04_large_batch.py run of one rule: header and one record per evaluation, two steps per epoch."""
    header = {"rule": rule, "header": True, "global_batch": 32 * n, "base_batch": 32, "steps_per_epoch": 4}
    points = [{"epoch": 0.0, "train_loss": None, "test_acc": 0.1, "step_losses": [], "lrs": []}]
    points += [{"epoch": (i + 1) / 2, "train_loss": sum(pair) / 2, "test_acc": a, "step_losses": list(pair),
                "lrs": [lr, lr]} for i, (pair, a) in enumerate(zip(zip(losses[::2], losses[1::2]), acc))]
    return {"header": header, "points": points}


NAMES = {"keep": "(a) keep η", "linear": "(b) scale η × k", "warmup": "(c) scale η × k with warmup"}


def lr_runs():
    baseline = lr_run("keep", 0.1, 1, [2.0, 1.6, 1.2, 1.0], [0.5, 0.7])
    runs = {n: {"keep": lr_run("keep", 0.1, n, [2.0, 1.9, 1.8, 1.7], [0.3, 0.4]),
                "linear": lr_run("linear", 0.1 * n, n, [2.0, 9.0, 3.0, 2.0], [0.1, 0.2]),
                "warmup": lr_run("warmup", 0.1 * n, n, [2.0, 1.5, 1.1, 1.0], [0.5, 0.7])} for n in (2, 4)}
    return baseline, runs


def test_lr_rules_plot_a_column_per_world_size_baseline_and_rules_in_each():
    baseline, runs = lr_runs()
    fig = ch04.lr_rules_plot(runs, baseline, names=NAMES, labels={2: "cpu · gloo · 2 ranks", 4: LABEL})
    assert len(fig.axes) == 4  # loss and accuracy, for 2 and 4 ranks
    loss_ax, acc_ax = fig.axes[1], fig.axes[3]  # the 4-rank column
    assert LABEL in loss_ax.get_title() and "global batch 128 = 4 × 32, k = 4" in loss_ax.get_title()
    assert legend_texts(loss_ax) == ["1 rank (baseline)", *NAMES.values()]
    assert loss_ax.get_yscale() == "log" and acc_ax.get_ylim() == (0, 1)
    baseline_line, _, linear, _ = loss_ax.lines
    assert baseline_line.get_linestyle() == "--" and baseline_line.get_color() == "black"
    assert list(linear.get_xdata()) == [0.5, 1.0]  # the point before training (no loss yet) left out
    assert list(linear.get_ydata()) == [5.5, 2.5]
    assert list(acc_ax.lines[2].get_ydata()) == [0.1, 0.1, 0.2]  # accuracy from the first evaluation on
    with pytest.raises(ValueError, match="at least one world size"):
        ch04.lr_rules_plot({}, baseline, names=NAMES, labels={})


def test_running_mean_of_the_last_width_values():
    assert ch04.running_mean([2, 4, 6, 8], 2) == [2, 3, 5, 7]
    assert ch04.running_mean([1.0], 5) == [1.0]
    with pytest.raises(ValueError, match="width"):
        ch04.running_mean([1.0], 0)


def test_first_epoch_plot_raw_and_smoothed_losses_and_each_rules_learning_rate():
    baseline, runs = lr_runs()
    loss_ax, lr_ax = ch04.first_epoch_plot(runs[4], baseline, names=NAMES, label=LABEL).axes
    assert LABEL in loss_ax.get_title() and loss_ax.get_yscale() == "log"
    assert legend_texts(loss_ax) == ["1 rank (baseline)", *NAMES.values()]
    raw, smooth = loss_ax.lines[2], loss_ax.lines[3]  # the "keep" rule: faint raw line, then its running mean
    assert list(raw.get_xdata()) == [0.25, 0.5, 0.75, 1.0]  # one epoch = steps_per_epoch steps
    assert list(raw.get_ydata()) == [2.0, 1.9, 1.8, 1.7] and raw.get_alpha() == 0.25
    assert list(smooth.get_ydata()) == pytest.approx(ch04.running_mean([2.0, 1.9, 1.8, 1.7], 2))
    assert [list(line.get_ydata()) for line in lr_ax.lines] == [[0.1] * 4, [0.1] * 4, [0.4] * 4, [0.4] * 4]
    assert lr_ax.lines[0].get_linestyle() == "--"  # the baseline
