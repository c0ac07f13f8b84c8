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
    assert [t.get_text() for t in ax.legend().get_texts()] == ["formula", "x", "y"]


def test_loss_scale_plot_marks_each_skipped_step_at_its_scale():
    steps = [{"step": 0, "scale": 2.0**28, "overflow": True}, {"step": 1, "scale": 2.0**27, "overflow": True},
             {"step": 2, "scale": 2.0**26, "overflow": False}]
    ax = plots.loss_scale_plot(steps, "cpu, gloo, 1 rank").axes[0]
    used, skipped = ax.lines
    assert list(used.get_ydata()) == [28, 27, 26] and list(skipped.get_xdata()) == [0, 1]
    assert list(skipped.get_ydata()) == [28, 27] and "cpu, gloo, 1 rank" in ax.get_title()
    assert list(ax.get_yticks()) == [26, 27, 28]


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
