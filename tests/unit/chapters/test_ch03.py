"""What chapter 03 (profiling and scaling) shows, `gpucourse/chapters/ch03.py`, built from hand-made records."""
import math

import pytest

from gpucourse.chapters import ch03
from gpucourse.models import costs


# --- chapters 03, 09, 10 ------------------------------------------------------------------------------
def fake_analysis(rows):
    return type("A", (), {"table": lambda self: rows, "label": lambda self: "t", "problems": []})()


def trace_row(rank, overlap, comm=4.0, exposed=1.0):
    return {"rank": rank, "steps": 3, "step_ms": 20.0, "compute_ms": 15.0, "comm_ms": comm, "exposed_comm_ms": exposed,
            "other_ms": 4.0, "overlap": overlap}


def test_ddp_modes_give_what_communication_adds_to_compute_alone():
    from tests.unit.models.test_ddpsteps import fake_run

    df = ch03.ddp_modes(fake_run())
    assert df.loc["compute alone (no-ddp)", "median step (ms)"] == 12.0
    assert df.loc["DDP (overlap)", "comm adds (ms)"] == 3.0 and df.loc["DDP (overlap)", "comm adds (%)"] == 25.0
    assert df.loc["DDP without overlap", "comm adds (ms)"] == 9.0
    assert math.isnan(df.loc["compute alone (no-ddp)", "comm adds (ms)"])


def test_bucket_runs_and_predictions_read_each_variants_own_launch():
    from tests.unit.models.test_ddpsteps import fake_run

    fast = fake_run("fast", modes={"no-ddp": [(6, 2, 4)] * 3, "ddp": [(8, 2, 4)] * 3, "no-overlap": [(9, 2, 4)] * 3})
    variants = {"main": (fake_run("main"), "ddp-rank", "ddp"), "other": (fast, "ddp-rank", "ddp")}
    analyses = {"main": fake_analysis([trace_row(0, 0.75)]), "other": fake_analysis([trace_row(0, 0.5, 4.0, 2.0)])}
    df = ch03.bucket_runs(variants, analyses)
    assert df.loc["main", "compute alone (ms)"] == 12.0 and df.loc["other", "compute alone (ms)"] == 6.0
    assert df.loc["main", "hidden (%)"] == 75.0 and df.loc["other", "hidden (%)"] == 50.0
    load = {"main": (1.0, 1.5), "fast": (3.0, 2.0)}
    pred = ch03.step_predictions(variants, overlap_cost=1.0, fit=costs.AlphaBeta(1e-4, 1e-9), load=load)
    # overlap cost 1: hiding buys nothing, the step is compute + all of comm (5 ms of buckets)
    assert pred.loc["main", "predicted (ms)"] == 17.0 and pred.loc["other", "predicted (ms)"] == 11.0
    assert pred.attrs["errors"]["alone"]["main"] == pytest.approx((17 - 15) / 15)
    assert pred.loc["main", "predicted, free overlap (ms)"] < 17.0
    assert pred.loc["other", "load before → after"] == "3.0 → 2.0"
    misses = ch03.prediction_misses(variants, {"main": 0.5, "other": 0.05}, load=load, cores=2, goal=0.2)
    assert "load 3.0" not in misses.loc["main", "why it missed"] and misses.loc["other", "why it missed"] == ""
    assert misses.loc["main", "compute noise (%)"] == round(100 * (30 - 10) / 12)


def test_scaling_fit_and_overlap_tables():
    df = ch03.scaling_runs({1: [100.0, 110.0], 2: [150.0]}, {1: 1.0, 2: 0.714})
    assert df.loc[1, "mean (samples/s)"] == 105 and df.loc[2, "efficiency (%)"] == 71
    fit = costs.AlphaBeta(1e-3, 1e-9)
    ar = ch03.allreduce_fit([(2**20, 0.002)], fit)
    assert ar.loc["1 MiB", "measured (ms)"] == 2.0
    assert ar.loc["1 MiB", "α–β fit (ms)"] == round(fit.predict(2**20) * 1e3, 3)
    ov = ch03.overlap_trials({"compute": 10.0, "comm": 4.0, "both": 12.0})
    assert ov.loc["free overlap would take", "time (ms)"] == 10.0
    assert ov.loc["one after the other would take", "time (ms)"] == 14.0


def test_modelled_scaling_and_compiled_ddp():
    points = [{"world_size": n, "efficiency": e, "comm_bound": e < 0.5} for n, e in ((8, 0.9), (256, 0.4), (4096, 0.1))]
    df = ch03.modelled_scaling({"curve": points})
    assert df.loc["curve", "efficiency, N=256 (%)"] == 40 and df.loc["curve", "comm-bound from N"] == 256
    with pytest.raises(ValueError, match="no modelled point"):
        ch03.modelled_scaling({"curve": points}, at=(2,))
    cmp = {"graphs": {"compiled": 3, "one-graph": 1}, "compile_s": {"eager": 0.1, "compiled": 9.0, "one-graph": 7.0},
           "step_ms": {"eager": 5.0, "compiled": 4.0, "one-graph": 4.5}, "loss": {"eager": 1.0, "compiled": 1.0,
                                                                               "one-graph": 1.0}}
    out = ch03.compiled_ddp(cmp)
    assert out.loc["compiled", "graphs"] == 3 and out["graphs"].isna()["eager"]
