"""Tests for gpucourse.models.costs against hand-computed numbers.

Expected values are written out as arithmetic, never computed with the
function under test, so a wrong formula fails here.
"""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from gpucourse import costs
from gpucourse.models.costs import (
    INTERCONNECTS,
    AlphaBeta,
    algbw,
    busbw,
    busbw_factor,
    bytes_moved_per_rank,
    collective_time,
    ddp_step_from_bucket_times,
    ddp_step_time,
    fit_alpha_beta,
    dualpipev_bubble,
    pipeline_bubble_fraction,
    pipeline_bubble_ratio,
    pipeline_order_from_torch,
    pipeline_peak_activations,
    pipeline_stage_costs,
    scaling_efficiency,
    simulate_pipeline,
    zero_comm_volume,
    zero_memory_bytes,
)

MiB = 2**20


# --- nccl-tests definitions ----------------------------------------------------

def test_algbw_is_size_over_time():
    assert algbw(1e9, 0.5) == pytest.approx(2e9)


@pytest.mark.parametrize("collective, n, factor", [
    ("all_reduce", 4, 1.5),        # 2*(4-1)/4
    ("all_reduce", 8, 1.75),       # 2*7/8
    ("all_reduce", 2, 1.0),        # 2*1/2
    ("all_gather", 8, 0.875),      # 7/8
    ("reduce_scatter", 4, 0.75),   # 3/4
    ("all_to_all", 4, 0.75),       # 3/4
    ("broadcast", 8, 1.0),
    ("reduce", 8, 1.0),
    ("send_recv", 2, 1.0),
    ("p2p", 2, 1.0),
])
def test_busbw_factor_matches_nccl_tests(collective, n, factor):
    assert busbw_factor(collective, n) == pytest.approx(factor)


def test_all_reduce_busbw_n4_is_1p5_algbw():
    # 1 GB in 0.5 s: algbw 2 GB/s, busbw 1.5 * 2 = 3 GB/s
    assert busbw("all_reduce", 1e9, 0.5, 4) == pytest.approx(3e9)


def test_all_gather_busbw_uses_total_size():
    # 8 MB total output in 1 ms on 8 ranks: algbw 8 GB/s, busbw 7/8 * 8 = 7 GB/s
    assert busbw("all_gather", 8e6, 1e-3, 8) == pytest.approx(7e9)


def test_bytes_moved_per_rank():
    assert bytes_moved_per_rank("all_reduce", 1000, 4) == pytest.approx(1500)   # 2*3/4*1000
    assert bytes_moved_per_rank("all_gather", 1000, 4) == pytest.approx(750)    # 3/4*1000
    assert bytes_moved_per_rank("reduce_scatter", 800, 8) == pytest.approx(700)  # 7/8*800
    assert bytes_moved_per_rank("broadcast", 1000, 4) == pytest.approx(1000)
    assert bytes_moved_per_rank("all_reduce", 1000, 1) == 0


# --- alpha-beta model ---------------------------------------------------------

def test_ring_all_reduce_time_by_hand():
    # n=4, S=1 MiB, alpha=10 us, beta=1 ns/B:
    # 2*(4-1)*10e-6 = 60e-6 s; 2*3/4 * 1048576 B = 1572864 B -> 1.572864e-3 s
    t = collective_time("all_reduce", MiB, 4, 10e-6, 1e-9)
    assert t == pytest.approx(60e-6 + 1.572864e-3)


def test_ring_all_gather_and_reduce_scatter_time_by_hand():
    # n=8, S=8 MB, alpha=10 us, beta=0.1 ns/B: 7*10e-6 + 7e6*1e-10 = 7e-5 + 7e-4
    for c in ("all_gather", "reduce_scatter"):
        assert collective_time(c, 8e6, 8, 10e-6, 1e-10) == pytest.approx(7.7e-4)


def test_ring_broadcast_time_by_hand():
    # n=4, S=1e6: 3*10e-6 + 1e6*1e-9 = 3e-5 + 1e-3
    assert collective_time("broadcast", 1e6, 4, 10e-6, 1e-9) == pytest.approx(1.03e-3)


def test_tree_all_reduce_time_by_hand():
    # n=8: log2(8)=3; 2*3*10e-6 + 2*1e6*1e-9 = 6e-5 + 2e-3
    t = collective_time("all_reduce", 1e6, 8, 10e-6, 1e-9, algorithm="tree")
    assert t == pytest.approx(2.06e-3)


def test_tree_beats_ring_for_small_messages_on_many_ranks():
    ring = collective_time("all_reduce", 1024, 64, 10e-6, 1e-9)
    tree = collective_time("all_reduce", 1024, 64, 10e-6, 1e-9, algorithm="tree")
    assert tree < ring


def test_single_rank_costs_nothing():
    assert collective_time("all_reduce", MiB, 1, 10e-6, 1e-9) == 0.0


# --- fitting -----------------------------------------------------------------

def test_fit_recovers_alpha_beta_from_noisy_synthetic_data():
    rng = np.random.default_rng(0)
    alpha, beta, n = 20e-6, 1 / 5e9, 8
    sizes = np.logspace(10, 28, 19, base=2)  # 1 KiB .. 256 MiB
    # ring all_reduce by hand: 2(n-1) alpha + 2(n-1)/n S beta
    clean = 2 * (n - 1) * alpha + 2 * (n - 1) / n * sizes * beta
    times = clean * (1 + 0.02 * rng.standard_normal(sizes.size))
    fit = fit_alpha_beta(sizes, times, "all_reduce", n=n)
    assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.beta == pytest.approx(beta, rel=0.05)
    assert fit.bandwidth == pytest.approx(5e9, rel=0.05)
    assert fit.predict(MiB) == pytest.approx(14 * alpha + 1.75 * MiB * beta, rel=0.05)


def test_fit_clips_negative_latency_to_zero():
    # pure bandwidth data with a negative offset: the free fit gives alpha < 0
    sizes = np.array([1e6, 2e6, 4e6, 8e6])
    times = sizes * 1e-9 - 1e-5
    fit = fit_alpha_beta(sizes, times, "send_recv", n=2)
    assert fit.alpha == 0.0
    assert fit.beta > 0


def test_fit_with_single_size_raises():
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_alpha_beta([MiB, MiB, MiB], [1e-3, 1.1e-3, 0.9e-3], n=4)


def test_fit_with_mismatched_lengths_raises():
    with pytest.raises(ValueError, match="same length"):
        fit_alpha_beta([1, 2, 3], [1e-3, 2e-3], n=4)


def test_alphabeta_str_and_bare_predict():
    ab = AlphaBeta(35.2e-6, 1 / 1.9e9)
    assert str(ab) == "α = 35.2 µs, β⁻¹ = 1.9 GB/s"
    # a bare AlphaBeta is one link: alpha + S*beta = 10e-6 + 1e6*1e-9
    assert AlphaBeta(10e-6, 1e-9).predict(1e6) == pytest.approx(1.01e-3)


# --- interconnect presets ------------------------------------------------------

def test_interconnect_presets():
    expected_gbps = {
        "NVLink 4 (H100 SXM)": 450, "NVLink 3 (A100 SXM)": 300, "PCIe 5 x16": 64,
        "PCIe 4 x16": 32, "InfiniBand NDR 400G": 50, "InfiniBand HDR 200G": 25, "100 GbE": 12.5,
    }
    assert set(INTERCONNECTS) == set(expected_gbps)
    for name, gbps in expected_gbps.items():
        ic = INTERCONNECTS[name]
        assert ic.name == name
        assert ic.bandwidth_bytes_per_s == pytest.approx(gbps * 1e9)
        assert ic.beta == pytest.approx(1 / (gbps * 1e9))
        assert 1e-6 <= ic.alpha <= 50e-6
        assert "not measured" in ic.source
    assert INTERCONNECTS["100 GbE"].alpha > INTERCONNECTS["InfiniBand NDR 400G"].alpha
    with pytest.raises(dataclasses.FrozenInstanceError):
        INTERCONNECTS["PCIe 4 x16"].alpha = 0


# --- ZeRO ----------------------------------------------------------------------

@pytest.mark.parametrize("stage, paper_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_memory_matches_paper_table(stage, paper_gb):
    # ZeRO paper, Psi = 7.5B params, N_d = 64, K = 12; table values rounded to 0.1 GB
    got_gb = zero_memory_bytes(7.5e9, 64, stage) / 1e9
    assert abs(got_gb - paper_gb) <= 0.05


def test_zero_memory_exact_formulas():
    psi, n = 7.5e9, 64
    assert zero_memory_bytes(psi, n, 0) == pytest.approx(16 * psi)
    assert zero_memory_bytes(psi, n, 1) == pytest.approx(4 * psi + 12 * psi / n)   # 31.40625e9
    assert zero_memory_bytes(psi, n, 2) == pytest.approx(2 * psi + 14 * psi / n)   # 16.640625e9
    assert zero_memory_bytes(psi, n, 3) == pytest.approx(1.875e9)                  # 16*7.5e9/64


def test_zero_memory_offload_counts_gpu_bytes_only():
    psi, n = 1e9, 8
    assert zero_memory_bytes(psi, n, 1, offload=True) == pytest.approx(4e9)    # fp16 params+grads
    assert zero_memory_bytes(psi, n, 2, offload=True) == pytest.approx(2e9)    # fp16 params
    assert zero_memory_bytes(psi, n, 3, offload=True) == pytest.approx(0.25e9)  # 2 B * 1e9 / 8


def test_zero_comm_volume():
    assert zero_comm_volume(1e9, 0) == 4e9   # 2 * Psi * 2 bytes
    assert zero_comm_volume(1e9, 2) == 4e9
    assert zero_comm_volume(1e9, 3) == 6e9   # 1.5x data parallel
    assert zero_comm_volume(1e9, 1, bytes_per_elem=4) == 8e9


# --- pipeline bubble -------------------------------------------------------------

def test_pipeline_bubble_fraction():
    assert pipeline_bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert pipeline_bubble_fraction(8, 32) == pytest.approx(7 / 39)
    assert pipeline_bubble_fraction(1, 16) == 0.0
    assert pipeline_bubble_fraction(2, 4, v=2) == pytest.approx(1 / 9)  # (p-1)/(v*m+p-1)
    assert pipeline_bubble_fraction(4, 8, v=4) == pytest.approx(3 / 35)


def test_pipeline_bubble_ratio_is_bubble_over_ideal_time():
    assert pipeline_bubble_ratio(4, 4) == pytest.approx(3 / 4)  # 3/7 of the step = 3/4 of the ideal step
    assert pipeline_bubble_ratio(2, 4, v=2) == pytest.approx(1 / 8)  # (p-1)/(v*m)
    assert pipeline_bubble_ratio(1, 3) == 0.0


UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _step_and_busy(timeline):
    step = max(end for acts in timeline.values() for _, _, end in acts)
    return step, {r: sum(end - start for _, start, end in acts) for r, acts in timeline.items()}


def test_simulated_gpipe_and_1f1b_take_m_plus_p_minus_1_slots():
    gpipe = simulate_pipeline({0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]}, UNIT)
    # stage 1 runs F0 at 1-2, F1 2-3, B0 3-5, B1 5-7; stage 0's B0 waits for it: 5-7, B1 7-9
    assert gpipe[0] == [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 7, 9)]
    assert gpipe[1] == [("1F0", 1, 2), ("1F1", 2, 3), ("1B0", 3, 5), ("1B1", 5, 7)]
    one_f_one_b = simulate_pipeline({0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"],
                                     1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]}, UNIT)
    step, busy = _step_and_busy(one_f_one_b)
    assert step == 12 and busy == {0: 9, 1: 9}  # (m+p-1)*3 = 12: idle 3/12 = (p-1)/(m+p-1)
    assert one_f_one_b[0][2] == ("0B0", 4, 6)  # stage 1's B0 ran 2-4


def test_simulated_interleaving_divides_the_bubble_by_v():
    # p=2, v=2 (stages 0,2 on rank 0; 1,3 on rank 1), m=2, chunks half as long: F 0.5, B 1
    half = {"F": 0.5, "B": 1.0}
    timeline = simulate_pipeline({0: ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
                                  1: ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"]}, half)
    step, busy = _step_and_busy(timeline)
    assert step == 7.5 and busy == {0: 6, 1: 6}  # idle 1.5 = (p-1)/(v*m) of the 6 units of work
    assert timeline[1][3] == ("3B0", 2, 3)


def test_simulated_zero_bubble_sends_the_input_gradient_before_the_weight_gradient():
    timeline = simulate_pipeline({0: ["0F0", "0I0", "0W0"], 1: ["1F0", "1I0", "1W0"]}, UNIT)
    assert timeline[1] == [("1F0", 1, 2), ("1I0", 2, 3), ("1W0", 3, 4)]
    assert timeline[0][1] == ("0I0", 3, 4)  # starts as soon as stage 1's I is done, while stage 1 runs W


def test_simulate_pipeline_takes_one_action_s_own_duration_before_its_kind_s():
    timeline = simulate_pipeline({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]}, {**UNIT, "1F0": 3.0})
    assert timeline[1] == [("1F0", 1, 4), ("1B0", 4, 6)] and timeline[0][1] == ("0B0", 6, 8)


def test_simulate_pipeline_rejects_orders_that_cannot_finish_and_bad_actions():
    with pytest.raises(ValueError, match="never finish"):
        simulate_pipeline({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]}, UNIT)
    with pytest.raises(ValueError, match="'0X1'"):
        simulate_pipeline({0: ["0X1"]}, UNIT)
    with pytest.raises(ValueError, match="'W'"):
        simulate_pipeline({0: ["0F0", "0I0", "0W0"]}, {"F": 1, "I": 1})


# torch 2.13's ScheduleDualPipeV order for 2 ranks (stages 0 and 3 on rank 0, 1 and 2 on rank 1), 4 micro-batches:
# its pipeline_order, each overlapped pair "(0F3;3B1)OVERLAP_F_B" written as a tuple. test_teaching_claims checks
# the installed torch still plans it.
DUALPIPEV_P2_M4 = {
    0: ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", ("0F3", "3B1"), ("3F2", "0B0"), "3B2", ("3F3", "0B1"), "3B3",
        "0I2", "0W2", "0I3", "0W3"],
    1: ["1F0", "2F0", "1F1", "2F1", "1F2", "2B0", ("2F2", "1B0"), ("1F3", "2B1"), ("2F3", "1B1"), "2B2", "1B2", "2I3",
        "1I3", "2W3", "1W3"],
}


def test_simulated_block_runs_its_actions_together_and_ends_them_together():
    timeline = simulate_pipeline({0: ["0F0", ("0F1", "0B0")], 1: ["1F0", "1B0", "1F1", "1B1"]}, UNIT)
    # 1F0 1-2, 1B0 2-4; the block waits for 1B0 (its B) and lasts F + B = 3: 4-7, both ending at 7
    assert timeline[0][1:] == [("0F1", 4, 7), ("0B0", 4, 7)]
    assert timeline[1][2] == ("1F1", 7, 8)  # 0F1's output is ready only at the block's end
    short = simulate_pipeline({0: ["0F0", ("0F1", "0B0")], 1: ["1F0", "1B0", "1F1", "1B1"]}, {**UNIT, "F&B": 2.0})
    assert short[0][1] == ("0F1", 4, 6)


def test_dualpipev_order_has_deepseek_s_bubble_and_holds_2p_plus_1_chunks():
    timeline = simulate_pipeline(DUALPIPEV_P2_M4, UNIT)  # F = I = W = 1, B = 2, pairs as one block of F + B
    step, _ = _step_and_busy(timeline)
    busy = {r: sum(end - start for start, end in {(start, end) for _, start, end in acts})  # a block once
            for r, acts in timeline.items()}
    assert busy == {0: 24, 1: 24}  # 4 micro-batches x 2 stages x (F + B) = 4 * 2 * 3
    assert {r: step - b for r, b in busy.items()} == {0: 2, 1: 2}
    assert dualpipev_bubble(2, 1, 2, 1) == (2 - 1) * ((1 + 2) + 2 - 3 * 1) == 2
    assert dualpipev_bubble(4, 1, 2, 1, overlapped=2) == 3 * (2 + 2 - 3)
    assert pipeline_peak_activations(2, 4, 2, 0, "DualPipeV") == 5  # counted by hand from DUALPIPEV_P2_M4, rank 0


def test_pipeline_order_from_torch_keeps_compute_and_pairs():
    order = ["0F0", "3I0", "(0F3;3B1)OVERLAP_F_B", "0SEND_F0", "0REDUCE_GRAD", "3W0"]
    assert pipeline_order_from_torch(order) == ["0F0", "3I0", ("0F3", "3B1"), "3W0"]
    assert pipeline_order_from_torch(order, blocks=False) == ["0F0", "3I0", "0F3", "3B1", "3W0"]


def test_pipeline_peak_activations_1f1b_and_interleaved():
    assert [pipeline_peak_activations(4, 8, rank=r) for r in range(4)] == [4, 3, 2, 1]
    assert pipeline_peak_activations(4, 2) == 2  # m < p: all of them
    assert pipeline_peak_activations(4, 6, schedule="GPipe") == 6
    # interleaved, p = 2, v = 2, m = 4: rank 0 runs (2-1)*2 + 2*1 = 4 warm-up forwards, then one more: 5 chunks
    assert [pipeline_peak_activations(2, 4, 2, r, "Interleaved1F1B") for r in (0, 1)] == [5, 3]
    assert pipeline_peak_activations(2, 1, 2, 0, "Interleaved1F1B") == 2  # m * v caps it
    # rank 0, p | m: v*p + p - 1 chunks = p (1 + (p-1)/(p v)) micro-batches of the rank's layers (Korthikanti)
    assert pipeline_peak_activations(4, 8, 4, 0, "Interleaved1F1B") / 4 == pytest.approx(4 * (1 + 3 / 16))


def test_pipeline_stage_costs_put_embeddings_first_and_the_head_last():
    d, vocab, seq = 8, 100, 16
    stages = pipeline_stage_costs([1, 1], d, vocab, seq)
    block = 12 * 8 * 8
    assert stages[0]["params"] == block + (100 + 16) * 8 and stages[1]["params"] == block + 100 * 8
    assert stages[0]["flops_per_token"] == 6 * block + 12 * 8 * 16
    assert stages[1]["flops_per_token"] == 6 * (block + 100 * 8) + 12 * 8 * 16


@pytest.mark.parametrize("call, match", [
    (lambda: dualpipev_bubble(0, 1, 2, 1), "ranks"),
    (lambda: dualpipev_bubble(2, 1, 1, 2), "weight"),
    (lambda: pipeline_peak_activations(2, 4, rank=2), "rank"),
    (lambda: pipeline_peak_activations(2, 3, 2, schedule="DualPipeV"), "m >= 2p"),
    (lambda: pipeline_peak_activations(2, 4, 2, schedule="ZBVZeroBubble"), "schedule"),
    (lambda: pipeline_stage_costs([], 8, 10, 4), "layers_per_stage"),
    (lambda: simulate_pipeline({0: [()]}, UNIT), "empty block"),
])
def test_new_pipeline_models_reject_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- DDP step -----------------------------------------------------------------

def test_ddp_step_overlap_exposes_only_last_bucket():
    # 100 MiB grads, 25 MiB buckets -> 4 buckets; per bucket on n=4:
    # 6*10e-6 + 1.5*26214400*1e-9 = 6e-5 + 0.0393216 = 0.0393816 s
    r = ddp_step_time(0.5, 100 * MiB, 4, 10e-6, 1e-9)
    assert r.num_buckets == 4
    assert r.comm == pytest.approx(4 * 0.0393816)
    assert r.exposed == pytest.approx(0.0393816)
    assert r.step == pytest.approx(0.5393816)
    assert scaling_efficiency(step_s=r.step, base_step_s=0.5) == pytest.approx(0.5 / 0.5393816)
    assert r.efficiency == scaling_efficiency(step_s=r.step, base_step_s=r.compute)


def test_scaling_efficiency_from_throughputs_against_a_baseline_world_size():
    assert scaling_efficiency(180.0, 100.0, 2) == pytest.approx(0.9)  # 180 / (2 × 100)
    assert scaling_efficiency(300.0, 200.0, 4, 2) == pytest.approx(0.75)  # baseline N0 = 2: 300 / (4/2 × 200)
    # weak scaling: throughput = N × batch / step, so the step-time form agrees
    assert scaling_efficiency(step_s=0.25, base_step_s=0.2) == pytest.approx(
        scaling_efficiency(4 * 32 / 0.25, 32 / 0.2, 4))


def test_ddp_step_without_overlap_and_with_partial_bucket():
    # 60 MiB -> 25 + 25 + 10 MiB; 10 MiB bucket: 6e-5 + 1.5*10485760e-9 = 0.01578864
    r = ddp_step_time(0.5, 60 * MiB, 4, 10e-6, 1e-9, overlap=False)
    assert r.num_buckets == 3
    assert r.comm == pytest.approx(2 * 0.0393816 + 0.01578864)
    assert r.exposed == pytest.approx(r.comm)
    assert r.step == pytest.approx(0.5 + 2 * 0.0393816 + 0.01578864)


def test_ddp_step_comm_bound_cannot_hide_more_than_backward():
    # comm 0.1575264 s vs compute 0.01 s, of which backward 2/3 * 0.01: exposed = 0.1575264 - 0.01 * 2/3
    r = ddp_step_time(0.01, 100 * MiB, 4, 10e-6, 1e-9)
    assert r.backward == pytest.approx(0.01 * 2 / 3)
    assert r.exposed == pytest.approx(0.1575264 - 0.01 * 2 / 3)
    assert r.step == pytest.approx(0.01 + 0.1575264 - 0.01 * 2 / 3)


def test_ddp_step_overlap_hides_behind_backward_not_forward():
    # comm 0.1575264 s (4 buckets of 0.0393816) lies between backward (2/3 * 0.15 = 0.1) and forward +
    # backward (0.15). The forward pass runs before any gradient exists, so only backward hides comm:
    # exposed = max(0.0393816, 0.1575264 - 0.1) = 0.0575264 (hiding behind all 0.15 s would leave only
    # the last bucket, 0.0393816, exposed).
    r = ddp_step_time(0.15, 100 * MiB, 4, 10e-6, 1e-9)
    assert r.backward == pytest.approx(0.1)
    assert r.exposed == pytest.approx(0.0575264)
    assert r.step == pytest.approx(0.15 + 0.0575264)
    # the backward share is a parameter: a measured 0.5 leaves 0.1575264 - 0.075 = 0.0825264 exposed
    r = ddp_step_time(0.15, 100 * MiB, 4, 10e-6, 1e-9, backward_fraction=0.5)
    assert r.backward == pytest.approx(0.075)
    assert r.exposed == pytest.approx(0.0825264)


def test_ddp_step_many_small_buckets_hide_behind_backward_only():
    # 100 buckets of 1e6 B at n = 2, alpha 0, 1 GB/s: each 2*(2-1)/2 * 1e6 * 1e-9 = 0.001 s, comm 0.1 s.
    # compute 0.12 s, backward 2/3 of it = 0.08 s: exposed = max(0.001, 0.1 - 0.08) = 0.02 s.
    r = ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6)
    assert r.num_buckets == 100 and r.comm == pytest.approx(0.1)
    assert r.exposed == pytest.approx(0.02)
    assert r.step == pytest.approx(0.14)
    # backward_fraction = 1 hides all but the last bucket; 0 hides nothing
    assert ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6, backward_fraction=1).exposed == \
        pytest.approx(0.001)
    assert ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6, backward_fraction=0).exposed == \
        pytest.approx(0.1)


def test_ddp_step_overlap_cost_charges_the_hidden_communication():
    # the 100-bucket case above: comm 0.1 s, backward 0.08 s, exposed 0.02 s, so 0.08 s ran hidden.
    # overlap_cost 0.5: compute loses half of the hidden time, 0.04 s: step = 0.12 + 0.02 + 0.04 = 0.18
    r = ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6, overlap_cost=0.5)
    assert r.exposed == pytest.approx(0.02) and r.hidden == pytest.approx(0.08)
    assert r.overlap_penalty == pytest.approx(0.04)
    assert r.step == pytest.approx(0.18)
    assert r.efficiency == pytest.approx(0.12 / 0.18)
    # overlap_cost 1 (compute and all-reduce share the cores): overlap buys nothing, the no-overlap step
    full = ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6, overlap_cost=1)
    serial = ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6, overlap=False)
    assert full.step == pytest.approx(0.22) and serial.step == pytest.approx(0.22)
    # the default, 0, is free overlap
    assert ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6).overlap_penalty == 0.0


def test_ddp_step_from_measured_bucket_times():
    # three buckets measured at 4, 3 and 2 ms (the last is sent last: exposed at least), compute 12 ms of which
    # backward 2/3 = 8 ms: comm 9 ms, exposed = max(2, 9 - 8) = 2 ms, hidden 7 ms; overlap cost 0.5 -> 3.5 ms
    r = ddp_step_from_bucket_times(0.012, [0.004, 0.003, 0.002], overlap_cost=0.5)
    assert r.num_buckets == 3 and r.comm == pytest.approx(0.009)
    assert r.exposed == pytest.approx(0.002) and r.overlap_penalty == pytest.approx(0.0035)
    assert r.step == pytest.approx(0.012 + 0.002 + 0.0035)
    # the order matters: a big last bucket is what stays exposed
    assert ddp_step_from_bucket_times(0.012, [0.002, 0.003, 0.004]).exposed == pytest.approx(0.004)
    # without overlap everything is exposed, whatever the order
    assert ddp_step_from_bucket_times(0.012, [0.004, 0.003, 0.002], overlap=False).step == pytest.approx(0.021)
    # the same rule as ddp_step_time: alpha-beta bucket times handed over give its answer
    ab = ddp_step_time(0.15, 100 * MiB, 4, 10e-6, 1e-9, overlap_cost=0.3)
    same = ddp_step_from_bucket_times(0.15, [costs.collective_time("all_reduce", 25 * MiB, 4, 10e-6, 1e-9)] * 4,
                                      overlap_cost=0.3)
    assert dataclasses.astuple(same) == pytest.approx(dataclasses.astuple(ab))
    for bad in ([], [0.001, -0.002]):
        with pytest.raises(ValueError, match="bucket_times must be one or more non-negative seconds"):
            ddp_step_from_bucket_times(0.01, bad)
    with pytest.raises(ValueError, match="overlap_cost must be between 0"):
        ddp_step_from_bucket_times(0.01, [0.001], overlap_cost=2)


def test_ddp_step_overlap_cost_needs_something_hidden():
    # one bucket (ready when backward ends) hides nothing, and neither does overlap=False: no penalty either way
    one = ddp_step_time(0.12, 10**7, 2, 1e-4, 1e-9, bucket_bytes=25 * MiB, overlap_cost=1)
    assert one.num_buckets == 1 and one.hidden == 0.0 and one.overlap_penalty == 0.0
    assert one.step == pytest.approx(0.12 + 2e-4 + 1e-2)
    off = ddp_step_time(0.12, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6, overlap=False, overlap_cost=0.7)
    assert off.overlap_penalty == 0.0 and off.step == pytest.approx(0.22)
    # comm longer than backward: only backward's worth hides, so only that is charged
    # comm 0.1 s, compute 0.06 s, backward 0.04 s: exposed 0.06 s, hidden 0.04 s, cost 0.25 -> penalty 0.01 s
    r = ddp_step_time(0.06, 10**8, 2, 0.0, 1e-9, bucket_bytes=10**6, overlap_cost=0.25)
    assert r.exposed == pytest.approx(0.06) and r.overlap_penalty == pytest.approx(0.01)
    assert r.step == pytest.approx(0.06 + 0.06 + 0.01)


def test_ddp_step_buckets_in_closed_form_for_a_trillion_parameters():
    # 4e12 bytes in 1 MiB buckets: 3814697 full buckets + a remainder of 4e12 - 3814697 * 1048576 = 278528 B,
    # timed without a list of millions (alpha only, n = 2: 2 messages of 1e-6 s per bucket)
    r = ddp_step_time(1.0, 4 * 10**12, 2, 1e-6, 0.0, bucket_bytes=MiB)
    assert r.num_buckets == 3814697 + 1
    assert r.comm == pytest.approx(3814698 * 2e-6)
    assert r.exposed == pytest.approx(3814698 * 2e-6 - 2 / 3)


def test_ddp_step_with_no_gradients_or_one_rank_communicates_nothing():
    assert ddp_step_time(0.1, 0, 4, 1e-5, 1e-9).exposed == 0.0
    r = ddp_step_time(0.1, 100 * MiB, 1, 1e-5, 1e-9)
    assert r.comm == 0.0 and r.step == 0.1 and r.num_buckets == 4


# --- invalid inputs ------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: busbw_factor("allreduce", 4), r"'allreduce'.*all_reduce"),
    (lambda: busbw_factor("all_reduce", 0), r"\bn\b"),
    (lambda: algbw(1e6, 0), "seconds"),
    (lambda: algbw(-1, 1), "size_bytes"),
    (lambda: collective_time("all_reduce", 1e6, 4, 1e-5, 1e-9, algorithm="bogus"), "algorithm"),
    (lambda: collective_time("all_gather", 1e6, 4, 1e-5, 1e-9, algorithm="tree"), "tree"),
    (lambda: collective_time("all_reduce", 1e6, 4, -1e-5, 1e-9), "alpha"),
    (lambda: zero_memory_bytes(1e9, 8, 4), "stage"),
    (lambda: zero_memory_bytes(1e9, 0, 1), "dp_degree"),
    (lambda: zero_memory_bytes(-1, 8, 1), "num_params"),
    (lambda: zero_memory_bytes(1e9, 8, 0, offload=True), "offload"),
    (lambda: zero_comm_volume(1e9, 5), "stage"),
    (lambda: pipeline_bubble_fraction(0, 4), r"\bp\b"),
    (lambda: pipeline_bubble_fraction(4, 0), r"\bm\b"),
    (lambda: pipeline_bubble_fraction(4, 4, v=0), r"\bv\b"),
    (lambda: pipeline_bubble_ratio(4, 0), r"\bm\b"),
    (lambda: ddp_step_time(0.1, 1e6, 4, 1e-5, 1e-9, bucket_bytes=0), "bucket_bytes"),
    (lambda: ddp_step_time(-0.1, 1e6, 4, 1e-5, 1e-9), "compute_s"),
    (lambda: ddp_step_time(0.1, 1e6, 4, 1e-5, 1e-9, backward_fraction=1.5), "backward_fraction"),
    (lambda: ddp_step_time(0.1, 1e6, 4, 1e-5, 1e-9, backward_fraction=-0.1), "backward_fraction"),
    (lambda: ddp_step_time(0.1, 1e6, 4, 1e-5, 1e-9, overlap_cost=1.5), "overlap_cost"),
    (lambda: ddp_step_time(0.1, 1e6, 4, 1e-5, 1e-9, overlap_cost=-0.1), "overlap_cost"),
    (lambda: fit_alpha_beta([1, 2], [1e-3, 2e-3], n=1), r"\bn\b"),
    (lambda: scaling_efficiency(step_s=0, base_step_s=1), "step_s"),
    (lambda: scaling_efficiency(100.0, 0), "base_throughput"),
    (lambda: scaling_efficiency(100.0, step_s=1), "not both"),
])
def test_invalid_inputs_raise_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_module_imports_without_torch():
    code = "import sys, gpucourse.models.costs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=costs.__file__.rsplit("/gpucourse/", 1)[0], check=True)
    assert out.stdout.strip() == "False"


# --- mixed precision: bytes per parameter by recipe, FP8's modelled speedup --------------------------------------

@pytest.mark.parametrize("recipe, optimizer, parts", [
    ("fp32", "adamw", (4, 4, 0, 4 + 4)),          # the fp32 parameter is its own master
    ("autocast", "adam", (4, 4, 0, 4 + 4)),        # autocast does not shrink the parameters
    ("mixed", "adam", (2, 2, 4, 4 + 4)),           # the ZeRO paper's mixed-precision Adam: 16
    ("bf16", "adamw", (2, 2, 0, 2 + 2)),           # bf16 m and v, no master: 8
    ("fp8", "adam", (2 + 1, 2, 4, 4 + 4)),         # modelled: mixed + a 1-byte FP8 weight copy
    ("mixed", "sgd_momentum", (2, 2, 4, 4)),
    ("bf16", "sgd", (2, 2, 0, 0)),
])
def test_recipe_bytes_per_param_by_hand(recipe, optimizer, parts):
    p, g, m, o = parts
    assert costs.recipe_bytes_per_param(recipe, optimizer) == {
        "parameters": p, "gradients": g, "master weights": m, "optimizer states": o, "total": p + g + m + o}


def test_state_bytes_per_param_folds_the_master_into_the_optimizer_like_zero():
    # the calculator's view of the same recipes: master copy + states = the paper's K
    assert costs.state_bytes_per_param("adam", "mixed") == {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}
    assert costs.state_bytes_per_param("adam", "fp32") == {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}
    assert set(costs.MEASURED_RECIPES) == set(costs.RECIPES) - {"fp8"}


def test_low_precision_speedup_is_amdahl_over_the_datasheet_ratio():
    h100 = "NVIDIA H100 80GB HBM3"  # fp8 3958/2 and bf16 1979/2 dense TFLOP/s: a ratio of 2
    assert costs.low_precision_speedup(0.8, h100) == pytest.approx(1 / (0.2 + 0.8 / 2))
    assert costs.low_precision_speedup(0.0, h100) == 1.0               # no matrix products, nothing gained
    assert costs.low_precision_speedup(1.0, h100) == pytest.approx(2.0)
    assert costs.low_precision_speedup(0.5, h100, dtype="bf16", baseline="fp32") == pytest.approx(
        1 / (0.5 + 0.5 * 67 / (1979 / 2)))


@pytest.mark.parametrize("call, match", [
    (lambda: costs.recipe_bytes_per_param("fp4"), "recipe"),
    (lambda: costs.recipe_bytes_per_param("mixed", "lion"), "optimizer"),
    (lambda: costs.state_bytes_per_param("adam", "bf16"), "precision"),
    (lambda: costs.low_precision_speedup(1.2, "NVIDIA H100 80GB HBM3"), "gemm_fraction"),
    (lambda: costs.low_precision_speedup(0.5, "Tesla T4"), "fp8"),     # T4 has no FP8: the table says so
])
def test_precision_costs_reject_bad_input_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# Dense peaks written out as each datasheet prints them (sparse figures halved), not read from the table.
DATASHEET_DENSE_TFLOPS = {
    ("NVIDIA H100 80GB HBM3", "bf16"): 1979 / 2, ("NVIDIA H100 80GB HBM3", "tf32"): 989 / 2,
    ("NVIDIA H100 80GB HBM3", "fp8"): 3958 / 2, ("NVIDIA H100 80GB HBM3", "fp32"): 67,
    ("NVIDIA H100 PCIe", "bf16"): 1513 / 2, ("NVIDIA H100 PCIe", "fp8"): 3026 / 2, ("NVIDIA H100 PCIe", "fp32"): 51,
    ("NVIDIA H100 NVL", "bf16"): 1671 / 2, ("NVIDIA H200", "bf16"): 1979 / 2, ("NVIDIA H200", "fp8"): 3958 / 2,
    ("NVIDIA A100-SXM4-40GB", "bf16"): 312, ("NVIDIA A100-SXM4-80GB", "tf32"): 156,
    ("NVIDIA A100-PCIE-40GB", "fp16"): 312, ("NVIDIA A100 80GB PCIe", "fp32"): 19.5,
    ("NVIDIA L4", "bf16"): 242 / 2, ("NVIDIA L4", "fp8"): 485 / 2, ("NVIDIA L4", "tf32"): 120 / 2,
    ("Tesla T4", "fp16"): 65, ("Tesla T4", "fp32"): 8.1,
    ("NVIDIA B200", "bf16"): 4500 / 2, ("NVIDIA B200", "fp8"): 9000 / 2, ("NVIDIA B200", "tf32"): 2200 / 2,
}


@pytest.mark.parametrize("device,dtype", DATASHEET_DENSE_TFLOPS, ids=lambda v: str(v))
def test_peak_flops_is_the_dense_datasheet_rate(device, dtype):
    assert costs.peak_flops(device, dtype) == pytest.approx(DATASHEET_DENSE_TFLOPS[device, dtype] * 1e12)


def test_peak_flops_matches_exact_names_only():
    assert costs.peak_flops("NVIDIA H100 NVL") < costs.peak_flops("NVIDIA H100 80GB HBM3")  # NVL is not SXM
    assert costs.peak_flops("NVIDIA H100 PCIe") < costs.peak_flops("NVIDIA H100 NVL")
    for name in ("NVIDIA H100", "H100", "nvidia h100 80gb hbm3", "NVIDIA H100 80GB HBM3 ", "NVIDIA H200 NVL",
                 "NVIDIA A100", "NVIDIA L40S", "NVIDIA GeForce RTX 4090"):
        with pytest.raises(ValueError, match=r"no datasheet peak for .*pass it yourself.*peak="):
            costs.peak_flops(name)


def test_peak_flops_refuses_a_rate_the_table_does_not_list():
    with pytest.raises(ValueError, match=r"Tesla T4 has no 'bf16' rate.*fp16, fp32.*peak="):
        costs.peak_flops("Tesla T4", "bf16")  # Turing has no bf16 tensor cores
    with pytest.raises(ValueError, match="NVIDIA A100-SXM4-80GB has no 'fp8' rate"):
        costs.peak_flops("NVIDIA A100-SXM4-80GB", "fp8")  # Ampere has no fp8
    with pytest.raises(ValueError, match="NVIDIA H100 NVL has no 'fp8' rate"):
        costs.peak_flops("NVIDIA H100 NVL", "fp8")  # not confirmed: refused, not guessed
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp16, tf32, fp32, fp8"):
        costs.peak_flops("NVIDIA H200", "bfloat16")


def test_every_peak_names_its_source_and_is_dense():
    for name, entry in costs.PEAK_DENSE_TFLOPS.items():
        assert "https://" in entry.source and ("datasheet" in entry.source or "specifications" in entry.source), name
        assert set(entry.tflops) <= set(costs.DTYPES), name
        rates = entry.tflops
        if "bf16" in rates and "fp16" in rates:
            assert rates["bf16"] == rates["fp16"], name
        # tf32 runs at half the 16-bit tensor rate, fp8 at twice it, on every listed chip: a sparse figure mixed
        # with dense ones would be off by 2x (3 %: the B200's printed TF32 2.2 PFLOPS is 2.25 rounded)
        if "tf32" in rates:
            assert rates["tf32"] == pytest.approx(rates["fp16"] / 2, rel=0.03), name
        if "fp8" in rates:
            assert rates["fp8"] == pytest.approx(2 * rates["fp16"], rel=0.03), name


def test_mfu_divides_by_the_total_dense_peak():
    assert costs.mfu(400e12, "NVIDIA H200") == pytest.approx(400 / 989.5)
    assert costs.mfu(400e12, "NVIDIA H200", n_devices=2) == pytest.approx(200 / 989.5)
    assert costs.mfu(100e12, "NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(100 / 156)
    assert costs.mfu(50e12, peak=200e12) == pytest.approx(0.25)  # a device the table does not know
    assert costs.hfu(50e12, "Tesla T4", "fp16") == pytest.approx(50 / 65)
    with pytest.raises(ValueError, match="n_devices"):
        costs.mfu(1e12, "NVIDIA H200", n_devices=0)
    with pytest.raises(ValueError, match="device_name .* or peak="):
        costs.mfu(1e12)
    with pytest.raises(ValueError, match="no datasheet peak for 'NVIDIA H100'"):
        costs.mfu(1e12, "NVIDIA H100")


def test_model_flops_per_token_by_hand():
    # N = 1000 matmul weights, L = 2 layers, d = 8, T = 16: 6*1000 + 12*2*8*16 = 6000 + 3072
    assert costs.model_flops_per_token(1000, 2, 8, 16) == 6000 + 3072
    # causal: query i scores i + 1 keys, (16 + 1) / 2 on average: 6000 + 6*2*8*17
    assert costs.model_flops_per_token(1000, 2, 8, 16, causal=True) == 6000 + 1632
    # T = 1: one key either way
    assert costs.model_flops_per_token(0, 1, 4, 1, causal=True) == costs.model_flops_per_token(0, 1, 4, 1) == 48


def test_hardware_flops_add_only_the_recomputed_forward():
    model = costs.model_flops_per_token(1000, 2, 8, 16)
    assert costs.hardware_flops_per_token(1000, 2, 8, 16) == model
    assert costs.hardware_flops_per_token(1000, 2, 8, 16, recompute="selective") == model + 4 * 2 * 8 * 16
    assert costs.hardware_flops_per_token(1000, 2, 8, 16, recompute="full") == model + 2 * 1000 + 4 * 2 * 8 * 16
    # no attention (d T small against N): full recomputation is 8N against 6N, HFU = 4/3 MFU
    assert costs.hardware_flops_per_token(1e9, 1, 1, 1, recompute="full") / costs.model_flops_per_token(
        1e9, 1, 1, 1) == pytest.approx(4 / 3, rel=1e-6)
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full"):
        costs.hardware_flops_per_token(1000, 2, 8, 16, recompute="partial")
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        costs.model_flops_per_token(1000, 2, 8, 0)


def test_palm_540b_mfu_from_the_papers_numbers():
    """Chowdhery et al. 2022: 540.35e9 parameters, 118 layers, 48 heads of 256, T = 2048, 238.3e3 tokens/s on
    6144 TPU v4 chips of 275e12 FLOP/s: table 3 prints 46.2 %. The attention width is H Q = 12288, not d_model."""
    flops = costs.model_flops_per_token(540.35e9, 118, 48 * 256, 2048)
    assert flops == 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    assert round(100 * costs.mfu(flops * 238.3e3, n_devices=6144, peak=275e12), 1) == 46.2
    assert round(100 * costs.mfu(6 * 540.35e9 * 238.3e3, n_devices=6144, peak=275e12), 1) == 45.7  # no attention


def test_context_parallel_bytes_per_rank():
    shard = 1000  # one q/k/v shard; K and V are 2000 bytes
    assert costs.context_parallel_bytes("ring", shard, 1) == 0
    assert costs.context_parallel_bytes("ring", shard, 1, backward=True) == 0  # one rank sends nothing
    assert costs.context_parallel_bytes("ring", shard, 4) == 3 * 2000  # 3 hops of K and V
    assert costs.context_parallel_bytes("ring", shard, 4, backward=True) == 3 * 2000 + 4 * 2000  # + dK/dV home
    # all-gather of K and V: (n-1)/n of the whole (n shards) = (n-1) shards, as a ring all-gather sends
    assert costs.context_parallel_bytes("all_gather", shard, 4) == costs.bytes_moved_per_rank("all_gather", 4 * 2000, 4)
    # Ulysses: 4 all-to-alls (q, k, v in; output out), each sending (n-1)/n of a shard
    assert costs.context_parallel_bytes("ulysses", shard, 4) == pytest.approx(4 * 3 / 4 * shard)
    assert costs.context_parallel_bytes("ulysses", shard, 4, backward=True) == pytest.approx(3000)
    assert costs.context_parallel_bytes("ulysses", shard, 1) == 0
    with pytest.raises(ValueError, match="unknown method 'rings'; valid: all_gather, ring, ulysses"):
        costs.context_parallel_bytes("rings", shard, 2)
    with pytest.raises(ValueError, match="shard_bytes"):
        costs.context_parallel_bytes("ring", -1, 2)
    with pytest.raises(ValueError, match="n .number of ranks. must be >= 1"):
        costs.context_parallel_bytes("ring", shard, 0)


def test_attention_shard_bytes_is_batch_heads_tokens_per_rank_head_dim_bytes():
    assert costs.attention_shard_bytes(2, 1024, 8, 64, 4, 2) == 2 * 8 * 256 * 64 * 2
    with pytest.raises(ValueError, match="seq=10 is not divisible by n=4"):
        costs.attention_shard_bytes(1, 10, 8, 64, 4)
    with pytest.raises(ValueError, match="heads must be a whole number >= 1"):
        costs.attention_shard_bytes(1, 16, 0, 64, 4)


@pytest.mark.parametrize("method", ["all_gather", "ring", "ulysses"])
@pytest.mark.parametrize("backward", [False, True])
def test_grouped_query_kv_shrinks_only_what_k_and_v_carry(method, backward):
    heads, kv_heads, n = 8, 2, 4
    q = costs.attention_shard_bytes(1, 1024, heads, 64, n)
    kv = costs.attention_shard_bytes(1, 1024, kv_heads, 64, n)
    mha = costs.context_parallel_bytes(method, q, n, backward=backward)
    gqa = costs.context_parallel_bytes(method, q, n, backward=backward, kv_shard_bytes=kv)
    assert costs.context_parallel_bytes(method, q, n, backward=backward, kv_shard_bytes=q) == mha
    if method == "ulysses":  # q and the output keep their size, k and v shrink: (2 + 2/4) / 4 of MHA's bytes
        assert gqa == pytest.approx(mha * (2 + 2 * kv_heads / heads) / 4)
    else:  # only K/V travel
        assert gqa == mha * kv_heads / heads
    with pytest.raises(ValueError, match="kv_shard_bytes"):
        costs.context_parallel_bytes(method, q, n, kv_shard_bytes=-1)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("backward", [False, True])
def test_hybrid_bytes_reduce_to_the_pure_ways(n, backward):
    shard = 3000
    assert costs.hybrid_context_parallel_bytes(shard, n, 1, backward=backward) == \
        costs.context_parallel_bytes("ulysses", shard, n, backward=backward)
    assert costs.hybrid_context_parallel_bytes(shard, 1, n, backward=backward) == \
        costs.context_parallel_bytes("ring", shard, n, backward=backward)


def test_hybrid_bytes_of_a_2_by_4_split_by_hand():
    shard, kv = 1000, 2000  # forward: 4 tensors × 1/2 of a shard each (Ulysses, 2 ranks) + 3 hops of K/V (ring, 4)
    assert costs.hybrid_context_parallel_bytes(shard, 2, 4) == 4 * shard / 2 + 3 * kv
    assert costs.hybrid_context_parallel_bytes(shard, 2, 4, backward=True) == 4 * shard / 2 + 3 * kv + 4 * kv
    # more Ulysses, less ring: fewer bytes per rank for the same 8 ranks
    assert costs.hybrid_context_parallel_bytes(shard, 8, 1) < costs.hybrid_context_parallel_bytes(shard, 2, 4) \
        < costs.hybrid_context_parallel_bytes(shard, 1, 8)
    with pytest.raises(ValueError, match="ulysses degree must be a whole number >= 1"):
        costs.hybrid_context_parallel_bytes(shard, 0, 4)


def test_ring_step_times_count_flops_and_bytes():
    compute, transfer = costs.ring_step_times(1000, 4, 64, 1e12, 1e9, batch=2, kv_heads=2, bytes_per_value=4)
    assert compute == pytest.approx(4 * 2 * 4 * 1000 ** 2 * 64 / 1e12)
    assert transfer == pytest.approx(2 * 2 * 2 * 1000 * 64 * 4 / 1e9)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0"):
        costs.ring_step_times(1000, 4, 64, 1e12, 0)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (32, 8), (128, 8)])
def test_ring_overlap_block_is_where_compute_equals_transfer(heads, kv_heads):
    flops, bandwidth, head_dim = 400e12, 50e9, 128
    c = costs.ring_overlap_block_tokens(flops, bandwidth, heads=heads, kv_heads=kv_heads)
    at = costs.ring_step_times(c, heads, head_dim, flops, bandwidth, kv_heads=kv_heads)
    assert at[0] == pytest.approx(at[1])
    below = costs.ring_step_times(c / 2, heads, head_dim, flops, bandwidth, kv_heads=kv_heads)
    above = costs.ring_step_times(2 * c, heads, head_dim, flops, bandwidth, kv_heads=kv_heads)
    assert below[0] < below[1] and above[0] > above[1]  # compute ∝ c², transfer ∝ c
    assert c == pytest.approx(kv_heads / heads * 2 * flops / (2 * bandwidth))


def test_ring_overlap_block_rejects_a_zero_rate():
    with pytest.raises(ValueError, match="flops_per_s must be > 0"):
        costs.ring_overlap_block_tokens(0, 1e9)


# --- chapter 11: mixture of experts and expert parallelism (a block of its own) ------------------------------

def test_moe_capacity_is_switch_transformers_rounded_up():
    assert costs.moe_capacity(4096, 2, 64, 1.25) == 160  # ceil(1.25 * 4096 * 2 / 64)
    assert costs.moe_capacity(10, 1, 4, 1.0) == 3  # 2.5 rounds up: never below the uniform share
    assert costs.moe_capacity(64, 2, 8, 2.0) == 32


def _rows_to_other_ranks(tokens, top_k, num_experts, n):
    """Count by hand: round-robin routing (every expert the same share), experts split evenly over n ranks,
    the rows rank 0 sends to ranks other than itself."""
    per = num_experts // n
    return sum((t * top_k + j) % num_experts // per != 0 for t in range(tokens) for j in range(top_k))


@pytest.mark.parametrize("tokens, top_k, num_experts, n", [(64, 2, 8, 4), (48, 1, 6, 3), (40, 2, 8, 2), (16, 2, 4, 1)])
def test_expert_parallel_bytes_match_a_count_of_the_rows(tokens, top_k, num_experts, n):
    hidden, bpv = 32, 2
    counted = _rows_to_other_ranks(tokens, top_k, num_experts, n) * hidden * bpv
    assert costs.expert_parallel_all_to_all_bytes(tokens, top_k, hidden, n, bpv) == counted


def test_expert_parallel_bytes_scale_with_the_kept_fraction_not_the_experts():
    full = costs.expert_parallel_all_to_all_bytes(1024, 2, 4096, 8)
    assert full == 1024 * 2 * 4096 * 2 * 7 / 8
    assert costs.expert_parallel_all_to_all_bytes(1024, 2, 4096, 8, kept_fraction=0.75) == 0.75 * full
    assert costs.expert_parallel_all_to_all_bytes(1024, 2, 4096, 1) == 0.0  # one rank sends nothing


def test_moe_flops_count_the_active_experts_by_hand():
    """hidden 4, ffn 8, 4 routed experts (top 2) and 1 shared: each expert 4x8 + 8x4 = 64 weights, the router
    4x4 = 16. A token runs the router, 2 routed and the shared expert: 16 + 3 x 64 = 208 weights; all of them:
    16 + 5 x 64 = 336. Two FLOPs per weight forward, six with backward."""
    assert costs.moe_params(4, 8, 4, 2, shared=1) == {"total": 336, "active": 208}
    assert costs.moe_flops_per_token(4, 8, 4, 2, shared=1) == {"total": 6 * 336, "active": 6 * 208}
    assert costs.moe_flops_per_token(4, 8, 4, 2, shared=1, training=False)["active"] == 2 * 208


def test_fine_grained_experts_keep_active_and_total_parameters():
    """DeepSeekMoE's segmentation: m x E experts of ffn / m, top m x k: the same work, more combinations. The
    router grows with the number of experts (hidden x E)."""
    coarse, fine = costs.moe_params(32, 64, 8, 2), costs.moe_params(32, 16, 32, 8)
    assert fine["total"] - 32 * 32 == coarse["total"] - 32 * 8
    assert fine["active"] - 32 * 32 == coarse["active"] - 32 * 8


def test_moe_flops_match_what_flopcountermode_counts_for_the_experts_a_token_runs():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    hidden, ffn, experts, k, shared = 8, 16, 4, 2, 1
    router = torch.nn.Linear(hidden, experts, bias=False)
    mlps = [torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
            for _ in range(experts + shared)]
    x = torch.randn(1, hidden)
    with FlopCounterMode(display=False) as counter:
        ids = router(x).topk(k).indices[0].tolist()
        sum(mlps[e](x) for e in ids + list(range(experts, experts + shared)))
    want = costs.moe_flops_per_token(hidden, ffn, experts, k, shared=shared, training=False)["active"]
    assert counter.get_total_flops() == want


@pytest.mark.parametrize("compute, a2a, chunks, time", [
    (4.0, 1.0, 1, 6.0),   # nothing overlaps: dispatch, experts, combine
    (4.0, 1.0, 2, 5.0),   # D1 .5 | D2, X1 .5-2.5 | C1 2.5-3, X2 2.5-4.5 | C2 4.5-5: c + 2a/m
    (2.0, 1.0, 4, 2.5),   # c = 2a exactly: still hidden, c + 2a/m
    (1.0, 2.0, 2, 4.0),   # communication-bound: D1 0-1, D2 1-2, X1 1-1.5, C1 2-3, X2 2-2.5, C2 3-4
])
def test_moe_overlap_time_follows_the_two_stream_schedule_by_hand(compute, a2a, chunks, time):
    got = costs.moe_overlap_time(compute, a2a, chunks)
    assert got["time"] == pytest.approx(time)
    assert got["exposed_s"] == pytest.approx(time - compute)
    assert got["hidden"] is (compute >= 2 * a2a and chunks > 1)


def test_moe_overlap_hides_the_all_to_all_only_when_compute_covers_twice_it():
    for chunks in (2, 4, 8):
        assert costs.moe_overlap_time(2.0, 1.0, chunks)["hidden"]
    for chunks in (4, 8, 16):  # communication-bound: it falls behind once the pipeline is long enough
        assert not costs.moe_overlap_time(1.9, 1.0, chunks)["hidden"]
    assert not costs.moe_overlap_time(3.0, 1.0, 1)["hidden"]  # one chunk: nothing overlaps
    assert costs.moe_overlap_time(3.0, 1.0, 8)["exposed_s"] == pytest.approx(2 / 8)


@pytest.mark.parametrize("call, match", [
    (lambda: costs.moe_capacity(0, 2, 8, 1.25), "tokens"),
    (lambda: costs.moe_capacity(64, 9, 8, 1.25), "top_k"),
    (lambda: costs.moe_capacity(64, 2, 8, 0), "capacity_factor"),
    (lambda: costs.expert_parallel_all_to_all_bytes(64, 2, 32, 0), r"\bn\b"),
    (lambda: costs.expert_parallel_all_to_all_bytes(64, 2, 32, 4, kept_fraction=1.5), "kept_fraction"),
    (lambda: costs.expert_parallel_all_to_all_bytes(-1, 2, 32, 4), "tokens"),
    (lambda: costs.moe_params(32, 64, 8, 2, shared=-1), "shared"),
    (lambda: costs.moe_flops_per_token(32, 0, 8, 2), "ffn"),
    (lambda: costs.moe_overlap_time(1.0, 1.0, 0), "chunks"),
    (lambda: costs.moe_overlap_time(-1.0, 1.0, 2), "compute_s"),
])
def test_moe_costs_reject_bad_input_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- chapter 07: fully_shard on a (replicate x shard) mesh ------------------------------------------------
def test_ddp_is_one_all_reduce_of_the_gradients_over_every_rank():
    assert costs.sharded_dp_comm_bytes(1000, 4, 1) == {
        "all_reduce": {"group": "replicate", "ranks": 4, "calls_bytes": 1000, "sent": 2 * 3 / 4 * 1000}}


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_fsdp_sends_the_zero_papers_three_psi_and_two_without_resharding(n):
    num_params, bpe = 10_000, 2
    fsdp = costs.sharded_dp_comm_bytes(num_params * bpe, 1, n)
    assert set(fsdp) == {"all_gather", "reduce_scatter"}  # nothing to all-reduce over one replica
    assert fsdp["all_gather"]["calls_bytes"] == 2 * num_params * bpe  # forward and again in backward
    assert fsdp["reduce_scatter"]["calls_bytes"] == num_params * bpe
    sent = sum(c["sent"] for c in fsdp.values())
    # the paper rounds (n-1)/n to 1
    assert sent == pytest.approx(costs.zero_comm_volume(num_params, 3, bpe) * (n - 1) / n)
    kept = costs.sharded_dp_comm_bytes(num_params * bpe, 1, n, reshard_after_forward=False)
    assert sum(c["sent"] for c in kept.values()) == pytest.approx(costs.zero_comm_volume(num_params, 2, bpe) * (n - 1) / n)


def test_hsdp_all_reduces_only_a_shard_across_replicas():
    P = 4096
    hsdp = costs.sharded_dp_comm_bytes(P, 2, 4, grad_bytes=2 * P)  # fp32 gradients of bf16 parameters, say
    assert hsdp["all_gather"] == {"group": "shard", "ranks": 4, "calls_bytes": 2 * P, "sent": 3 / 4 * 2 * P}
    assert hsdp["reduce_scatter"] == {"group": "shard", "ranks": 4, "calls_bytes": 2 * P, "sent": 3 / 4 * 2 * P}
    assert hsdp["all_reduce"] == {"group": "replicate", "ranks": 2, "calls_bytes": 2 * P / 4, "sent": 2 * P / 4}
    # across replicas (the slow link, when a shard group is a node) HSDP sends 1/shard of what DDP does
    ddp = costs.sharded_dp_comm_bytes(P, 8, 1, grad_bytes=2 * P)
    assert hsdp["all_reduce"]["calls_bytes"] * 4 == ddp["all_reduce"]["calls_bytes"]
    assert costs.sharded_dp_comm_bytes(P, 1, 1) == {}  # one rank: nothing to communicate


@pytest.mark.parametrize("call, match", [
    (lambda: costs.sharded_dp_comm_bytes(-1, 2, 2), "param_bytes"),
    (lambda: costs.sharded_dp_comm_bytes(100, 0, 2), "replicate"),
    (lambda: costs.sharded_dp_comm_bytes(100, 2, 2.5), "shard"),
    (lambda: costs.sharded_dp_comm_bytes(100, 2, 2, grad_bytes=-4), "grad_bytes"),
])
def test_sharded_dp_comm_bytes_rejects_bad_input_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- chapter 08d: DiLoCo syncs every H steps ----------------------------------------------------------------
def test_diloco_hands_one_parameter_set_to_the_all_reduce_every_h_steps():
    P = 4 * 10_000  # fp32 parameters' bytes
    assert costs.diloco_bytes(P, 300) == 300 * P  # data parallelism: a gradient every step
    assert costs.diloco_bytes(P, 300, 20) == 15 * P  # DiLoCo, H = 20: a pseudo-gradient every 20 steps
    assert costs.diloco_bytes(P, 300, 1) / costs.diloco_bytes(P, 300, 20) == 20  # the ratio chapter 08d asserts
    assert costs.diloco_bytes(P, 19, 20) == 0  # no sync before the H-th step
    for bad, match in (((-1, 10, 2), "param_bytes"), ((P, 0, 2), "steps"), ((P, 10, 2.5), "sync_every")):
        with pytest.raises(ValueError, match=match):
            costs.diloco_bytes(*bad)
