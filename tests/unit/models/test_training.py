"""gpucourse.models.training: a large-batch run's records read back, and the linear scaling rule's two
assumptions measured, checked on cases whose answer is known."""
import math

import pytest
import torch
from torch import nn

from gpucourse.models import training


def records():
    head = {"rule": "keep", "header": True, "global_batch": 32, "base_lr": 0.1, "target_lr": 0.1}
    pts = [{"rule": "keep", "epoch": 0.0, "opt_step": 0, "step_losses": [], "test_acc": 0.1},
           {"rule": "keep", "epoch": 0.5, "opt_step": 4, "step_losses": [2.3, 2.9, 2.1], "test_acc": 0.4},
           {"rule": "keep", "epoch": 1.0, "opt_step": 8, "step_losses": [1.5, 1.2], "test_acc": 0.6},
           {"rule": "keep", "epoch": 1.5, "opt_step": 12, "step_losses": [4.0], "test_acc": 0.7}]
    return [head, {"step": 1}, *pts]


def test_curves_group_the_records_by_rule_and_read_them():
    run = training.curves(records())["keep"]
    assert run["header"]["global_batch"] == 32 and [p["opt_step"] for p in run["points"]] == [0, 4, 8, 12]
    pts = run["points"]
    assert training.first_loss(pts) == 2.3
    assert training.early_max_loss(pts) == 2.9  # the 4.0 after epoch 1 does not count
    assert training.at_epoch(pts, 0.9)["test_acc"] == 0.6
    with pytest.raises(ValueError, match="before its header"):
        training.curves(records()[2:])


def test_noise_is_zero_when_every_sample_has_the_same_gradient():
    torch.manual_seed(0)
    x, y = torch.ones(20, 3), torch.zeros(20, dtype=torch.long)  # identical samples
    net = nn.Linear(3, 2)
    noise, g2 = training.gradient_noise(net, (x, y), batch=4, draws=3, generator=torch.Generator().manual_seed(0))
    assert noise < 1e-12 and g2 > 0


def test_one_small_step_is_one_big_step_and_the_weights_are_restored():
    torch.manual_seed(0)
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    net = nn.Linear(3, 2)
    before = net.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    assert training.k_steps_vs_one(net, (x, y), k=1, lr=0.1, batch=4, draws=2, generator=gen) < 1e-6
    assert 0 < training.k_steps_vs_one(net, (x, y), k=4, lr=1.0, batch=4, draws=2, generator=gen)
    assert torch.equal(net.weight, before)


def test_sgd_assumptions_measure_every_state():
    torch.manual_seed(0)
    x, y = torch.randn(32, 3), torch.randint(0, 2, (32,))
    states = {"a": nn.Linear(3, 2).state_dict(), "b": nn.Linear(3, 2).state_dict()}
    m = training.sgd_assumptions(lambda: nn.Linear(3, 2), states, (x, y), [2, 4], lr=0.1, ks=(2,),
                                 generator=torch.Generator().manual_seed(0))
    assert list(m) == ["a", "b"] and list(m["a"]["b_noise"]) == [2, 4] and list(m["a"]["ks"]) == [2]
    assert math.isclose(m["a"]["trace"], sum(m["a"]["b_noise"].values()) / 2)
    assert math.isclose(m["a"]["noise_scale"], m["a"]["trace"] / m["a"]["g2"])
    with pytest.raises(ValueError, match="batch size"):
        training.sgd_assumptions(lambda: nn.Linear(3, 2), states, (x, y), [], lr=0.1)


@pytest.mark.parametrize("items, world, drop_last", [(11, 2, False), (11, 2, True), (50_000, 64, False),
                                                     (50_000, 64, True), (12, 4, False), (3, 4, False)])
def test_sampler_shard_is_torchs_distributed_sampler(items, world, drop_last):
    from torch.utils.data.distributed import DistributedSampler

    got = training.sampler_shard(items, world, drop_last=drop_last)
    samplers = [DistributedSampler(range(items), num_replicas=world, rank=r, shuffle=False, drop_last=drop_last)
                for r in range(world)]
    read = [i for s in samplers for i in s]
    assert got["per_rank"] == len(samplers[0])
    assert got["padded"] == len(read) - len(set(read)) and got["dropped"] == items - len(set(read))


def test_steps_per_epoch_counts_each_ranks_loader():
    assert training.steps_per_epoch(16384, 32, 4) == 128 and training.steps_per_epoch(16384, 32, 1) == 512
    assert training.steps_per_epoch(11, 4, 2) == 2  # 6 samples a rank: a batch of 4 and one of 2
    with pytest.raises(ValueError, match="batch_per_rank"):
        training.steps_per_epoch(10, 0, 2)


def test_batch_tradeoff_is_mccandlishs_hyperbola():
    for b in (10.0, 1000.0, 1e5):
        t = training.batch_tradeoff(b, 1000.0)
        assert (t["steps"] - 1) * (t["examples"] - 1) == pytest.approx(1)
    assert training.batch_tradeoff(1000, 1000) == {"steps": 2, "examples": 2}  # at B_crit: twice each minimum
    with pytest.raises(ValueError, match="batch"):
        training.batch_tradeoff(0, 10)


def test_young_daly_interval_minimises_the_time_lost():
    c, m = 60.0, 3 * 3600.0
    best = training.young_daly_interval(c, m)
    assert best == pytest.approx(math.sqrt(2 * c * m))
    lost = lambda tau: training.checkpoint_overhead(tau, c, m)["total"]  # noqa: E731
    assert lost(best) < lost(best * 0.8) and lost(best) < lost(best * 1.25)
    parts = training.checkpoint_overhead(best, c, m, restart_s=600)
    assert parts["saving"] == pytest.approx(parts["rework"]) and parts["restart"] == pytest.approx(600 / m)
    assert training.mean_time_between_failures(54 * 86400, 419) == pytest.approx(54 * 24 / 419 * 3600)
    with pytest.raises(ValueError):
        training.young_daly_interval(1, 0)


# --- chapter 08c: goodput, and the slow rank ------------------------------------------------------------------
def _simulated_goodput(interval, lost, mtbf, lag, seed=0, horizon=3e6):
    """Work kept / wall time of a job simulated failure by failure (exponential times between failures): each
    period is `interval` of work then `lost` of saving; its checkpoint is complete `lag` after the period ends; a
    failure rolls back to the newest complete checkpoint."""
    import random

    rng = random.Random(seed)
    t, progress, kept, pending = 0.0, 0.0, 0.0, []
    fail = rng.expovariate(1 / mtbf)
    while t < horizon:
        end = t + interval + lost
        if fail < end:
            kept = max([kept] + [w for at, w in pending if at <= fail])
            t, progress, pending = fail, kept, []
            fail = t + rng.expovariate(1 / mtbf)
            continue
        t, progress = end, progress + interval
        kept = max([kept] + [w for at, w in pending if at <= t])
        pending = [(at, w) for at, w in pending if at > t] + [(t + lag, progress)]
    return progress / t


@pytest.mark.parametrize("lost, lag", [(10.0, 0.0), (1.0, 30.0)])
def test_goodput_matches_a_simulation_of_failures(lost, lag):
    interval, mtbf = 100.0, 5000.0
    model = training.goodput(interval, lost, mtbf, lag_s=lag)
    assert _simulated_goodput(interval, lost, mtbf, lag) == pytest.approx(model, abs=0.01)


def test_goodput_peaks_at_young_daly_and_a_cheaper_save_allows_a_shorter_interval():
    mtbf = 50 * 3600.0
    for lost in (0.2, 5.0):
        taus = [10 ** (k / 200) for k in range(0, 1200)]
        best = max(taus, key=lambda t: training.goodput(t, lost, mtbf))
        assert best == pytest.approx(training.young_daly_interval(lost, mtbf), rel=0.05)
    assert training.goodput(30.0, 0.2, mtbf) > training.goodput(30.0, 5.0, mtbf)
    assert training.goodput(30.0, 0.2, mtbf, lag_s=10) < training.goodput(30.0, 0.2, mtbf)
    assert training.goodput(30.0, 0.2, mtbf, restart_s=600) < training.goodput(30.0, 0.2, mtbf)
    assert training.goodput(1e9, 0.2, mtbf) == 0.0  # never saving: every failure loses more than the MTBF
    with pytest.raises(ValueError):
        training.goodput(0, 1, 1)
    with pytest.raises(ValueError):
        training.goodput(1, -1, 1)


def test_scaled_mtbf_divides_llama3s_by_the_gpu_ratio():
    f = training.LLAMA3_FAILURES
    llama = training.mean_time_between_failures(f["days"] * 86400, f["unexpected"])
    assert llama / 3600 == pytest.approx(3.093, abs=1e-3)
    assert training.scaled_mtbf(llama, f["gpus"], 1024) == pytest.approx(16 * llama)
    assert training.scaled_mtbf(llama, f["gpus"], f["gpus"]) == llama
    with pytest.raises(ValueError):
        training.scaled_mtbf(llama, f["gpus"], 0)


def test_the_slowest_rank_sets_a_synchronous_step():
    assert training.synchronous_step_time([0.1, 0.1, 0.6], 0.05) == pytest.approx(0.65)
    assert training.synchronous_step_time([0.3]) == 0.3
    with pytest.raises(ValueError):
        training.synchronous_step_time([])


def test_waits_and_rank_steps_take_the_union_of_overlapping_waits():
    arrivals = {1: {0: 10.0, 1: 10.5}, 2: {0: 10.01, 1: 10.51}, 3: {0: 11.0}}  # #3: rank 1 never called it
    assert training.waits(arrivals) == {1: {0: 0.5, 1: 0.0}, 2: {0: pytest.approx(0.5), 1: 0.0}}
    steps = {r: [{"step": 0, "phase": "slow", "step_s": 0.6, "start": 9.95, "end": 10.55}] for r in (0, 1)}
    rows = training.rank_steps(steps, arrivals)
    assert [(r["rank"], r["phase"]) for r in rows] == [(0, "slow"), (1, "slow")]
    assert rows[0]["wait_s"] == pytest.approx(0.51) and rows[0]["busy_s"] == pytest.approx(0.09)  # not 1.0 waited
    assert rows[1]["wait_s"] == 0 and rows[1]["busy_s"] == pytest.approx(0.6)
    found = training.straggler(rows)
    assert found["rank"] == 1 and found["slowdown"] == pytest.approx(0.6 / 0.09)
    assert found["extra_s"] == pytest.approx(0.51)
    with pytest.raises(ValueError, match="two ranks"):
        training.straggler(rows[:1])


def test_a_hiccup_anywhere_slows_the_step_more_often_as_ranks_grow():
    import random

    assert training.expected_step_with_stragglers(0.1, 0.5, 0.0, 1024) == 0.1
    assert training.expected_step_with_stragglers(0.1, 0.5, 1.0, 2) == pytest.approx(0.6)
    assert training.expected_step_with_stragglers(0.1, 0.5, 0.01, 1) == pytest.approx(0.105)
    at = [training.expected_step_with_stragglers(0.1, 0.5, 1e-3, n) for n in (2, 1024, 16384)]
    assert at == sorted(at) and at[-1] == pytest.approx(0.6, abs=1e-6)
    rng = random.Random(0)  # simulated: a step is slow when any of 64 ranks draws a hiccup
    steps = [0.1 + 0.5 * any(rng.random() < 0.01 for _ in range(64)) for _ in range(20000)]
    assert sum(steps) / len(steps) == pytest.approx(training.expected_step_with_stragglers(0.1, 0.5, 0.01, 64),
                                                     rel=0.02)
    with pytest.raises(ValueError):
        training.expected_step_with_stragglers(0.1, 0.5, 1.5, 2)


# --- chapter 08b: uneven shards and hangs -------------------------------------------------------------------------
def test_uneven_shards_count_what_each_fix_costs():
    u = training.uneven_shards([7, 4, 5])  # chapter 08b's script's shards at 3 ranks
    assert (u["common_steps"], u["dropped"], u["join_steps"], u["shadowed"]) == (4, 4, 7, 5)
    assert u["idle_share"] == pytest.approx(5 / 21) and u["dropped_share"] == pytest.approx(4 / 16)
    even = training.uneven_shards([3, 3])
    assert even["dropped"] == even["shadowed"] == 0 and even["idle_share"] == 0
    assert training.uneven_shards([2, 0])["common_steps"] == 0  # a rank with no data: the fix trains nothing
    with pytest.raises(ValueError):
        training.uneven_shards([])
    with pytest.raises(ValueError):
        training.uneven_shards([3, -1])


def test_uneven_shards_match_a_simulation_of_join():
    """Under Join every rank steps until the last is done; a rank out of batches shadows each step with zeros."""
    shards = [7, 4, 5, 7, 1]
    steps = max(shards)
    shadowed = sum(1 for b in shards for s in range(steps) if s >= b)
    u = training.uneven_shards(shards)
    assert u["join_steps"] == steps and u["shadowed"] == shadowed
    assert u["dropped"] == sum(b - min(shards) for b in shards)


def test_default_timeouts_are_the_installed_torchs():
    from torch.distributed import constants

    assert training.DEFAULT_TIMEOUTS_S["gloo"] == constants.default_pg_timeout.total_seconds()
    if constants.default_pg_nccl_timeout is not None:  # None in a torch built without NCCL (a CPU build)
        assert training.DEFAULT_TIMEOUTS_S["nccl"] == constants.default_pg_nccl_timeout.total_seconds()


def test_a_hang_idles_every_gpu_for_the_wait():
    assert training.hang_gpu_hours(1024, 600) == pytest.approx(1024 / 6)
    assert training.hang_gpu_hours(8, 0) == 0
    with pytest.raises(ValueError):
        training.hang_gpu_hours(0, 600)
    with pytest.raises(ValueError):
        training.hang_gpu_hours(8, -1)


# --- chapter 08d: training through failures -----------------------------------------------------------------------
def test_a_lost_replica_costs_its_share_of_the_samples_not_every_replicas_time():
    # tests/unit/chapters/test_ch08d.py's run: 2 replicas, 9 committed steps, 3 of them with one replica missing
    lost = training.replica_loss(2, 3, 9)
    assert lost["samples"] == pytest.approx(3 / 18) and lost["full_restart"] == pytest.approx(3 / 9)
    f = training.LLAMA3_FAILURES
    llama = training.replica_loss(128, 600, f["days"] * 86400, failures=f["unexpected"])
    assert llama["samples"] * 128 == pytest.approx(llama["full_restart"])
    assert training.replica_loss(4, 10, 100, missing=2)["samples"] == pytest.approx(0.05)
    with pytest.raises(ValueError):
        training.replica_loss(2, 3, 9, missing=3)
    with pytest.raises(ValueError):
        training.replica_loss(2, 3, 0)
