"""The chapter figures, built from synthetic records: titles say where the numbers came from, axes are right."""
import json

import matplotlib
from matplotlib.figure import Figure
import pytest

from gpucourse import costs, plots
from gpucourse.run.result import load_run

LABEL = "cpu · gloo · 4 ranks"


def demo_records(world=4):
    """What 01_collectives_demo.py logs for all_reduce and reduce on `world` ranks."""
    start = {r: [10.0 * r + i for i in range(world)] for r in range(world)}
    total = [sum(start[r][i] for r in range(world)) for i in range(world)]
    recs = [{"rank": r, "op": "all_reduce", "before": start[r], "after": total} for r in range(world)]
    recs += [{"rank": r, "op": "reduce", "before": start[r], "after": total if r == 0 else start[r],
              "defined": r == 0} for r in range(world)]
    return recs


def texts(ax):
    return [t.get_text() for t in ax.texts]


def forged_run(tmp_path, planned: str, backend: str, reported: list[str]):
    """A finished run whose launcher planned `planned` and whose ranks reported `reported` in their setup records."""
    (tmp_path / "metrics").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"device": planned, "backend": backend, "world_size": 2, "status": "ok"}))
    for rank, device in enumerate(reported):
        setup = {"rank": rank, "event": "setup", "backend": backend, "device": device}
        (tmp_path / "metrics" / f"rank{rank}.jsonl").write_text(json.dumps(setup) + "\n")
    return load_run(tmp_path)


@pytest.mark.parametrize("planned, backend, reported, label", [
    ("cuda", "nccl", ["cuda:0", "cuda:1"], "cuda · nccl · 2 ranks"),
    # chapter 05/07 scripts on a GPU machine: gloo ranks kept on the CPU (runtime.setup(cuda_with_gloo=False))
    ("cuda", "gloo", ["cpu", "cpu"], "cpu · gloo · 2 ranks"),
    ("cuda", "gloo", ["cuda:0", "cpu"], "cpu+cuda · gloo · 2 ranks"),
    ("cuda", "gloo", [], "device not reported (planned cuda) · gloo · 2 ranks"),  # died before runtime.setup
])
def test_run_label_names_the_device_the_ranks_reported(tmp_path, planned, backend, reported, label):
    assert plots.run_label(forged_run(tmp_path, planned, backend, reported)) == label


def test_collective_grid_shows_every_rank_before_and_after_with_values():
    fig = plots.collective_grid(demo_records(), "all_reduce", LABEL)
    before, after = fig.axes
    assert "all_reduce" in fig._suptitle.get_text() and LABEL in fig._suptitle.get_text()
    assert [t.get_text() for t in before.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert sorted(texts(before)) == sorted(f"{10 * r + i:g}" for r in range(4) for i in range(4))
    assert texts(after).count("60") == 4 and texts(after).count("72") == 4  # every rank holds the sums


def test_collective_grid_marks_undefined_results():
    fig = plots.collective_grid(demo_records(), "reduce", LABEL)
    after = fig.axes[1]
    notes = [t for t in after.texts if t.get_text() == "unspecified"]
    assert len(notes) == 3  # ranks 1-3: reduce only defines the root's tensor


def test_collective_grid_rejects_an_op_without_records():
    with pytest.raises(ValueError, match="no records for op 'all_to_all'"):
        plots.collective_grid(demo_records(), "all_to_all", LABEL)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_schedule_ends_with_every_chunk_fully_reduced_and_sends_2n_minus_2_chunks(n):
    steps = plots.ring_schedule(n)
    assert len(steps) == 2 * (n - 1) + 1
    after_rs = steps[n - 1]["counts"]
    # after the reduce-scatter, rank r owns exactly one complete chunk: (r + 1) mod n
    assert [[c for c in range(n) if after_rs[r][c] == n] for r in range(n)] == [[(r + 1) % n] for r in range(n)]
    assert all(count == n for row in steps[-1]["counts"] for count in row)
    assert all(len(st["sent"]) == n for st in steps[1:])  # every rank sends one chunk per step


def test_ring_steps_draws_one_panel_per_step():
    fig = plots.ring_steps(4)
    assert len(fig.axes) == 7 and "not a measurement" in fig._suptitle.get_text()


def bench_rows(world=4, alpha=50e-6, beta=1e-9):
    rows = []
    for op in ("all_reduce", "all_gather", "broadcast"):
        for p in range(3, 25, 3):
            t = costs.collective_time(op, 2**p, world, alpha, beta)
            rows.append({"op": op, "bytes": 2**p, "time_s": t, "busbw": costs.busbw(op, 2**p, t, world)})
    return rows


def test_bandwidth_plot_log_axes_one_line_per_op_and_the_model():
    rows = bench_rows()
    fit = costs.fit_alpha_beta([r["bytes"] for r in rows if r["op"] == "all_reduce"],
                               [r["time_s"] for r in rows if r["op"] == "all_reduce"], n=4)
    fig = plots.bandwidth_plot(rows, fit=fit, holdout={"bytes": 2**12, "time_s": 1e-4, "predicted_s": 1.2e-4},
                               label=LABEL)
    t_ax, bw_ax = fig.axes
    for ax in (t_ax, bw_ax):
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert LABEL in ax.get_title()
    named = [line.get_label() for line in bw_ax.lines if not line.get_label().startswith("_")]
    assert named == ["all_reduce", "all_gather", "broadcast"]  # one line per collective
    labels = [line.get_label() for line in t_ax.lines]
    assert labels[:3] == ["all_reduce", "all_gather", "broadcast"]
    assert any(lab.startswith("α–β model of all_reduce") for lab in labels)
    assert any("+20%" in lab for lab in labels)  # the held-out prediction error, (1.2 - 1) / 1
    # S* = N·α/β = 4 · 50 µs / 1 ns = 200 kB lies inside 8 B .. 2 MiB: both regimes are named
    assert {"latency-bound", "bandwidth-bound"} <= set(texts(t_ax))
    assert plots.crossover_bytes(fit) == pytest.approx(4 * 50e-6 / 1e-9, rel=1e-6)


def test_bandwidth_plot_says_when_every_size_is_latency_bound():
    fit = costs.AlphaBeta(1.0, 1e-12, "all_reduce", 4)  # S* far beyond the sizes measured
    fig = plots.bandwidth_plot(bench_rows(), fit=fit, label=LABEL)
    assert any(t.startswith("latency-bound (all sizes") for t in texts(fig.axes[0]))
    assert "bandwidth-bound" not in texts(fig.axes[0])


def test_bandwidth_plot_needs_rows():
    with pytest.raises(ValueError, match="at least one row"):
        plots.bandwidth_plot([])


def test_interconnect_plot_hatches_modelled_bars_and_names_the_measured_one():
    times = {8: [("NVLink 4", 18e-6, False), ("100 GbE", 180e-6, False), ("this machine", 2e-3, True)],
             2**20: [("NVLink 4", 22e-6, False), ("100 GbE", 306e-6, False), ("this machine", 4e-3, True)]}
    fig = plots.interconnect_plot(times, 4, label=LABEL)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert "modelled" in ax.get_title() and "nominal" in ax.get_title() and "4 ranks" in ax.get_title()
        bars = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]
        assert [bool(b.get_hatch()) for b in bars] == [True, True, False]
        assert f"this machine (measured: {LABEL})" in [t.get_text() for t in ax.get_yticklabels()]


# --- charts the chapters call by name --------------------------------------------------------------------
def test_stacked_bars_stack_each_part_on_the_last_and_mark_the_modelled():
    fig = Figure()
    ax = fig.subplots()
    plots.stacked_bars(ax, ["a", "b"], {"x": [1.0, 2.0], "y": [3.0, 4.0]}, totals=[4.0, 7.0], modelled=["b"])
    bars = ax.patches
    assert [(b.get_y(), b.get_height()) for b in bars] == [(0, 1.0), (0, 2.0), (1.0, 3.0), (2.0, 4.0)]
    assert [bool(b.get_hatch()) for b in bars] == [False, True, False, True]  # only b is modelled
    assert list(ax.lines[0].get_ydata()) == [4.0, 7.0]
    legend = ax.legend()
    assert [t.get_text() for t in legend.get_texts()] == ["formula", "x", "y"]
    assert legend.legend_handles[0].get_markersize() < 2 * legend._fontsize  # the sample fits its handle's room


def test_loss_scale_plot_marks_each_skipped_step_at_its_scale():
    steps = [{"scaler_step": 0, "scale": 2.0**28, "overflow": True}, {"scaler_step": 1, "scale": 2.0**27, "overflow": True},
             {"scaler_step": 2, "scale": 2.0**26, "overflow": False}]
    ax = plots.loss_scale_plot(steps, "cpu, gloo, 1 rank").axes[0]
    used, skipped = ax.lines
    assert list(used.get_ydata()) == [28, 27, 26] and list(skipped.get_xdata()) == [0, 1]
    assert list(skipped.get_ydata()) == [28, 27] and "cpu, gloo, 1 rank" in ax.get_title()
    assert list(ax.get_yticks()) == [26, 27, 28]
    many = [{"scaler_step": i, "scale": 2.0**20, "overflow": False} for i in range(18)]
    ticks = plots.loss_scale_plot(many).axes[0].get_xticks()
    assert len(ticks) > 2 and all(float(x).is_integer() for x in ticks)  # whole steps: no 2.5


def test_recomputation_plot_is_relative_to_the_first_mode():
    seqs, modes = [64, 128], ["none", "full"]
    kept = {(64, "none"): 2**20, (128, "none"): 2**21, (64, "full"): 2**18, (128, "full"): 2**19}
    times = {(128, "none"): [1.0, 1.0, 1.2], (128, "full"): [1.3, 1.4, 1.5]}
    flops = {(128, "none"): 300.0, (128, "full"): 400.0}
    fig = plots.recomputation_plot(seqs, modes, kept, times, flops, title="t")
    left, right = fig.axes
    assert list(left.lines[0].get_ydata()) == [1.0, 2.0] and left.get_xscale() == "log"
    assert [t.get_text() for t in left.get_xticklabels()] == ["64", "128"]  # ticks at the lengths run
    full_flops = right.lines[-1]
    assert list(full_flops.get_xdata()) == [0.25] and list(full_flops.get_ydata()) == pytest.approx([4 / 3])


def test_bubble_plot_ticks_at_the_ms_run_and_draws_the_formula():
    rows = [{"p": 2, "kind": k, "m": m, "measured": 0.5 / m} for k in ("gpipe", "1f1b") for m in (1, 3, 6)]
    (ax,) = plots.bubble_plot(rows, {2: "cpu · gloo · 2 ranks"}).axes
    formula, gpipe, one_f_one_b = ax.lines
    assert list(formula.get_ydata()) == [costs.pipeline_bubble_fraction(2, m) for m in (1, 3, 6)]
    assert list(gpipe.get_ydata()) == [0.5, 0.5 / 3, 0.5 / 6]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "3", "6"]
    assert not ax.xaxis.get_minor_ticks() or not any(t.label1.get_text() for t in ax.xaxis.get_minor_ticks())
    assert "cpu · gloo · 2 ranks" in ax.get_title()


def test_saved_memory_plot_ticks_at_the_measured_lengths_only():
    seqs = [64, 128, 256]
    fig = plots.saved_memory_plot(seqs, {"plain": [4e3, 16e3, 64e3], "fused": [1e3, 2e3, 4e3]}, LABEL)
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == seqs and [t.get_text() for t in ax.get_xticklabels()] == ["64", "128", "256"]
    assert ax.get_xscale() == ax.get_yscale() == "log" and LABEL in ax.get_title()
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert {"1 KiB", "4 KiB", "16 KiB"} <= set(labels) and not ax.get_yticklabels(minor=True)  # powers of two
    with pytest.raises(ValueError, match="one byte count for each"):
        plots.saved_memory_plot(seqs, {"plain": [1, 2]})


def test_causal_balance_plot_has_two_panels_with_different_titles():
    balance = {"contiguous": [{"pairs": 3, "seconds": 0.1}, {"pairs": 7, "seconds": 0.3}],
               "zigzag": [{"pairs": 5, "seconds": 0.2}, {"pairs": 5, "seconds": 0.2}]}
    fig = plots.causal_balance_plot(balance, LABEL)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 2 and titles[0] != titles[1] and "exact" in titles[0] and "measured" in titles[1]
    assert [p.get_height() for p in fig.axes[0].patches] == [3, 7, 5, 5]
    assert [p.get_height() for p in fig.axes[1].patches] == pytest.approx([1e5, 3e5, 2e5, 2e5])  # µs
    assert fig.axes[1].get_ylabel() == "µs"
    assert LABEL in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="per rank"):
        plots.causal_balance_plot({})


def test_replica_drift_plot_draws_one_line_per_run():
    recs = [{"sync": True, "rank_spread": [0.0, 0.0]}, {"sync": False, "rank_spread": [0.1, 0.2]}]
    ax = plots.replica_drift_plot(recs, LABEL).axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0.0, 0.0], [0.1, 0.2]]
    assert "all-reduced" in ax.get_legend().get_texts()[0].get_text() and LABEL in ax.get_title()
    with pytest.raises(ValueError, match="cp_training"):
        plots.replica_drift_plot([])


# --- the chapter figures moved out of the notebooks ----------------------------------------------

def named_lines(ax):
    return [line for line in ax.lines if not line.get_label().startswith("_")]


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


class FakeRun:
    """What runs_label reads of a RunResult."""

    def __init__(self, device, backend, world_size):
        self.device, self.manifest, self.world_size = device, {"backend": backend}, world_size


def test_runs_label_names_every_world_size_once():
    runs = [FakeRun("cpu", "gloo", n) for n in (4, 1, 2, 2)]
    assert plots.runs_label(runs) == "cpu · gloo · 1, 2, 4 ranks"
    assert plots.runs_label([FakeRun("cpu", "gloo", 1)]) == "cpu · gloo · 1 rank"
    mixed = [FakeRun("cuda", "nccl", 2), FakeRun("cpu", "gloo", 1)]
    assert plots.runs_label(mixed) == "cuda / cpu · nccl / gloo · 1, 2 ranks"
    with pytest.raises(ValueError, match="at least one run"):
        plots.runs_label([])


def test_equivalence_plot_one_log_line_per_variant_zeros_kept_on_the_axis():
    diffs = {"mean": [0.0, 3e-8, 6e-8], "sum": [1e-3, 2e-3, 4e-3]}
    fig = plots.equivalence_plot(diffs, label=LABEL)
    ax, = fig.axes
    assert ax.get_yscale() == "log" and LABEL in ax.get_title()
    lines = named_lines(ax)
    assert [line.get_label() for line in lines] == ["mean", "sum"] == legend_texts(ax)
    assert list(lines[0].get_xdata()) == [1, 2, 3]  # steps counted from 1
    assert list(lines[0].get_ydata()) == [1e-10, 3e-8, 6e-8]  # a zero difference drawn at the floor
    assert ax.get_ylabel() == "max |θ_DDP − θ_single|" and "float32 rounding" in texts(ax)
    with pytest.raises(ValueError, match="variant"):
        plots.equivalence_plot({})


def test_loss_curves_plot_reference_solid_others_dashed_and_their_difference():
    curves = {"1 process": [2.0, 1.5, 1.0], "2x1 fsdp": [2.0, 1.5 + 1e-7, 1.0 - 2e-7], "1x2 fsdp": [2.0, 1.5, 1.0]}
    fig = plots.loss_curves_plot(curves, reference="1 process", title=f"same losses ({LABEL})", difference=True)
    loss_ax, diff_ax = fig.axes
    assert LABEL in loss_ax.get_title() and legend_texts(loss_ax) == list(curves)
    assert [line.get_linestyle() for line in loss_ax.lines] == ["-", "--", "--"]
    assert list(loss_ax.lines[1].get_ydata()) == curves["2x1 fsdp"]
    assert diff_ax.get_yscale() == "symlog" and diff_ax.get_ylim() == (0, 1e-3)
    assert diff_ax.lines[0].get_ydata().tolist() == [0, 0, 0]
    assert diff_ax.lines[1].get_ydata().tolist() == pytest.approx([0, 1e-7, 2e-7], abs=1e-12)
    assert "1 process" in diff_ax.get_ylabel()


def test_loss_curves_plot_alone_and_its_bad_input():
    fig = plots.loss_curves_plot({"torch DDP": [1, 0.5], "your DDP": [1, 0.5]}, reference="torch DDP",
                                 ylabel="rank 0's loss")
    assert len(fig.axes) == 1 and fig.axes[0].get_ylabel() == "rank 0's loss"
    with pytest.raises(ValueError, match="reference 'x' is not one of"):
        plots.loss_curves_plot({"a": [1]}, reference="x")
    with pytest.raises(ValueError, match="needs a reference"):
        plots.loss_curves_plot({"a": [1]}, difference=True)


def test_lr_schedule_plot_steps_left_epochs_right_cosine_dashed_in_the_same_colour():
    schedules = {"1 rank(s)": {"constant": [1, 2, 2, 2, 2], "cosine": [1, 2, 1.5, 0.5, 0], "steps_per_epoch": 2},
                 "2 rank(s)": {"constant": [1, 4, 4], "cosine": [1, 4, 0], "steps_per_epoch": 1}}
    steps_ax, epochs_ax = plots.lr_schedule_plot(schedules, title="warmup_lr (reference)").axes
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
    fig = plots.lr_rules_plot(runs, baseline, names=NAMES, labels={2: "cpu · gloo · 2 ranks", 4: LABEL})
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
        plots.lr_rules_plot({}, baseline, names=NAMES, labels={})


def test_running_mean_of_the_last_width_values():
    assert plots.running_mean([2, 4, 6, 8], 2) == [2, 3, 5, 7]
    assert plots.running_mean([1.0], 5) == [1.0]
    with pytest.raises(ValueError, match="width"):
        plots.running_mean([1.0], 0)


def test_first_epoch_plot_raw_and_smoothed_losses_and_each_rules_learning_rate():
    baseline, runs = lr_runs()
    loss_ax, lr_ax = plots.first_epoch_plot(runs[4], baseline, names=NAMES, label=LABEL).axes
    assert LABEL in loss_ax.get_title() and loss_ax.get_yscale() == "log"
    assert legend_texts(loss_ax) == ["1 rank (baseline)", *NAMES.values()]
    raw, smooth = loss_ax.lines[2], loss_ax.lines[3]  # the "keep" rule: faint raw line, then its running mean
    assert list(raw.get_xdata()) == [0.25, 0.5, 0.75, 1.0]  # one epoch = steps_per_epoch steps
    assert list(raw.get_ydata()) == [2.0, 1.9, 1.8, 1.7] and raw.get_alpha() == 0.25
    assert list(smooth.get_ydata()) == pytest.approx(plots.running_mean([2.0, 1.9, 1.8, 1.7], 2))
    assert [list(line.get_ydata()) for line in lr_ax.lines] == [[0.1] * 4, [0.1] * 4, [0.4] * 4, [0.4] * 4]
    assert lr_ax.lines[0].get_linestyle() == "--"  # the baseline


def test_tp_split_diagram_colours_each_ranks_block():
    fig = plots.tp_split_diagram(4)
    top, bottom = fig.axes
    assert "column-parallel linear on 4 ranks" in top.get_title() and "row-parallel" in bottom.get_title()
    for block in ("A1", "A4", "Y1", "Y4"):
        assert block in texts(top)
    # row-parallel: X in 4 column blocks, A in 4 row blocks, 4 partial products of the full shape
    assert len(bottom.patches) == 4 + 4 + 4 and len(top.patches) == 1 + 4 + 4
    with pytest.raises(ValueError, match="between 1 and 10"):
        plots.tp_split_diagram(11)


def test_tp_cost_plot_groups_compute_and_one_bar_per_link_per_degree():
    model = {(tp, link): (1e-3 / tp, t * tp) for tp in (2, 4, 8) for link, t in (("NVLink", 1e-5), ("IB", 1e-4))}
    fig = plots.tp_cost_plot(model, title="modelled (nominal link rates)")
    ax, = fig.axes
    assert ax.get_yscale() == "log" and "modelled" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["TP = 2", "TP = 4", "TP = 8"]
    assert legend_texts(ax) == ["compute (assumed throughput)", "communication, NVLink", "communication, IB"]
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([0.5, 0.02, 0.2, 0.25, 0.04, 0.4, 0.125, 0.08, 0.8])  # ms, by degree
    fig.canvas.draw()  # tick labels are plain numbers, never 3×10⁻¹-style
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert labels and not any("10^" in t or "times" in t or "×" in t for t in labels), labels


def test_restart_plot_a_line_per_attempt_over_the_uninterrupted_run():
    from gpucourse import timeline
    clean = [{"step": s, "loss": 1.0 / (s + 1), "total": 6} for s in range(6)]
    killed = [{"step": s, "loss": 1.0 / (s + 1), "attempt": 0} for s in range(4)]
    killed += [{"step": s, "loss": 1.0 / (s + 1), "attempt": 1} for s in range(2, 6)]
    ax, = timeline.restart_plot(clean, killed, kill_at=4, kill_rank=1, label=LABEL).axes
    assert LABEL in ax.get_title() and ax.get_yscale() == "log"
    assert legend_texts(ax) == ["uninterrupted", "killed run, attempt 0", "killed run, attempt 1 (restarted)",
                                "rank 1 SIGKILLed before step 4"]
    assert list(ax.lines[1].get_xdata()) == [0, 1, 2, 3] and list(ax.lines[2].get_xdata()) == [2, 3, 4, 5]
    assert list(ax.lines[3].get_xdata()) == [4, 4]  # the kill
    with pytest.raises(ValueError, match="attempt"):
        timeline.restart_plot(clean, clean, kill_at=4, kill_rank=1)


def test_step_fractions_plot_bars_stack_to_the_whole_step():
    from gpucourse import timeline
    fractions = {"2x1 fsdp": {"step_ms": 40.0, "compute": 0.5, "exposed": 0.3, "other": 0.2, "comm": 0.4},
                 "1x2 fsdp": {"step_ms": 80.0, "compute": 0.25, "exposed": 0.5, "other": 0.25, "comm": 0.5}}
    ax, = timeline.step_fractions_plot(fractions, title=f"compute vs exposed communication ({LABEL})").axes
    assert LABEL in ax.get_title()
    assert [t.get_text() for t in ax.figure.legends[0].get_texts()] == ["compute", "exposed", "other"]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(fractions)
    widths = [p.get_width() for p in ax.patches]
    assert widths == pytest.approx([0.5, 0.3, 0.2, 0.25, 0.5, 0.25])
    assert [p.get_x() for p in ax.patches][:3] == pytest.approx([0, 0.5, 0.8])  # stacked left to right
    assert "80 ms/step, comm 50% of step" in texts(ax)


# --- chapter 11 ---------------------------------------------------------------------------------------
def test_moe_tokens_per_expert_colours_the_experts_over_capacity_and_names_every_colour():
    panels = {"learned": ([10, 30, 12, 12], 1.1), "skewed": ([40, 20, 4, 0], 2.3)}
    fig = plots.moe_tokens_per_expert(panels, capacity_total=20, uniform=16, label=LABEL, title="Tokens per expert")
    assert len(fig.axes) == 2 and LABEL in fig._suptitle.get_text()
    for ax, (counts, aux) in zip(fig.axes, panels.values()):
        bars = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]
        red = [matplotlib.colors.same_color(b.get_facecolor(), "tab:red") for b in bars]
        assert red == [c > 20 for c in counts] and f"{aux:.2f}" in ax.get_title()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == 4 and any("capacity" in t and "20" in t for t in legend)
    colours = {h.get_facecolor()[:3] for h in fig.legends[0].legend_handles if hasattr(h, "get_facecolor")}
    assert {matplotlib.colors.to_rgb("tab:red"), matplotlib.colors.to_rgb("tab:blue")} <= colours


def test_moe_load_balance_draws_one_line_per_method_and_the_even_load():
    fig = plots.moe_load_balance({"none": [4.0, 4.0, 3.9], "bias": [4.0, 2.5, 1.5]}, label=LABEL)
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.lines] == ["none", "bias", "even load (1.0)"]
    assert list(ax.lines[1].get_xdata()) == [1, 2, 3] and LABEL in ax.get_title()
    with pytest.raises(ValueError, match="non-empty"):
        plots.moe_load_balance({"none": []})


# --- chapter 07 -----------------------------------------------------------------------------------------------
def test_model_states_per_rank_draws_a_panel_per_world_size_titled_with_its_backend():
    row = lambda n, mode, mb: {"N": n, "mode": mode, "measured": {"params": mb, "grads": mb, "optimizer": 2 * mb},
                               "model": {"total": 4 * mb}}
    fig = plots.model_states_per_rank([row(2, "ddp", 4e6), row(2, "fsdp2", 2e6), row(4, "ddp", 4e6)],
                                      {2: "CPU, gloo", 4: "CPU, gloo"}, title="t")
    assert [ax.get_title() for ax in fig.axes] == ["2 ranks (CPU, gloo)", "4 ranks (CPU, gloo)"]
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    assert heights[-1] == 8.0  # ddp's optimizer part, MB


def test_hsdp_figure_marks_the_bytes_that_cross_nodes():
    rows = [{"variant": v, "mesh": m, "measured": {"params": 1e6, "grads": 1e6, "optimizer": 2e6}}
            for v, m in (("ddp", "4x1"), ("hsdp", "2x2"))]
    comm = {"ddp": {"all_reduce": {"sent": 3e6}}, "hsdp": {"all_gather": {"sent": 1e6}, "all_reduce": {"sent": 5e5}}}
    fig = plots.hsdp_figure(rows, comm, {"ddp": 3e6, "hsdp": 5e5}, ranks_per_node=2, title="x")
    crosses = fig.axes[1].lines[0]
    assert list(crosses.get_ydata()) == [3.0, 0.5] and "nodes of 2" in crosses.get_label()


# --- chapter 05: pipeline timelines -----------------------------------------------------------------
def test_pipeline_figure_labels_only_bars_that_hold_them_and_wraps_titles_to_the_panel():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from gpucourse import timeline

    dense = {r: [(f"{s}{k}{i}", 13.0 * (3 * i + j), 13.0 * (3 * i + j) + 12) for i in range(10)
                 for j, (s, k) in enumerate(((r, "F"), (r + 2, "B"), (r, "W")))] for r in range(2)}
    wide = {0: [("0F0", 0.0, 240.0), ("0B0", 240.0, 480.0)], 1: [("1F0", 240.0, 480.0)]}
    title = "InterleavedZeroBubble (v=2, m=16), measured: step 480 ms, idle 12.3% of the step, 15.0% of the work"
    panels = [[(dense, title), (wide, "modelled")] for _ in range(2)]  # two columns, as chapter 05 draws
    fig = timeline.pipeline_figure(panels, title="left: measured; right: modelled")
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)], "labels overlap"
        assert ax.get_title(loc="center").count("\n") >= (1 if ax.get_title().startswith("Interleaved") else 0)
        title_box = ax.title.get_window_extent(renderer)
        assert title_box.width <= ax.get_window_extent(renderer).width * 1.05, "a title wider than its panel"
    assert not fig.axes[0].texts and [t.get_text() for t in fig.axes[1].texts] == ["0F0", "0B0", "1F0"]
    # The shared time axis is named once a column, under the last row.
    assert [ax.get_xlabel() for ax in fig.axes] == [""] * 2 + ["time since the step started (ms)"] * 2
