"""What chapter 05 (pipeline parallelism) shows, `gpucourse/chapters/ch05.py`, built from hand-made records."""
import math

import pytest

from gpucourse.chapters import ch05
from gpucourse.models import costs


# --- chapter 05: pipeline parallelism ---------------------------------------------------------------
def test_pipeline_orders_bubbles_and_stage_activations_show_the_runs_numbers():
    orders = ch05.pipeline_orders(lambda kind, s, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)],
                                    ("gpipe",), p=2, m=2)
    assert orders.loc[("gpipe", 1), "actions, in order"] == "F0 F1 B0 B1"
    df = ch05.pipeline_bubbles([{"p": 2, "kind": "gpipe", "m": 4, "measured": 0.2614, "formula": 0.2,
                                   "step_ms": 180.3, "ideal_ms": 150}])
    assert df.loc[(2, "gpipe", 4)].tolist() == [26.1, 20.0, 180, 150]
    assert list(df.columns) == ["bubble measured (%)", "(p-1)/(m+p-1) (%)", "step (ms)", "(m+p-1)·3·work (ms)"]
    held = ch05.stage_activations([{"p": 2, "schedule": "1f1b", "m": 4, "held": [2, 1], "bytes": [32768, 24576],
                                      "rule": [2, 1], "matches": False}])
    assert held.loc[(2, "1f1b", 4), "saved (KiB, by stage)"] == [32, 24]
    assert held.loc[(2, "1f1b", 4), "matches the rule"] == "✗"
    real = ch05.pipeline_real_compute({4: {0: [("F0", 0, 4), ("B0", 4, 12)], 1: [("F0", 4, 8), ("B0", 8, 16)]}}, p=2)
    assert real.loc[4, "(p-1)/(m+p-1) (%)"] == 20.0 and real.loc[4, "F+B per micro-batch, stage 1 (ms)"] == 3.0
    assert real.loc[4, "bubble measured (%)"] == 25.0


def test_gpipe_check_and_schedule_runs_show_losses_differences_and_refusals():
    metrics = {0: [{"pipeline": "gpipe_step", "error": "NotImplementedError: write it\nmore", "loss": None}],
               1: [{"pipeline": "torch ScheduleGPipe", "error": None, "max_grad_diff": 3e-9, "loss": 1.05,
                    "ref_loss": 1.06}, {"other": 1}]}
    df = ch05.gpipe_check(metrics)
    assert df.loc[(0, "gpipe_step"), "error"] == "NotImplementedError: write it"
    assert df.loc[(1, "torch ScheduleGPipe"), "unsplit loss"] == 1.06
    ok = {"error": None, "stages": [0, 2], "max_grad_diff": 1e-18, "loss": 0.5, "ref_loss": 0.5}
    runs = {("Interleaved1F1B", 4): {0: ok, 1: {**ok, "stages": [1, 3], "loss": None, "max_grad_diff": 2e-18}},
            ("1F1B", 1): {0: {"error": "ValueError: too few"}, 1: {"error": "ValueError: too few"}}}
    df = ch05.schedule_runs(runs)
    assert df.loc[("Interleaved1F1B", 4), "stages by rank"] == [[0, 2], [1, 3]]
    assert df.loc[("Interleaved1F1B", 4), "max |grad − unsplit|"] == 2e-18
    assert df.loc[("Interleaved1F1B", 4), "loss"] == "0.500000000000"
    assert df.loc[("1F1B", 1), "refused"] == "ValueError: too few"


def test_schedule_bubbles_versus_1f1b_overheads_and_few_micro_batches():
    row = {"v": 1, "step": 173.2, "busy": 126.4, "share": 0.272, "ratio": 0.374, "free": 0.252, "nominal": 0.25,
           "f_share": 0.2, "f_ratio": 0.25}
    zbv = {**row, "v": 2, "ratio": 0.112, "nominal": 0.042, "step": 151.0}
    del zbv["f_share"], zbv["f_ratio"]
    table = {("1F1B", 4): row, ("ZBVZeroBubble", 4): zbv, ("GPipe", 1): {**row, "ratio": 1.054, "nominal": 1.0}}
    df = ch05.schedule_bubbles(table, refused={("1F1B", 1): "ValueError: too few"})
    assert list(df.index) == [("1F1B", 1), ("1F1B", 4), ("ZBVZeroBubble", 4), ("GPipe", 1)]
    assert df.loc[("1F1B", 1), "refused"] == "ValueError" and df.loc[("1F1B", 4), "idle/work measured (%)"] == 37.4
    assert math.isnan(df.loc[("ZBVZeroBubble", 4), "idle/work formula (%)"])
    vs = ch05.versus_1f1b(table, 4)
    assert vs.loc["ZBVZeroBubble", "measured vs 1F1B"] == "smaller" and list(vs.index) == ["ZBVZeroBubble"]
    extra = ch05.action_overheads({"GPipe": {"F": (0.61, 8), "B": (1.2, 8)}, "ZBV": {"F": (0.5, 16), "W": (0.8, 16)}})
    assert extra.loc["GPipe", "F: extra (ms)"] == 0.6 and extra.loc["ZBV", "W: actions"] == 16
    assert extra["B: actions"].isna().tolist() == [False, True]
    runs = {("GPipe", 1): {0: {"error": None}}, ("1F1B", 1): {0: {"error": "ValueError: m < p"}},
            ("1F1B", 4): {0: {"error": None}}}
    few = ch05.few_micro(runs, table, p=2)
    assert list(few.index) == [(1, "GPipe"), (1, "1F1B")]
    assert few.loc[(1, "1F1B"), "what happened"] == "refused: ValueError: m < p"
    assert few.loc[(1, "GPipe"), "idle/work modelled (%)"] == 100.0 and few.loc[(1, "GPipe"), "(p-1)/m (%)"] == 100.0


def test_dualpipev_idle_chunks_and_stage_costs_tables():
    plan = ch05.dualpipev_plan({1: {0: {"error": "ValueError: m >= 2p"}},
                                  4: {0: {"error": None, "stages": [0, 3], "max_grad_diff": 0.0,
                                          "order": ["0F0", "3B0"]}}})
    assert plan.loc[(1, 0), "plan"] == "refused: ValueError: m >= 2p" and plan.loc[(4, 0), "plan"] == "0F0 3B0"
    idle = ch05.timeline_idle({"measured": (145.44, {0: 16.94, 1: 16.6})})
    assert idle.loc["measured"].tolist() == [145.4, 16.9, 16.6]
    chunks = ch05.chunk_activations([{"schedule": "1F1B", "m": 4, "rank": 0, "chunks": 2, "formula": None,
                                        "micro-batches": 2.0, "bytes": 8192, "matches": True}])
    assert chunks.loc[("1F1B", 4, 0)].tolist() == [2, "—", 2.0, 8, "✓"]
    counted = [{"stage": 0, "params": 10, "flops_per_token": 60}]
    assert ch05.stage_costs(counted, [{"stage": 0, "params": 10, "flops_per_token": 61}]).loc[0].tolist() == [
        10, 10, 60, 61]
    with pytest.raises(ValueError, match="1 counted stages but 2 modelled"):
        ch05.stage_costs(counted, counted * 2)
    cuts = ch05.stage_cuts({"even": [1, 1]}, d_model=8, vocab=16, seq_len=4)
    flops = [st["flops_per_token"] for st in costs.pipeline_stage_costs([1, 1], 8, 16, 4)]
    assert cuts.loc["even", "pace vs balanced (%)"] == round(100 * sum(flops) / 2 / max(flops)) < 100


def test_bubble_plot_ticks_at_the_ms_run_and_draws_the_formula():
    rows = [{"p": 2, "kind": k, "m": m, "measured": 0.5 / m} for k in ("gpipe", "1f1b") for m in (1, 3, 6)]
    (ax,) = ch05.bubble_plot(rows, {2: "cpu · gloo · 2 ranks"}).axes
    formula, gpipe, one_f_one_b = ax.lines
    assert list(formula.get_ydata()) == [costs.pipeline_bubble_fraction(2, m) for m in (1, 3, 6)]
    assert list(gpipe.get_ydata()) == [0.5, 0.5 / 3, 0.5 / 6]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "3", "6"]
    assert not ax.xaxis.get_minor_ticks() or not any(t.label1.get_text() for t in ax.xaxis.get_minor_ticks())
    assert "cpu · gloo · 2 ranks" in ax.get_title()
