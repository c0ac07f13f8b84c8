"""Claims the chapters make about PyTorch itself, checked against the installed PyTorch by real runs."""
from gpucourse import launch

from tests.conftest import JOBS


def test_ddp_default_bucket_cap_has_a_small_first_bucket_and_an_explicit_cap_does_not(runs_dir):
    """Chapter 03: bucket_cap_mb=None means 25 MiB buckets after a 1 MiB first one; passing 25 means one cap for all."""
    result = launch(JOBS / "ddp_buckets.py", nproc=2, live=False, timeout=180)
    buckets = {rec["cap"]: rec["bucket_bytes"] for rec in result.metrics[0]}
    model_bytes = 6 * (512 * 512 + 512) * 4
    assert sum(buckets[None]) == sum(buckets[25]) == model_bytes
    assert len(buckets[None]) == 2 and 2**20 <= buckets[None][0] < 2 * 2**20  # the last layer alone, ~1 MiB
    assert buckets[25] == [model_bytes]  # 6.3 MB < 25 MiB: one bucket, ready only when backward ends


def test_context_parallel_gathers_kv_by_default_and_cuts_the_sequence_head_tail():
    """Chapter 10: torch's context_parallel all-gathers K/V unless set_rotate_method("alltoall"), and its default
    load balancer gives rank r chunks r and 2N-1-r of 2N (the zig-zag layout); the chapter's runs assert the same."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer

    options = _attention._cp_options
    assert options.rotate_method == _attention._RotateMethod.ALL_GATHER and options.enable_load_balance
    try:
        _attention.set_rotate_method("alltoall")
        assert options.rotate_method == _attention._RotateMethod.ALL_TO_ALL
    finally:
        _attention.set_rotate_method("allgather")
    for seq, n in ((16, 4), (64, 2), (24, 3)):
        c = seq // (2 * n)
        zigzag = torch.cat([torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])
                            for r in range(n)])
        assert torch.equal(_load_balancer._HeadTailLoadBalancer(seq, n, "cpu")._generate_indices()[0].long(), zigzag)
    assert _load_balancer._create_default_load_balancer(10, 3, "cpu") is None  # S not a multiple of 2N: no reordering


def test_fsdp2_mixed_precision_keeps_fp32_shards_and_gradients(runs_dir):
    """Chapter 07: MixedPrecisionPolicy(param_dtype=bf16) computes in bf16, but the sharded parameter (the master)
    and its sharded gradient stay fp32: 4 + 4 bytes per parameter, plus Adam's 8, divided by the ranks."""
    result = launch(JOBS / "fsdp2_mixed_precision.py", nproc=2, live=False, timeout=180)
    for rank, records in result.metrics.items():
        rec = next(r for r in records if "param_dtypes" in r)
        assert rec["param_dtypes"] == rec["local_dtypes"] == rec["grad_dtypes"] == ["torch.float32"], (rank, rec)
        assert rec["computed_dtypes"] == ["torch.bfloat16"], (rank, rec)
        assert rec["local_numel"] * 2 == rec["numel"], (rank, rec)  # each rank keeps half of every parameter


def test_torch_dualpipev_plans_deepseek_s_bubble_and_memory_and_interleaving_holds_its_formula():
    """Chapter 05: torch's ScheduleDualPipeV order, replayed with F = I = W and each overlapped pair as one block, idles
    (p - 1)(F&B + B - 3W) per rank and holds 2p + 1 chunks; interleaved 1F1B's warm-up gives pipeline_peak_activations."""
    import re
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _get_warmup_ops

    from gpucourse.models.costs import dualpipev_bubble, pipeline_peak_activations, simulate_pipeline

    from tests.unit.models.test_costs import DUALPIPEV_P2_M4

    def plan(p, m):
        plans = {r: ScheduleDualPipeV._calculate_single_rank_operations(
            SimpleNamespace(pp_group_size=p, _n_microbatches=m), r) for r in range(p)}
        return {r: [tuple(map(str, a.sub_actions)) if a.sub_actions else str(a) for a in acts]
                for r, acts in plans.items()}

    def peak_chunks(order):
        alive, peak = set(), 0
        for entry in order:
            for stage, kind, mb in (re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups()
                                    for a in (entry if isinstance(entry, tuple) else (entry,))):
                alive.add((stage, mb)) if kind == "F" else alive.discard((stage, mb)) if kind in "BW" else None
                peak = max(peak, len(alive))
        return peak

    assert plan(2, 4) == DUALPIPEV_P2_M4
    for p, m in ((2, 8), (3, 6), (4, 16)):
        order = plan(p, m)
        timeline = simulate_pipeline(order, {"F": 1, "B": 2, "I": 1, "W": 1})
        step = max(end for acts in timeline.values() for _, _, end in acts)
        for rank, acts in timeline.items():
            busy = sum(end - start for start, end in {(start, end) for _, start, end in acts})  # a block once
            assert step - busy == dualpipev_bubble(p, 1, 2, 1), (p, m, rank)
            assert peak_chunks(order[rank]) == pipeline_peak_activations(p, m, 2, rank, "DualPipeV"), (p, m, rank)
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 1, 2), (4, 2, 3)):
        per_round = m // max(1, m // p)
        for rank in range(p):
            warmup = _get_warmup_ops(rank, v, per_round, p, m)
            assert pipeline_peak_activations(p, m, v, rank, "Interleaved1F1B") == min(warmup + 1, m * v)
