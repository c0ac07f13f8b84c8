"""Chapter 05's readings of its runs (gpucourse/models/pipeline.py), on timelines and records made by hand."""
import pytest

from gpucourse.models import costs
from gpucourse.models import pipeline

NOMINAL = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def gpipe(p, m, durations=NOMINAL, stage_names=True):
    """GPipe's order on p ranks, replayed: every forward, then every backward."""
    orders = {r: [f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)] for r in range(p)}
    timeline = costs.simulate_pipeline(orders, durations)
    if stage_names:
        return timeline
    return {r: [(a[len(str(r)):], s, e) for a, s, e in spans] for r, spans in timeline.items()}


def test_bubble_rows_equal_the_formula_on_a_nominal_timeline_and_the_summary_reads_them():
    timelines = {(2, "gpipe", m): gpipe(2, m, stage_names=False) for m in (1, 2, 4)}
    timelines[2, "1f1b", 1] = gpipe(2, 1, {"F": 1.0, "B": 4.0}, stage_names=False)  # slower backward: same bubble
    timelines[2, "1f1b", 4] = gpipe(2, 4, {"F": 1.0, "B": 2.0, "1F0": 3.0}, stage_names=False)  # one late action
    rows = pipeline.bubble_rows(timelines, work_ms=1.0)
    by = {(r["kind"], r["m"]): r for r in rows}
    for m in (1, 2, 4):
        assert by["gpipe", m]["measured"] == pytest.approx(1 / (m + 1)) == pytest.approx(by["gpipe", m]["formula"])
        assert by["gpipe", m]["ideal_ms"] == (m + 1) * 3 and by["gpipe", m]["step_ms"] == pytest.approx((m + 1) * 3)
    assert by["1f1b", 4]["measured"] > by["1f1b", 4]["formula"]
    summary = pipeline.bubble_summary([r for r in rows if r["m"] != 2])  # m = 2's 1 - 6/9 is an ulp above 1/3
    assert summary["above"] == 1 and summary["configurations"] == 4
    assert summary["largest_difference"] == pytest.approx(by["1f1b", 4]["measured"] - 0.2)
    assert summary["falling"] == [(2, "gpipe"), (2, "1f1b")] and not summary["one_m"]
    assert summary["gpipe_1f1b_gap"] == pytest.approx(by["1f1b", 4]["measured"] - 0.2)
    with pytest.raises(ValueError, match="actions on every rank"):
        pipeline.bubble_rows({(2, "gpipe", 1): {0: [], 1: []}}, work_ms=1.0)


def test_replay_gives_the_schedules_own_bubble_or_the_measured_durations_with_free_messages():
    measured = gpipe(2, 4, {"F": 1.5, "B": 2.5})  # every action slower than its nominal sleep
    measured = {r: [(a, s + 0.3 * i, e + 0.3 * i) for i, (a, s, e) in enumerate(spans)]
                for r, spans in measured.items()}
    assert pipeline.stages_per_rank(measured) == 1
    nominal = pipeline.replay(measured, work_ms=1.0)
    assert nominal == gpipe(2, 4)
    free = pipeline.replay(measured, work_ms=1.0, measured=True)
    assert free == gpipe(2, 4, {"F": 1.5, "B": 2.5})
    interleaved = {0: [("0F0", 0, 1), ("2F0", 2, 3)], 1: [("1F0", 1, 2)]}
    assert pipeline.stages_per_rank(interleaved) == 2
    assert pipeline.nominal_durations(20, v=2) == {"F": 10, "B": 20, "I": 10, "W": 10}


def test_stage_activation_rows_hold_the_rule_and_flag_a_stage_that_does_not():
    def rec(rank, kind, m, held):
        return {"rank": rank, "schedule": kind, "m": m, "peak_micro": held, "peak_bytes": held * 100,
                "saved_bytes": [100] * m}
    records = {2: [rec(0, "gpipe", 4, 4), rec(1, "gpipe", 4, 4), rec(0, "1f1b", 4, 2), rec(1, "1f1b", 4, 2)]}
    rows = pipeline.stage_activation_rows(records, [4])
    assert [(r["schedule"], r["rule"], r["matches"]) for r in rows] == [("gpipe", [4, 4], True),
                                                                        ("1f1b", [2, 1], False)]
    with pytest.raises(ValueError, match="no records of gpipe with m=8"):
        pipeline.stage_activation_rows(records, [8])


def test_gpipe_check_verdict_says_what_ran_how_close_and_what_is_missing():
    def rec(name, diff=1e-9, error=None):
        return {"pipeline": name, "max_grad_diff": diff, "error": error}
    ok = {0: [rec("gpipe_step"), rec("torch ScheduleGPipe")], 1: [rec("gpipe_step", 3e-9), rec("torch ScheduleGPipe")]}
    assert pipeline.gpipe_check_verdict(ok, "ex.py").startswith(
        "2 of 2 pipelines ran (gpipe_step, torch ScheduleGPipe): gradients within 3.0e-09")
    missing = {0: [rec("gpipe_step", error="NotImplementedError"), rec("torch ScheduleGPipe")]}
    text = pipeline.gpipe_check_verdict(missing, "ex.py")
    assert text.startswith("1 of 2 pipelines ran (torch ScheduleGPipe)") and "ex.py is not written yet" in text
    assert "look for a bug" in pipeline.gpipe_check_verdict({0: [rec("gpipe_step", 0.5)]}, "ex.py")


def test_schedule_bubbles_replay_exactly_the_formula_and_the_checks_name_a_run_that_does_not():
    runs = pipeline.schedule_records({0: [{"schedule": "GPipe", "m": 4, "error": None}, {"other": 1}],
                                      1: [{"schedule": "GPipe", "m": 4, "error": None}]})
    assert list(runs) == [("GPipe", 4)] and set(runs["GPipe", 4]) == {0, 1}
    late = {r: [(a, s + 0.5, e + 0.5) for a, s, e in spans] for r, spans in gpipe(2, 4).items()}
    bad_order = {r: [f"{r}{k}{i}" for i in range(4) for k in "FB"] for r in (0, 1)}  # one micro-batch at a time
    table = pipeline.schedule_bubbles({("GPipe", 4): late, ("1F1B", 4): costs.simulate_pipeline(bad_order, NOMINAL),
                                       ("ZBVZeroBubble", 4): gpipe(2, 4)}, p=2, work_ms=1.0)
    assert table["GPipe", 4]["nominal"] == pytest.approx(table["GPipe", 4]["f_ratio"]) == pytest.approx(0.25)
    assert table["GPipe", 4]["busy"] == pytest.approx(12) and "f_ratio" not in table["ZBVZeroBubble", 4]
    checks = pipeline.schedule_bubble_checks(table, p=2)
    assert checks["full"] == [("GPipe", 4), ("1F1B", 4)] == checks["required"]
    assert checks["exact"] == [("GPipe", 4)]  # the serial "1F1B" idles as long as it works, not (p-1)/m
    assert checks["over"][0] == pytest.approx(table["GPipe", 4]["ratio"] - 0.25)


def test_action_overheads_timeline_idle_and_chunk_activations():
    timeline = {0: [("0F0", 0, 1.5), ("0B0", 1.5, 3.5)], 1: [("1F0", 1.5, 2.5), ("1B0", 2.5, 5.5)]}
    assert pipeline.action_overheads({"GPipe": timeline}, work_ms=1.0) == {
        "GPipe": {"F": (pytest.approx(0.25), 2), "B": (pytest.approx(0.5), 2)}}
    block = {0: [("0F1", 0, 3), ("3B0", 0, 3)], 1: [("1F0", 1, 2)]}  # an overlapped pair counts once
    assert pipeline.timeline_idle({"blocks": block}) == {"blocks": (3, {0: 0, 1: 2})}
    runs = {("1F1B", 4): {r: {"error": None, "stages": [r], "peak_chunks": held, "peak_bytes": held * 10,
                              "chunk_bytes": [10]} for r, held in ((0, 2), (1, 2))},
            ("DualPipeV", 1): {0: {"error": "ValueError: needs m >= 2p"}}}
    rows = pipeline.chunk_activation_rows(runs, p=2)
    assert [(r["rank"], r["formula"], r["matches"]) for r in rows] == [(0, 2, True), (1, 1, False)]


def test_v_shaped_schedules_are_refused_before_any_send_on_a_torch_that_sends_a_stage_to_itself(monkeypatch):
    """torch 2.11 starts ZBVZeroBubble and DualPipeV with a send from a rank to itself, which kills a gloo job
    ("Pair is not connected": seen on a GPU machine's 2.11 and here on CPU): 05_schedules.py records why instead,
    before it builds a stage (no process group here: any send would fail)."""
    import importlib.util
    from types import SimpleNamespace

    from gpucourse.run import hardware

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("schedules_05", ROOT / "scripts" / "05_schedules.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert hardware.torch_release("2.11.0+cu130") == (2, 11) < script.V_SHAPED_SINCE <= hardware.torch_release("2.12.0")
    monkeypatch.setattr(hardware, "torch_release", lambda version=None: (2, 11))
    ctx, args = SimpleNamespace(rank=0, world_size=2), SimpleNamespace(virtual=2)
    for name in script.V_SHAPED:
        assert "needs torch >= 2.12" in script.run(name, None, ctx, args, 4, None, None)["error"]
