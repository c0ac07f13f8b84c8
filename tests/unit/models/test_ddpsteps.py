"""gpucourse.models.ddpsteps: chapter 03's DDP runs read back, on hand-made records."""
from types import SimpleNamespace

import pytest

from gpucourse.models import costs, ddpsteps


def fake_run(name="run", modes=None, buckets=((1.0, 1.0), (3.0, 5.0))):
    """Two ranks; per mode (step, forward, backward) ms per step; two buckets, each its time (ms) in each comm step."""
    modes = modes or {"no-ddp": [(10, 3, 6), (12, 3, 8), (30, 3, 8)], "ddp": [(14, 3, 8), (16, 3, 8), (15, 3, 8)],
                      "no-overlap": [(20, 3, 8), (22, 3, 8), (21, 3, 8)]}
    recs = [{"params": 1000, "grad_bytes": 4000, "buckets": [2000, 2000]}]
    recs += [{"mode": m, "step_ms": s, "forward_ms": f, "backward_ms": b} for m, steps in modes.items()
             for s, f, b in steps]
    recs += [{"mode": "comm", "bucket_ms": list(b)} for b in zip(*buckets)]
    return SimpleNamespace(name=name, world_size=2, metrics={0: recs, 1: recs})


def test_step_ms_is_the_median_per_rank_and_spread_the_percentiles():
    run = fake_run()
    assert ddpsteps.step_times(run, "no-ddp") == [10, 12, 30]
    assert ddpsteps.step_ms(run, "no-ddp") == 12  # the median: the 30 ms outlier does not move it
    assert ddpsteps.step_ms(run, "no-ddp", "backward_ms") == 8
    assert ddpsteps.spread(run, "no-ddp") == (10, 30)
    assert ddpsteps.throughput(run, 64, "ddp") == pytest.approx(2 * 64 / 0.015)
    with pytest.raises(ValueError, match="mode 'nope'"):
        ddpsteps.step_ms(run, "nope")


def test_bucket_times_are_means_and_medians_do_not_add():
    run = fake_run()
    assert ddpsteps.bucket_ms(run) == [1.0, 4.0]  # bucket 2 took 3 then 5 ms
    median_sum, median_total = ddpsteps.median_sum_vs_total(run)
    assert (median_sum, median_total) == (5.0, 5.0)
    skewed = fake_run(buckets=((1.0, 1.0, 9.0), (9.0, 1.0, 1.0)))
    assert ddpsteps.median_sum_vs_total(skewed) == (2.0, 10.0)  # per-bucket medians miss every slow bucket


def test_predict_uses_the_runs_own_compute_and_buckets():
    run = fake_run()
    step = ddpsteps.predict(run, overlap=False)
    assert step.compute == pytest.approx(0.012) and step.comm == pytest.approx(0.005)
    assert step.step == pytest.approx(0.017)  # no overlap: compute + all of comm
    hidden = ddpsteps.predict(run, overlap=True)
    assert hidden.step < step.step
    fit = costs.AlphaBeta(1e-4, 1e-9)
    line = ddpsteps.predict(run, overlap=False, comm="line", fit=fit)
    assert line.comm == pytest.approx(2 * costs.collective_time("all_reduce", 2000, 2, 1e-4, 1e-9))
    with pytest.raises(ValueError, match="needs fit"):
        ddpsteps.predict(run, overlap=False, comm="line")


def test_overlap_cost_is_zero_for_free_overlap_and_one_for_serial():
    assert ddpsteps.overlap_cost({"compute": 10, "comm": 4, "both": 10}) == (0.0, 0.0)
    assert ddpsteps.overlap_cost({"compute": 10, "comm": 4, "both": 14}) == (1.0, 1.0)
    assert ddpsteps.overlap_cost({"compute": 10, "comm": 4, "both": 9}) == (-0.25, 0.0)  # noise, clipped
    run = SimpleNamespace(world_size=2, metrics={r: [{"trial": "compute", "seconds": s} for s in (0.01, 0.02, 0.5)]
                                                 for r in (0, 1)})
    assert ddpsteps.trial_ms(run, ("compute",)) == {"compute": pytest.approx(20.0)}


def test_why_missed_names_load_and_noise_only_when_the_goal_is_missed():
    assert ddpsteps.why_missed(0.1, load=9, cores=2, noise=0.5, goal=0.2) == ""
    both = ddpsteps.why_missed(0.3, load=9, cores=2, noise=0.5, goal=0.2)
    assert "load 9.0 on 2 cores" in both and "50%" in both
    assert "neither" in ddpsteps.why_missed(-0.3, load=1, cores=2, noise=0.1, goal=0.2)
