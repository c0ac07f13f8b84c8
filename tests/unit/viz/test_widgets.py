"""Chapter 03's tools: the scaling model's numbers (checked by hand; simulate is costs.ddp_step_time per N), the
simulator and run explorer widgets built headless and redrawn when a control changes."""
import json
import math

import pytest

from gpucourse import costs
from gpucourse.models.scaling import simulate, turning_point
from gpucourse.viz.widgets import FITTED, run_explorer, scaling_simulator

GB = 1e9


# --- the model ---------------------------------------------------------------------------------------
def test_efficiency_is_one_on_one_gpu_and_is_the_throughput_ratio():
    rows = simulate(1e8, 0.05, [1, 2, 4, 8, 64], alpha=1e-5, beta=1 / (10 * GB), batch_per_gpu=32)
    one = rows[0]
    assert one["world_size"] == 1 and one["comm_s"] == 0 and one["efficiency"] == 1.0
    assert one["throughput"] == pytest.approx(32 / 0.05)
    for row in rows:
        assert row["efficiency"] == pytest.approx(row["throughput"] / (row["world_size"] * one["throughput"]))


def test_efficiency_falls_with_world_size_when_communication_dominates():
    # 1 B parameters (4 GB of gradients) over 100 GbE, 10 ms of compute: communication-heavy
    ic = costs.INTERCONNECTS["100 GbE"]
    sizes = [2**k for k in range(11)]
    for overlap in (True, False):
        eff = [r["efficiency"] for r in simulate(1e9, 0.01, sizes, ic.alpha, ic.beta, overlap=overlap)]
        assert all(a > b for a, b in zip(eff, eff[1:])), eff
        assert eff[-1] < 0.05


def test_overlap_is_never_slower_and_helps_when_there_is_compute_to_hide_behind():
    sizes = [1, 2, 8, 64, 1024]
    for compute_s in (1e-3, 0.05, 1.0):
        for bucket in (2**20, 25 * 2**20, 2**30):
            on = simulate(3e8, compute_s, sizes, 5e-6, 1 / (25 * GB), bucket, overlap=True)
            off = simulate(3e8, compute_s, sizes, 5e-6, 1 / (25 * GB), bucket, overlap=False)
            assert all(a["step_s"] <= b["step_s"] for a, b in zip(on, off))
    on = simulate(3e8, 1.0, [8], 5e-6, 1 / (25 * GB), 2**20, overlap=True)[0]
    off = simulate(3e8, 1.0, [8], 5e-6, 1 / (25 * GB), 2**20, overlap=False)[0]
    assert on["exposed_s"] < 0.01 * off["exposed_s"]  # 1 s of compute hides all but the last 1 MiB bucket


def test_turning_point_of_a_hand_computed_case():
    # 25e6 fp32 parameters = 1e8 bytes in one bucket, α = 0, 1 GB/s: comm(N) = 2(N-1)/N · 1e8 B / 1e9 B/s
    # = 0.2 (N-1)/N s. With 0.14 s of compute it passes compute between N = 3 (0.133) and N = 4 (0.150).
    sizes = list(range(1, 9))
    rows = simulate(25e6, 0.14, sizes, alpha=0.0, beta=1e-9, bucket_bytes=10**9, overlap=False)
    assert [r["comm_s"] for r in rows] == pytest.approx([0.2 * (n - 1) / n for n in sizes])
    assert [r["comm_bound"] for r in rows] == [False] * 3 + [True] * 5
    assert turning_point(rows) == 4
    # One bucket cannot overlap (it is ready only when backward ends): overlap changes nothing...
    assert turning_point(simulate(25e6, 0.14, sizes, 0.0, 1e-9, 10**9, overlap=True)) == 4
    # ...but in 100 buckets of 1 MB all but the last can hide behind backward, 2/3 of the compute:
    # exposed = comm - backward = 0.175 - 2/3 · 0.14 at N = 8 (not 0.175 - 0.14: forward hides nothing).
    split = simulate(25e6, 0.14, sizes, 0.0, 1e-9, bucket_bytes=10**6, overlap=True)
    assert split[-1]["buckets"] == 100 and split[-1]["exposed_s"] == pytest.approx(0.175 - 2 / 3 * 0.14)
    assert split[-1]["backward_s"] == pytest.approx(2 / 3 * 0.14)
    assert turning_point(split) is None
    # a measured backward share replaces the 2/3: half the compute leaves 0.175 - 0.07 exposed
    half = simulate(25e6, 0.14, [8], 0.0, 1e-9, bucket_bytes=10**6, backward_fraction=0.5)[0]
    assert half["exposed_s"] == pytest.approx(0.105)


def test_latency_term_counts_every_message_of_every_bucket():
    # α only: 4 buckets × 2(N-1) ring steps × 1 ms at N = 3
    row = simulate(1e6, 1.0, [3], alpha=1e-3, beta=0.0, bucket_bytes=10**6, overlap=False)[0]
    assert row["buckets"] == 4 and row["comm_s"] == pytest.approx(4 * 4 * 1e-3)


def test_simulate_is_costs_ddp_step_time_at_each_world_size():
    for params, bucket, overlap, share in [(1e6, 2**20, True, 2 / 3), (3.3e6, 2**20, False, 2 / 3),
                                           (5e7, 25 * 2**20, True, 0.6)]:
        for n in (1, 2, 16, 512):
            row = simulate(params, 0.02, [n], 2e-5, 1 / (5 * GB), bucket, overlap, backward_fraction=share)[0]
            ref = costs.ddp_step_time(0.02, params * 4, n, 2e-5, 1 / (5 * GB), bucket_bytes=bucket, overlap=overlap,
                                      backward_fraction=share)
            assert row["step_s"] == pytest.approx(ref.step) and row["buckets"] == ref.num_buckets
            assert row["exposed_s"] == pytest.approx(ref.exposed)
    # the overlap cost goes through to costs.ddp_step_time too, not through a copy of the model
    for cost in (0.0, 0.4, 1.0):
        row = simulate(1e7, 0.05, [8], 2e-5, 1 / (5 * GB), 2**20, backward_fraction=0.6, overlap_cost=cost)[0]
        ref = costs.ddp_step_time(0.05, 4e7, 8, 2e-5, 1 / (5 * GB), bucket_bytes=2**20, backward_fraction=0.6,
                                  overlap_cost=cost)
        assert row["step_s"] == pytest.approx(ref.step) and row["penalty_s"] == pytest.approx(ref.overlap_penalty)


def test_overlap_cost_can_turn_a_curve_communication_bound():
    # 1e8 B of gradients in 1e6 B buckets, N = 2, α = 0, 1 GB/s: comm 0.1 s. compute 0.09 s, backward 0.08 s:
    # exposed 0.02 s, hidden 0.08 s. Free overlap: 0.02 <= 0.09, compute-bound. overlap_cost 1: the hidden
    # 0.08 s costs compute too, 0.02 + 0.08 = 0.1 > 0.09: communication-bound, efficiency 0.09 / 0.19 < 50 %
    free = simulate(2.5e7, 0.09, [2], 0.0, 1e-9, bucket_bytes=10**6, backward_fraction=0.08 / 0.09)[0]
    shared = simulate(2.5e7, 0.09, [2], 0.0, 1e-9, bucket_bytes=10**6, backward_fraction=0.08 / 0.09,
                      overlap_cost=1.0)[0]
    assert free["exposed_s"] == pytest.approx(0.02) and not free["comm_bound"] and free["penalty_s"] == 0.0
    assert shared["penalty_s"] == pytest.approx(0.08) and shared["comm_bound"]
    assert shared["efficiency"] == pytest.approx(0.09 / 0.19)


def test_a_trillion_parameters_in_small_buckets_is_timed_in_closed_form(monkeypatch):
    # 4e12 bytes of gradients in 1 MiB buckets: 3.8 million buckets, but at most two all-reduce sizes (full
    # buckets and the remainder) are timed per world size, whatever the bucket count.
    calls = []
    real = costs.collective_time
    monkeypatch.setattr(costs, "collective_time", lambda *a, **k: calls.append(a) or real(*a, **k))
    rows = simulate(1e12, 1.0, [1, 64, 16384], 5e-6, 1 / (50 * GB), bucket_bytes=2**20)
    assert rows[0]["buckets"] == 4 * 10**12 // 2**20 + 1 and len(calls) <= 2 * len(rows)
    assert rows[-1]["efficiency"] < rows[1]["efficiency"] < 1


@pytest.mark.parametrize("kwargs, message", [
    ({"world_sizes": [0, 2]}, "world_sizes must be whole numbers"),
    ({"world_sizes": [1.5]}, "world_sizes must be whole numbers"),
    ({"compute_s": 0}, "compute_s must be a positive number"),
    ({"params_count": -1}, "params_count must be a positive number"),
    ({"alpha": -1e-6}, "alpha and beta must be >= 0"),
    ({"backward_fraction": 1.2}, "backward_fraction must be between 0 and 1"),
])
def test_bad_input_is_refused_with_a_message_naming_it(kwargs, message):
    args = {"params_count": 1e6, "compute_s": 0.01, "world_sizes": [1, 2], "alpha": 1e-5, "beta": 1e-9, **kwargs}
    with pytest.raises(ValueError, match=message):
        simulate(**args)


# --- the simulator widget -------------------------------------------------------------------------
MEASURED = {"compute_s": 0.04, "alpha": 3e-4, "beta": 1 / (0.5 * GB), "grad_bytes": 6_303_744, "batch": 64,
            "efficiency": {1: 1.0, 2: 0.8}, "label": "cpu · gloo · 2 ranks"}


def test_simulator_starts_from_the_measurements_and_offers_the_fitted_link():
    sim = scaling_simulator(MEASURED)
    assert sim.interconnect.value == FITTED and sim.link()[:2] == (3e-4, 1 / (0.5 * GB))
    assert sim.params.value == pytest.approx(6_303_744 / 4) and sim.compute_ms.value == pytest.approx(40)
    expected = simulate(6_303_744 / 4, 0.04, [r["world_size"] for r in sim.rows], 3e-4, 1 / (0.5 * GB),
                        25 * 2**20, True, batch_per_gpu=64)
    assert [r["step_s"] for r in sim.rows] == pytest.approx([r["step_s"] for r in expected])
    assert FITTED not in scaling_simulator().interconnect.options  # nothing measured, nothing fitted
    assert sim.backward.value == pytest.approx(2 / 3)  # no backward share measured: the usual 2/3
    assert sim.overlap_cost.value == 0.0  # no overlap cost measured: free overlap


def test_simulator_charges_the_measured_overlap_cost():
    sim = scaling_simulator({**MEASURED, "overlap_cost": 0.75, "bucket_mb": 1})
    assert sim.overlap_cost.value == 0.75 and sim._at_measured_model()
    expected = simulate(6_303_744 / 4, 0.04, [r["world_size"] for r in sim.rows], 3e-4, 1 / (0.5 * GB),
                        2**20, True, batch_per_gpu=64, overlap_cost=0.75)
    assert [r["step_s"] for r in sim.rows] == pytest.approx([r["step_s"] for r in expected])
    assert sim.rows[1]["penalty_s"] > 0 and sim.rows[-1]["penalty_s"] > 0 and "+ overlap cost" in sim.describe()
    free = sim.rows[1]["step_s"]
    sim.overlap_cost.value = 0.0  # free overlap: a shorter step, and no longer the measured model
    assert sim.rows[1]["step_s"] < free and not sim._at_measured_model()


def test_simulator_hides_communication_behind_the_measured_backward_share():
    sim = scaling_simulator({**MEASURED, "backward_fraction": 0.5})
    assert sim.backward.value == 0.5
    expected = simulate(6_303_744 / 4, 0.04, [r["world_size"] for r in sim.rows], 3e-4, 1 / (0.5 * GB),
                        25 * 2**20, True, batch_per_gpu=64, backward_fraction=0.5)
    assert [r["exposed_s"] for r in sim.rows] == pytest.approx([r["exposed_s"] for r in expected])
    sim.bucket_mb.value = 0.1  # many small buckets: the exposed part is comm beyond backward
    before = sim.rows[-1]["exposed_s"]
    sim.backward.value = 1.0  # a longer backward hides more
    assert sim.rows[-1]["exposed_s"] < before


def test_simulator_redraws_when_a_control_changes():
    sim = scaling_simulator(MEASURED)
    rows, figure, outputs, summary = sim.rows, sim.figure, sim.out.outputs, sim.summary.value
    assert outputs and "image/png" in outputs[0]["data"]
    sim.params.value = 1e10  # a far bigger model: it computes for longer, in proportion (same batch)
    assert sim.figure is not figure and sim.out.outputs != outputs and sim.summary.value != summary
    assert sim.compute_ms.value == pytest.approx(40 * 1e10 / (6_303_744 / 4))
    sim.compute_ms.value = 40  # ... unless told otherwise: then more communication, lower efficiency
    assert sim.rows[-1]["efficiency"] < rows[-1]["efficiency"]
    sim.interconnect.value = "NVLink 4 (H100 SXM)"
    assert "NVLink 4" in sim.link()[2] and sim.rows[-1]["efficiency"] > 0
    sim.world.value = (8, 64)
    assert [r["world_size"] for r in sim.rows] == [1, 8, 16, 32, 64]  # N = 1 is kept: the baseline


def test_simulator_shows_the_values_it_was_given():
    """No snapping: ipywidgets' default log-slider step (0.1 in the exponent) turned 8.8 ms into 7.94 ms."""
    sim = scaling_simulator({**MEASURED, "compute_s": 0.0088, "grad_bytes": 4 * 7.5e9, "bucket_mb": 3.3})
    assert [c.step for c in (sim.params, sim.compute_ms, sim.bucket_mb)] == [None] * 3  # the browser keeps any value
    assert (sim.params.value, sim.compute_ms.value, sim.bucket_mb.value) == (7.5e9, pytest.approx(8.8), 3.3)
    assert "8.8 ms compute/step" in sim.figure.get_suptitle()


def test_simulator_draws_measured_dots_only_for_the_measured_model():
    sim = scaling_simulator(MEASURED)
    assert sim._at_measured_model()
    sim.params.value *= 10  # another model: the small model's measured efficiency no longer belongs beside it
    assert not sim._at_measured_model()
    sim.params.value /= 10
    assert sim._at_measured_model()
    assert "(compute 2.5 h" in scaling_simulator({**MEASURED, "compute_s": 9000.0}).describe()  # not 150 min


# --- the run explorer -----------------------------------------------------------------------------
def _fake_run(root, name, *, traces=("rank",), world_size=1, start=0.0):
    """A run directory as the launcher leaves it, with one tiny trace per rank and trace name."""
    run_dir = root / name
    (run_dir / "traces").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"world_size": world_size, "backend": "gloo",
                                                       "device": "cpu", "status": "ok", "start": start}))
    for trace in traces:
        for rank in range(world_size):
            events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#2", "pid": 1, "tid": 1,
                       "ts": 0, "dur": 100},
                      {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 40},
                      {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2,
                       "ts": 30, "dur": 40}]
            (run_dir / "traces" / f"{trace}{rank}.json").write_text(json.dumps({"traceEvents": events}))
    return run_dir


def test_explorer_lists_only_runs_with_traces_and_shows_the_newest(tmp_path):
    _fake_run(tmp_path, "old", world_size=2, start=1.0)
    _fake_run(tmp_path, "phases", traces=("sync-", "overlap-"), start=2.0)
    _fake_run(tmp_path, "untraced", traces=(), start=3.0)
    ex = run_explorer(tmp_path)
    labels = [label for label, _ in ex.dropdown.options]
    assert len(labels) == 3 and not any("untraced" in label for label in labels)
    assert labels[0].startswith("phases [") and labels[-1].startswith("old · 2 ranks")
    assert ex.analysis.name == "phases" and len(ex.figures) == 2
    table = ex.analysis.table()[0]  # mm [10, 50] computes, gloo [30, 70] communicates: 20 us exposed
    assert table["compute_ms"] == pytest.approx(0.04) and table["exposed_comm_ms"] == pytest.approx(0.02)
    outputs = ex.out.outputs
    assert [o["output_type"] for o in outputs] == ["display_data", "display_data", "stream"]

    ex.dropdown.value = ex.dropdown.options[-1][1]  # pick the 2-rank run: redrawn
    assert ex.analysis.world_size == 2 and ex.out.outputs != outputs
    assert "2 of 2 rank(s) analysed" in ex.out.outputs[-1]["text"]


def test_explorer_refresh_finds_new_runs_and_says_when_there_are_none(tmp_path):
    ex = run_explorer(tmp_path)
    assert not ex.dropdown.options and "No run with traces" in ex.out.outputs[-1]["text"]
    _fake_run(tmp_path, "fresh", start=1.0)
    ex.refresh_button.click()
    assert len(ex.dropdown.options) == 1 and ex.analysis is not None and not math.isnan(ex.analysis.ranks[0].overlap)


def test_explorer_refresh_keeps_the_selection_without_redrawing_it(tmp_path):
    _fake_run(tmp_path, "first", start=1.0)
    ex = run_explorer(tmp_path)
    chosen, figures = ex.dropdown.value, ex.figures
    _fake_run(tmp_path, "newer", start=2.0)
    ex.refresh()
    assert len(ex.dropdown.options) == 2 and ex.dropdown.options[0][0].startswith("newer")
    assert ex.dropdown.value == chosen and ex.figures is figures  # still "first", not analysed again


def test_explorer_reports_a_broken_trace_instead_of_raising(tmp_path):
    run_dir = _fake_run(tmp_path, "broken")
    (run_dir / "traces" / "rank0.json").write_text("{ truncated")
    ex = run_explorer(tmp_path)
    assert ex.analysis is None and "cannot analyse broken" in ex.out.outputs[-1]["text"]


def test_planner_shows_a_plan_refuses_a_bad_one_and_redraws():
    from gpucourse.viz.widgets import parallelism_planner

    w = parallelism_planner(model="llama3-70b", gpus=1024, dp=32, tp=8, pp=4)
    assert "application/vnd.jupyter.widget-view+json" in w._repr_mimebundle_()
    assert "Modelled" in w.summary.value and "fits in" in w.summary.value and len(w.out.outputs) == 1
    w.degrees["dp"].value = 16  # 16 x 8 x 4 = 512 places for 1,024 GPUs
    assert "Not a plan" in w.summary.value and "512" in w.summary.value and w.out.outputs == ()
    w.degrees["pp"].value = 8   # 1,024 again
    assert w.plan["layout"]["pp"] == 8 and len(w.out.outputs) == 1
    batch = w.plan["global_batch"]
    w.gpus.value = 2048  # dp follows the GPU count; the global batch stays
    assert w.plan["layout"] == {"dp": 32, "tp": 8, "pp": 8, "cp": 1, "ep": 1} and w.plan["global_batch"] == batch
    w.device_gib.value = 1
    assert "does <b>not</b> fit" in w.summary.value
