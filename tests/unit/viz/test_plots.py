"""The figures several chapters draw (gpucourse/viz/plots.py), built from synthetic records: titles say where the
numbers came from, axes are right. One chapter's figures: tests/unit/chapters/."""
import json

from matplotlib.figure import Figure
import pytest

from gpucourse import plots
from gpucourse.run.result import load_run

LABEL = "cpu · gloo · 4 ranks"


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


def test_run_label_of_one_rank_says_rank(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({"device": "cpu", "backend": "gloo", "world_size": 1,
                                                        "status": "ok"}))
    (tmp_path / "metrics" / "rank0.jsonl").write_text(json.dumps({"rank": 0, "event": "setup", "device": "cpu"}))
    assert plots.run_label(load_run(tmp_path)) == "cpu · gloo · 1 rank"


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


# --- the chapter figures moved out of the notebooks ----------------------------------------------


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
