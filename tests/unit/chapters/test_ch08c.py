"""What chapter 08c (asynchronous checkpoints, the slow rank) shows, `gpucourse/chapters/ch08c.py`, from hand-made
records and Flight Recorder dumps shaped as torch writes them (time_created_ns per collective)."""
import json
import pickle

import pytest
from matplotlib.figure import Figure

from gpucourse.chapters import ch08c
from gpucourse.run import forensics

T0 = 1_000.0  # seconds on time.time()'s clock
STEP, LATE = 0.1, 0.5  # a healthy step, and how late rank 1 calls each collective in the slow phase


def _records():
    """{rank: records} of a 2-rank run: 4 healthy steps, 4 slow ones (rank 1 late by LATE), 4 blocking and 4
    asynchronous ones (a save after steps 9, 11, 13, 15), and the resume record."""
    metrics, t = {0: [], 1: []}, T0
    for step in range(16):
        phase = ("healthy", "slow", "blocking", "async")[step // 4]
        saved = step if phase in ("blocking", "async") and step % 2 else None
        length = STEP + (LATE if phase == "slow" else 0) + (0.3 if phase == "blocking" and saved else 0) \
            + (0.02 if phase == "async" and saved else 0)
        for rank in (0, 1):
            if saved is not None and phase == "blocking":
                metrics[rank].append({"save": "blocking", "at": step, "blocked_s": 0.3, "upload_s": 0.3})
            if saved is not None and phase == "async":
                metrics[rank] += [{"save": "async", "at": step, "blocked_s": 0.02},
                                  {"save": "async-done", "at": step, "upload_s": 0.25}]
            metrics[rank].append({"step": step, "phase": phase, "step_s": length, "start": t, "end": t + length,
                                  "saved": saved})
        t += length + 0.001
    for rank in (0, 1):
        metrics[rank].append({"save": "async-drain", "wait_s": 0.04})
        metrics[rank].append({"resumed_from": 13, "replayed": 2, "bitwise_equal": True, "max_abs_diff": 0.0,
                              "checkpoint_bytes": 1000, "params": 10})
    return metrics


def _dump(run_dir, metrics):
    """Each rank's dump: per healthy or slow step, two all-reduces of the default group (DDP's two buckets, both
    called before the first completes) 60 and 61 ms into the step, rank 1 LATE seconds later in the slow phase;
    and one collective of another group, which arrivals must leave out."""
    for rank in (0, 1):
        entries, seq = [], 0
        for rec in metrics[rank]:
            if rec.get("phase") not in ("healthy", "slow"):
                continue
            late = LATE if rec["phase"] == "slow" and rank == 1 else 0.0
            # the healthy phase: rank 0 a little late (its own work 5 ms longer)
            late += 0.005 if rec["phase"] == "healthy" and rank == 0 else 0.0
            for k in range(2):
                seq += 1
                entries.append({"record_id": seq, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
                                "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "is_p2p": False,
                                "time_created_ns": int((rec["start"] + 0.06 + 0.001 * k + late) * 1e9)})
        entries.append({"record_id": seq + 1, "process_group": ("1", "undefined"), "collective_seq_id": 1,
                        "profiling_name": "gloo:gather", "input_sizes": [[1]], "is_p2p": False,
                        "time_created_ns": int(T0 * 1e9)})
        config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
                  "1": {"name": "1", "desc": "undefined", "ranks": "[0, 1]"}}
        for path, payload in ((forensics.fr_file(run_dir, rank), pickle.dumps({"entries": entries,
                                                                                "pg_config": config})),
                              (forensics.stack_file(run_dir, rank), json.dumps({"rank": rank, "stack": []}).encode())):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(payload)


class Run:  # what ch08c reads of a RunResult
    def __init__(self, run_dir):
        self.run_dir, self.world_size, self.metrics = run_dir, 2, _records()
        _dump(run_dir, self.metrics)


@pytest.fixture
def run(tmp_path):
    return Run(tmp_path)


def test_arrivals_read_the_default_groups_calls_in_seconds(run):
    found = forensics.arrivals(run.run_dir, 2)
    assert len(found) == 16 and set(found[1]) == {0, 1}  # 8 steps x 2 buckets; the other group's gather left out
    first_slow = found[9]
    assert first_slow[1] - first_slow[0] == pytest.approx(LATE, abs=1e-6)


def test_the_slow_rank_is_named_with_its_slowdown(run):
    found = ch08c.slow_rank(run)
    assert found["rank"] == 1
    assert found["extra_s"] == pytest.approx(LATE, abs=0.01)
    assert found["wait_s"][1] == 0 and found["wait_s"][0] == pytest.approx(LATE + 0.001, abs=1e-3)  # union, not sum
    assert found["slowdown"] == pytest.approx((STEP + LATE) / (STEP - LATE - 0.001 + LATE), rel=0.02)
    assert ch08c.slow_rank(run, "healthy")["rank"] == 0  # rank 0's 5 ms more work


def test_per_rank_shows_equal_steps_and_who_waits(run):
    df = ch08c.per_rank(run)
    assert list(df.columns) == ["step (ms)", "wait (ms)", "busy (ms)"]
    assert df.loc[("slow", 0), "step (ms)"] == df.loc[("slow", 1), "step (ms)"] == pytest.approx(600, abs=0.1)
    assert df.loc[("slow", 0), "wait (ms)"] == pytest.approx(501, abs=0.5) and df.loc[("slow", 1), "wait (ms)"] == 0


def test_slow_step_is_predicted_from_the_healthy_parts(run):
    pace = ch08c.slow_step(run, slow_rank=1, slow_s=LATE)
    assert pace["healthy_s"] == pytest.approx(STEP) and pace["measured_s"] == pytest.approx(STEP + LATE)
    assert pace["predicted_s"] == pytest.approx(STEP + LATE, abs=0.01)


def test_save_costs_count_the_blocked_time_and_what_each_phase_lost(run):
    costs = ch08c.save_costs(run.metrics)
    assert costs["healthy_step_s"] == pytest.approx(STEP)
    assert costs["blocking"]["saves"] == 2 and costs["blocking"]["blocked_s"] == pytest.approx(0.3)
    assert costs["blocking"]["lost_s"] == pytest.approx(0.3) and costs["blocking"]["written_s"] == pytest.approx(0.3)
    assert costs["async"]["blocked_s"] == pytest.approx(0.02) and costs["async"]["written_s"] == pytest.approx(0.25)
    assert costs["async"]["lost_s"] == pytest.approx(0.02 + 0.04 / 2)  # the wait for the last write, shared
    df = ch08c.saves(run.metrics)
    assert list(df.index) == ["blocking", "async"] and df.loc["async", "loop blocked per save (ms)"] == 20


def test_save_costs_refuse_a_run_without_saves(run):
    cut = {rank: [r for r in recs if r.get("save") != "async"] for rank, recs in run.metrics.items()}
    with pytest.raises(ValueError, match="no async save"):
        ch08c.save_costs(cut)


def test_best_interval_is_young_daly_and_an_async_save_waits_for_its_write():
    mtbf = 3600.0
    assert ch08c.best_interval({"lost_s": 0.5, "written_s": 0.5}, "blocking", mtbf) == pytest.approx(60.0)
    assert ch08c.best_interval({"lost_s": 1e-4, "written_s": 5.0}, "async", mtbf) == 5.0


def test_resumed_has_a_row_per_rank(run):
    df = ch08c.resumed(run.metrics)
    assert list(df.index) == [0, 1] and df["bitwise_equal"].all() and (df["replayed"] == 2).all()


def test_figures_are_labelled(run):
    costs = ch08c.save_costs(run.metrics)
    for fig in (ch08c.step_times_plot(run.metrics, "cpu · gloo · 2 ranks"),
                ch08c.goodput_plot(costs, 3600.0, "cpu · gloo · 2 ranks")):
        assert isinstance(fig, Figure) and "cpu · gloo · 2 ranks" in fig.axes[0].get_title()


def test_the_step_axis_counts_whole_steps(run):
    ax = ch08c.step_times_plot(run.metrics, "cpu · gloo · 2 ranks").axes[0]
    ax.set_xlim(19.4, 38.6)  # 19 steps: matplotlib's default ticks would fall every 2.5 steps
    ticks = [t for t in ax.get_xticks() if 19.4 <= t <= 38.6]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
