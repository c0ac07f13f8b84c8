"""What chapter 01 (collectives) shows, `gpucourse/chapters/ch01.py`, built from hand-made records."""
import matplotlib
import pytest

from gpucourse.chapters import ch01
from gpucourse.models import costs


def test_backend_support_says_what_ran_failed_or_was_not_tried():
    metrics = {0: [{"available": {"gloo": True, "nccl": True, "mpi": False}},
                   {"backend": "gloo", "op": "all_reduce", "ok": True, "error": None},
                   {"backend": "gloo", "op": "all_to_all", "ok": False, "error": "gloo does not support it"}],
               1: [{"backend": "gloo", "op": "all_reduce", "ok": False, "error": "rank 1 failed"}]}
    df = ch01.backend_support(metrics, ["all_reduce", "all_to_all"])
    assert df.loc["built in"].tolist() == ["yes", "yes", "no (this PyTorch)"]
    assert df.loc["all_reduce", "gloo"] == "NO: rank 1 failed"  # one rank's failure is the op's failure
    assert df.loc["all_to_all", "gloo"].startswith("NO: gloo does not")
    assert df.loc["all_reduce", "nccl"] == "not tried" and df.loc["all_reduce", "mpi"] == "—"


def test_bytes_per_rank_is_the_cost_model_in_mib():
    df = ch01.bytes_per_rank(["all_reduce", "all_gather"], 64 * 2**20, [2, 1024])
    assert df.loc[2, "all_reduce (MiB)"] == 64.0  # 2(N-1)/N · S
    assert df.loc[1024, "all_gather (MiB)"] == pytest.approx(64 * 1023 / 1024, abs=0.05)


def test_bandwidth_groups_time_and_busbw_by_op_in_the_order_run():
    rows = [{"op": op, "bytes": size, "time_s": t, "busbw": bw} for op, size, t, bw in
            [("all_reduce", 1024, 1e-4, 2e7), ("all_reduce", 2**20, 1e-3, 2e9), ("broadcast", 1024, 5e-5, 1e7)]]
    df = ch01.bandwidth(rows)
    assert [c[0] for c in df.columns] == ["all_reduce", "all_reduce", "broadcast", "broadcast"]
    assert df.loc["1 MiB", ("all_reduce", "time (µs)")] == 1000.0
    assert df.loc["1 KiB", ("broadcast", "busbw (GB/s)")] == 0.01


def test_link_times_puts_this_machine_beside_the_nominal_links():
    fit = costs.AlphaBeta(alpha=1e-5, beta=1e-9, collective="all_reduce", n=2)
    df = ch01.link_times("all_reduce", [2**20], 2, {2**20: 2e-3}, fit)
    assert df.index[-1] == "this machine (measured)" and df.loc["this machine (measured)", "1 MiB (µs)"] == 2000.0
    nvlink = costs.INTERCONNECTS["NVLink 4 (H100 SXM)"]
    assert df.loc[nvlink.name, "1 MiB (µs)"] == round(
        costs.collective_time("all_reduce", 2**20, 2, nvlink.alpha, nvlink.beta) * 1e6, 1)


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


def test_collective_grid_shows_every_rank_before_and_after_with_values():
    fig = ch01.collective_grid(demo_records(), "all_reduce", LABEL)
    before, after = fig.axes
    assert "all_reduce" in fig._suptitle.get_text() and LABEL in fig._suptitle.get_text()
    assert [t.get_text() for t in before.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert sorted(texts(before)) == sorted(f"{10 * r + i:g}" for r in range(4) for i in range(4))
    assert texts(after).count("60") == 4 and texts(after).count("72") == 4  # every rank holds the sums


def test_collective_grid_marks_undefined_results():
    fig = ch01.collective_grid(demo_records(), "reduce", LABEL)
    after = fig.axes[1]
    notes = [t for t in after.texts if t.get_text() == "unspecified"]
    assert len(notes) == 3  # ranks 1-3: reduce only defines the root's tensor


def test_collective_grid_rejects_an_op_without_records():
    with pytest.raises(ValueError, match="no records for op 'all_to_all'"):
        ch01.collective_grid(demo_records(), "all_to_all", LABEL)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_schedule_ends_with_every_chunk_fully_reduced_and_sends_2n_minus_2_chunks(n):
    steps = ch01.ring_schedule(n)
    assert len(steps) == 2 * (n - 1) + 1
    after_rs = steps[n - 1]["counts"]
    # after the reduce-scatter, rank r owns exactly one complete chunk: (r + 1) mod n
    assert [[c for c in range(n) if after_rs[r][c] == n] for r in range(n)] == [[(r + 1) % n] for r in range(n)]
    assert all(count == n for row in steps[-1]["counts"] for count in row)
    assert all(len(st["sent"]) == n for st in steps[1:])  # every rank sends one chunk per step


def test_ring_steps_draws_one_panel_per_step():
    fig = ch01.ring_steps(4)
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
    fig = ch01.bandwidth_plot(rows, fit=fit, holdout={"bytes": 2**12, "time_s": 1e-4, "predicted_s": 1.2e-4},
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
    assert ch01.crossover_bytes(fit) == pytest.approx(4 * 50e-6 / 1e-9, rel=1e-6)


def test_bandwidth_plot_says_when_every_size_is_latency_bound():
    fit = costs.AlphaBeta(1.0, 1e-12, "all_reduce", 4)  # S* far beyond the sizes measured
    fig = ch01.bandwidth_plot(bench_rows(), fit=fit, label=LABEL)
    assert any(t.startswith("latency-bound (all sizes") for t in texts(fig.axes[0]))
    assert "bandwidth-bound" not in texts(fig.axes[0])


def test_bandwidth_plot_needs_rows():
    with pytest.raises(ValueError, match="at least one row"):
        ch01.bandwidth_plot([])


def test_interconnect_plot_hatches_modelled_bars_and_names_the_measured_one():
    times = {8: [("NVLink 4", 18e-6, False), ("100 GbE", 180e-6, False), ("this machine", 2e-3, True)],
             2**20: [("NVLink 4", 22e-6, False), ("100 GbE", 306e-6, False), ("this machine", 4e-3, True)]}
    fig = ch01.interconnect_plot(times, 4, label=LABEL)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert "modelled" in ax.get_title() and "nominal" in ax.get_title() and "4 ranks" in ax.get_title()
        bars = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]
        assert [bool(b.get_hatch()) for b in bars] == [True, True, False]
        assert f"this machine (measured: {LABEL})" in [t.get_text() for t in ax.get_yticklabels()]
