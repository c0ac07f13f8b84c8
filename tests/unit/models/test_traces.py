"""Trace analysis on hand-made traces: exact interval arithmetic, clear errors on bad files, step spans, per-step
all-reduces and scaling efficiency. Real profiled gloo jobs, checked against what the job did:
tests/integration/test_traces_profiled.py."""
import io
import json
import math
import random
import shutil

import pytest

from gpucourse import timeline, traces
from gpucourse.models.traces import (
    TraceError, analyze_run, analyze_trace, intersect, subtract, total, union,
)

pytestmark = pytest.mark.xdist_group("traces")  # with the profiled runs' tests, on one worker

MAIN, GLOO = 1, 2  # thread ids in the hand-made traces


def ev(name, ts, dur, *, tid=MAIN, cat="cpu_op", pid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def step(n, ts, dur):
    return ev(f"ProfilerStep#{n}", ts, dur, cat="user_annotation")


def gloo(ts, dur):
    return ev("gloo:all_reduce", ts, dur, tid=GLOO, cat="user_annotation")


def write_trace(path, events, *, rank=0, world_size=2, backend="gloo", **top):
    data = {"schemaVersion": 1, "distributedInfo": {"backend": backend, "rank": rank, "world_size": world_size},
            "traceEvents": [{"ph": "M", "name": "thread_name", "pid": 100, "tid": MAIN, "args": {"name": "python"}},
                            *events], **top}
    path.write_text(json.dumps(data))
    return path


def fake_run(tmp_path, traces: dict, world_size=2):
    """A run directory as the launcher leaves it, holding the given {file name: events} traces."""
    run_dir = tmp_path / "fake-run"
    (run_dir / "traces").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"world_size": world_size, "backend": "gloo",
                                                       "device": "cpu", "status": "ok"}))
    for file_name, events in traces.items():
        write_trace(run_dir / "traces" / file_name, events, rank=int(file_name[-6]), world_size=world_size)
    return run_dir


ONE_STEP = [step(0, 0, 100), ev("aten::linear", 10, 30), ev("aten::mm", 20, 10), gloo(35, 25)]


# --- interval arithmetic ---------------------------------------------------------------------------
def test_union_merges_nested_overlapping_and_touching_and_drops_empty():
    assert union([(5, 6), (0, 2), (1, 3), (3, 4), (10, 20), (12, 15), (7, 7)]) == [(0, 4), (5, 6), (10, 20)]


def test_interval_operations_agree_with_counting_unit_cells():
    rng = random.Random(0)

    def cells(intervals):
        return {t for s, e in intervals for t in range(s, e)}

    for _ in range(200):
        a = [(s, s + rng.randint(0, 8)) for s in (rng.randint(0, 40) for _ in range(rng.randint(0, 6)))]
        b = [(s, s + rng.randint(0, 8)) for s in (rng.randint(0, 40) for _ in range(rng.randint(0, 6)))]
        ua, ub = union(a), union(b)
        assert total(ua) == len(cells(a))
        assert cells(intersect(ua, ub)) == cells(a) & cells(b)
        assert cells(subtract(ua, ub)) == cells(a) - cells(b)
        assert all(e1 < s2 for (_, e1), (s2, _) in zip(subtract(ua, ub), subtract(ua, ub)[1:]))


# --- hand-made CPU traces: what counts as compute and as communication ------------------------------
def test_nested_events_count_once_and_exposed_comm_is_comm_outside_compute(tmp_path):
    # compute: linear [10,40] holding mm [20,30], plus an annotated region [50,70] -> 50 us, not 60
    # comm: gloo [35,60] -> 25 us; exposed = [40,50] = 10 us, overlapped = 15 us; other = 100 - 50 - 10
    events = [*ONE_STEP, ev("c10d::allreduce_", 40, 2), ev("compute", 50, 20, cat="user_annotation")]
    ra = analyze_trace(write_trace(tmp_path / "rank0.json", events))
    (s,) = ra.steps
    assert (s.step, s.duration_us, s.compute_us, s.comm_us) == (0, 100, 50, 25)
    assert (s.exposed_comm_us, s.overlapped_comm_us, s.other_us) == (10, 15, 40)
    assert s.overlap == pytest.approx(0.6)
    assert ra.intervals == {"compute": [(10, 40), (50, 70)], "comm": [(35, 60)]}
    assert ra.kind == "cpu-gloo" and ra.backend == "gloo" and ra.world_size == 2


def test_a_region_around_a_blocking_collective_is_not_compute(tmp_path):
    # "train_step" encloses the all_reduce call: counting it would hide the blocking wait [32,79] as compute.
    events = [step(3, 0, 100), ev("train_step", 0, 90, cat="user_annotation"), ev("aten::mm", 5, 20),
              ev("c10d::allreduce_", 30, 2), ev("record_param_comms", 30, 1.5), ev("aten::add", 80, 10),
              gloo(31, 48)]
    (s,) = analyze_trace(write_trace(tmp_path / "rank0.json", events)).steps
    assert (s.compute_us, s.comm_us, s.exposed_comm_us, s.other_us) == (30, 48, 48, 22)
    assert s.overlap == 0


def test_point_to_point_on_the_callers_thread_is_comm_beside_its_compute(tmp_path):
    # gloo records isend/irecv as gloo:send / gloo:recv on the caller's thread, spanning the asynchronous transfer
    # [12,60]; the caller computes meanwhile ([15,35]) and then waits (Work.wait is not recorded): the caller's
    # thread is not a communication thread, its matmul is compute, and the transfer is comm, 20 us of it hidden.
    events = [step(0, 0, 100), ev("c10d::send", 10, 2), ev("gloo:send", 12, 48, cat="user_annotation"),
              ev("c10d::recv_", 12, 1), ev("gloo:recv", 13, 47, cat="user_annotation"), ev("aten::mm", 15, 20),
              ev("aten::add", 70, 10)]
    (s,) = analyze_trace(write_trace(tmp_path / "rank0.json", events)).steps
    assert (s.compute_us, s.comm_us, s.overlapped_comm_us, s.exposed_comm_us) == (30, 48, 20, 28)


def test_a_functional_collective_wait_is_not_compute(tmp_path):
    # DTensor: issue the all-reduce [30,32], compute [32,50], then block in wait_tensor [50,79] until gloo ends
    events = [step(0, 0, 100), ev("_c10d_functional::all_reduce", 30, 2), ev("aten::mm", 32, 18),
              ev("_c10d_functional::wait_tensor", 50, 29), gloo(31, 48), ev("aten::add", 80, 10)]
    (s,) = analyze_trace(write_trace(tmp_path / "rank0.json", events)).steps
    assert (s.compute_us, s.comm_us, s.exposed_comm_us) == (28, 48, 30)


def test_fsdp_regions_hold_waits_and_are_not_compute_but_their_copies_are(tmp_path):
    # FSDP2 with an all-gather prefetched (async) while layer 0 computes [10,30]: layer 1's pre-forward waits for
    # it inside FSDP::all_gather_copy_out [30,55] (Work.wait is not recorded) and copies out [50,55]; the autograd
    # node around a pre-backward [60,95] is no compute either, only its matmul [85,95] is. The all-gather on gloo's
    # thread [12,50]: hidden behind layer 0's matmul [12,30], exposed while waiting [30,50].
    events = [step(0, 0, 100), ev("aten::mm", 10, 20),
              ev("FSDP::pre_forward (1)", 30, 25, cat="user_annotation"),
              ev("FSDP::all_gather_copy_out (1)", 30, 25, cat="user_annotation"), ev("aten::copy_", 50, 5),
              ev("autograd::engine::evaluate_function: AddmmBackward0", 60, 35),
              ev("FSDP::pre_backward (1)", 60, 20, cat="user_annotation"), ev("aten::mm", 85, 10),
              ev("gloo:all_gather", 12, 38, tid=GLOO, cat="user_annotation"), gloo(80, 4)]
    ra = analyze_trace(write_trace(tmp_path / "rank0.json", events))
    (s,) = ra.steps
    assert ra.intervals["compute"] == [(10, 30), (50, 55), (85, 95)]
    assert (s.compute_us, s.comm_us, s.exposed_comm_us) == (35, 42, 24)
    assert sorted(ra.comm_by_name) == ["gloo:all_gather", "gloo:all_reduce"]
    assert ra.collective("gloo:all_gather") == [(38, 20)]
    assert ra.collective("gloo:all_reduce") == [(4, 4)]
    assert ra.collective("gloo:broadcast") == [(0, 0)]


def test_communication_straddling_a_step_boundary_is_split_between_the_steps(tmp_path):
    events = [step(1, 0, 50), step(2, 50, 50), ev("aten::mm", 0, 45), ev("aten::mm", 55, 45), gloo(40, 20)]
    s1, s2 = analyze_trace(write_trace(tmp_path / "rank0.json", events)).steps
    assert [(s.step, s.start_us, s.duration_us) for s in (s1, s2)] == [(1, 0, 50), (2, 50, 50)]
    assert (s1.comm_us, s1.exposed_comm_us, s2.comm_us, s2.exposed_comm_us) == (10, 5, 10, 5)
    assert math.isnan(analyze_trace(write_trace(tmp_path / "r.json", [step(0, 0, 10)])).steps[0].overlap)


# --- hand-made GPU trace ----------------------------------------------------------------------------
def test_gpu_trace_uses_kernels_nccl_is_comm_and_steps_follow_the_launches(tmp_path):
    def launch_(ts, corr):
        return ev("cudaLaunchKernel", ts, 2, cat="cuda_runtime", correlation=corr)

    def kernel(name, ts, dur, corr, stream, cat="kernel"):
        return ev(name, ts, dur, pid=0, tid=stream, cat=cat, correlation=corr, stream=stream, device=0)

    events = [step(5, 0, 100), step(6, 100, 100),
              ev("record_param_comms", 18, 5), ev("nccl:all_reduce", 19, 3, cat="user_annotation"),
              launch_(10, 1), launch_(20, 2), launch_(30, 3), launch_(110, 4), launch_(120, 5),
              kernel("sm90_xmma_gemm_f32", 50, 40, 1, 7),
              kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 70, 60, 2, 20),
              kernel("Memcpy DtoH (Device -> Pinned)", 130, 5, 3, 7, cat="gpu_memcpy"),
              kernel("sm90_xmma_gemm_f32", 150, 30, 4, 7),
              kernel("ncclKernel_AllReduce_RING_LL_Sum_float", 180, 20, 5, 20)]
    ra = analyze_trace(write_trace(tmp_path / "rank1.json", events, rank=1, backend="nccl",
                                   deviceProperties=[{"id": 0, "name": "NVIDIA H100 80GB HBM3"}]))
    assert ra.kind == "gpu" and ra.rank == 1 and ra.device == "NVIDIA H100 80GB HBM3"
    s5, s6 = ra.steps
    # step 5 runs on the GPU from its first kernel (50) to step 6's first kernel (150); the memcpy is "other"
    assert (s5.start_us, s5.duration_us, s5.compute_us, s5.comm_us, s5.exposed_comm_us, s5.other_us) == (
        50, 100, 40, 60, 40, 20)
    assert (s6.start_us, s6.duration_us, s6.compute_us, s6.comm_us, s6.exposed_comm_us, s6.other_us) == (
        150, 50, 30, 20, 20, 0)


# --- bad input: clear messages naming the file -----------------------------------------------------
def test_truncated_json_names_the_file(tmp_path):
    path = write_trace(tmp_path / "rank0.json", ONE_STEP)
    path.write_text(path.read_text()[:150])
    with pytest.raises(TraceError, match=r"rank0\.json is not valid JSON.*truncated"):
        analyze_trace(path)


def test_foreign_json_is_not_a_trace(tmp_path):
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"loss": [1.0, 0.5]}))
    with pytest.raises(TraceError, match=r"rank0\.json is JSON but not a chrome trace"):
        analyze_trace(path)


def test_trace_without_step_markers_says_to_call_prof_step(tmp_path):
    with pytest.raises(TraceError, match=r"no ProfilerStep#N markers.*prof\.step\(\)"):
        analyze_trace(write_trace(tmp_path / "rank0.json", [ev("aten::mm", 0, 5)]))


def test_a_bad_rank_is_reported_and_the_others_still_analysed(tmp_path):
    run_dir = fake_run(tmp_path, {"rank0.json": ONE_STEP, "rank1.json": ONE_STEP})
    (run_dir / "traces" / "rank1.json").write_text('{"traceEvents": [{"ph": "X", "na')
    analysis = analyze_run(run_dir)
    assert list(analysis.ranks) == [0] and analysis.world_size == 2
    assert len(analysis.problems) == 1 and "rank 1" in analysis.problems[0]
    assert str(run_dir / "traces" / "rank1.json") in analysis.problems[0]
    assert "problem: rank 1" in analysis.summary()


def test_fractions_are_the_mean_step_over_the_ranks_split_into_its_parts():
    from gpucourse.models.traces import RankAnalysis, RunAnalysis, StepBreakdown

    def rank(r, duration, compute, comm, exposed):
        step = StepBreakdown(r, 0, 0.0, duration, compute, comm, exposed, duration - compute - exposed)
        return RankAnalysis(r, None, "cpu-gloo", [step], {})

    run = RunAnalysis("cpu-gloo", "gloo", 2, {0: rank(0, 10e3, 6e3, 4e3, 2e3), 1: rank(1, 30e3, 10e3, 8e3, 8e3)})
    f = run.fractions()  # mean step 20 ms: compute 8, exposed 5, other 7; comm 6 of which 1 hidden
    assert f["step_ms"] == pytest.approx(20)
    assert (f["compute"], f["exposed"], f["other"], f["comm"]) == pytest.approx((0.4, 0.25, 0.35, 0.3))
    assert f["overlap"] == pytest.approx(1 / 6)
    silent = RunAnalysis("cpu-gloo", "gloo", 1, {0: rank(0, 10e3, 10e3, 0.0, 0.0)}).fractions()
    assert math.isnan(silent["overlap"]) and silent["comm"] == 0
    with pytest.raises(ValueError, match="no rank analysed"):
        RunAnalysis("cpu-gloo", "gloo", 2, {}).fractions()


def test_run_without_traces_or_with_only_bad_ones_raises(tmp_path):
    run_dir = fake_run(tmp_path, {})
    with pytest.raises(TraceError, match=r"no traces named rank<rank>\.json in .*traces: .*runtime\.profile"):
        analyze_run(run_dir)
    write_trace(run_dir / "traces" / "sync0.json", ONE_STEP)
    with pytest.raises(TraceError, match=r"it holds sync0\.json: pass name="):
        analyze_run(run_dir)
    (run_dir / "traces" / "sync0.json").write_text("{}")
    with pytest.raises(TraceError, match=r"no rank of .* could be analysed:\n  rank 0: .*sync0\.json"):
        analyze_run(run_dir, name="sync")
    with pytest.raises(TraceError, match=r"is not a run directory"):
        analyze_run(tmp_path / "nowhere")


def render(fig):
    fig.savefig(io.BytesIO(), format="png")  # draws everything: catches errors that only show when rendering


def test_step_spans_and_idle_read_a_pipelines_actions(tmp_path):
    def trace(name, events):
        path = tmp_path / name
        path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": n, "ts": ts, "dur": d}
                                                    for n, ts, d in events]}))
        return path
    paths = {0: trace("r0.json", [("sync-start", 0, 1000), ("F0", 500, 100), ("F0", 1000, 2000), ("B0", 3000, 4000)]),
             1: trace("r1.json", [("sync-start", 0, 1000), ("F0", 3000, 2000), ("B0", 5000, 3000)])}
    spans = traces.step_spans(paths, r"[FB]\d+")
    assert spans == {0: [("F0", 0.0, 2.0), ("B0", 2.0, 6.0)], 1: [("F0", 2.0, 4.0), ("B0", 4.0, 7.0)]}
    step, share, ratio = traces.idle(spans)  # rank 0 busy 6 of 7 ms, rank 1 busy 5 of 7
    assert (step, share, ratio) == pytest.approx((7.0, (1 / 7 + 2 / 7) / 2, (1 / 6 + 2 / 5) / 2))
    assert traces.step_spans(paths, r"compute (F\d+)") == {0: [], 1: []}
    with pytest.raises(TraceError, match="no .barrier. span"):
        traces.step_spans(paths, r"F\d+", start="barrier")
    fig = timeline.pipeline_figure([[(spans, "measured")]])
    assert [t.get_text() for t in fig.axes[0].texts] == ["F0", "B0", "F0", "B0"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["forward", "backward"]


def test_scaling_efficiency_is_throughput_over_n_times_the_baseline():
    assert timeline.efficiencies({1: 100.0, 2: 180.0, 4: [290.0, 310.0]}) == pytest.approx({1: 1, 2: 0.9, 4: 0.75})
    assert timeline.efficiencies({2: 200.0, 4: 300.0}) == pytest.approx({2: 1, 4: 0.75})  # baseline N=2
    fig = timeline.scaling_plot({1: 100.0, 2: 180.0, 4: 300.0}, mode="weak", label="cpu, gloo")
    render(fig)
    ax_t, ax_e = fig.axes
    assert list(ax_e.lines[0].get_ydata()) == pytest.approx([100, 90, 75])
    assert fig.get_suptitle() == "Weak scaling: cpu, gloo"
    with pytest.raises(ValueError, match="mode must be"):
        timeline.scaling_plot({1: 1.0}, mode="linear")
    with pytest.raises(ValueError, match="bad measurement 0"):
        timeline.efficiencies({0: 5.0})


def test_compute_spans_start_after_the_last_barrier_and_overlapped_blocks_split_the_row(tmp_path):
    events = [ev("sync-start", 0, 100), ev("compute 0F9", 50, 10), ev("sync-start", 200, 1000),
              ev("compute 3B1", 3200, 2000), ev("compute 0F0", 1200, 1000), ev("PP:0F0", 1100, 1200)]
    spans = traces.step_spans({0: write_trace(tmp_path / "r0.json", events)}, r"compute (\d+[FBIW]\d+)")
    assert spans == {0: [("0F0", 0.0, 1.0), ("3B1", 2.0, 4.0)]}  # 0F9 ran before the step: left out
    modelled = {0: [("0F0", 0, 1), ("0F1", 1, 4), ("3B1", 1, 4)], 1: [("1F0", 1, 2)]}
    fig = timeline.pipeline_figure([[(spans, "measured")], [(modelled, "modelled")]], title="cpu · gloo · 2 ranks")
    bars = [[c.get_paths()[0].get_extents().height for c in ax.collections] for ax in fig.axes[:2]]
    assert len(bars[0]) == 2 and len(bars[1]) == 4
    assert bars[1][1] == pytest.approx(bars[1][0] / 2)  # the block's two actions share the row's height
    assert fig._suptitle.get_text() == "cpu · gloo · 2 ranks"
    assert [ax.get_title() for ax in fig.axes[:2]] == ["measured", "modelled"]


def test_all_reduces_per_step_counts_calls_and_bytes_inside_each_step(tmp_path):
    from gpucourse.models.traces import all_reduces_per_step

    def shaped(ts, dims, dtype):
        return {**gloo(ts, 5), "args": {"Input Dims": [dims], "Input type": [dtype]}}

    events = [step(1, 0, 100), step(2, 100, 100), shaped(10, [256], "float"), shaped(50, [8, 8], "float"),
              shaped(120, [256], "c10::BFloat16"), shaped(250, [4], "float")]  # the last is outside any step
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert all_reduces_per_step(path) == [(2, 1024 + 256), (1, 512)]
    no_shapes = [step(1, 0, 100), gloo(10, 5)]  # gloo on CUDA tensors: counted, bytes unknown
    path.write_text(json.dumps({"traceEvents": no_shapes}))
    assert all_reduces_per_step(path) == [(1, None)]
    path.write_text(json.dumps({"traceEvents": [step(1, 0, 100)]}))
    with pytest.raises(TraceError, match="no all_reduce events"):
        all_reduces_per_step(path)


def test_last_sized_step_skips_a_last_step_whose_bytes_the_trace_lost():
    """torch 2.11 writes the last gloo all_reduce of a profiled run without its args: that step's bytes are None."""
    from gpucourse.models.traces import last_sized_step

    assert last_sized_step([(3, 96), (3, 96), (3, None)]) == (3, 96)
    assert last_sized_step([(3, 96), (3, 128)]) == (3, 128)
    assert last_sized_step([(1, None), (1, None)]) == (1, None)  # no sizes at all (gloo on CUDA tensors)
