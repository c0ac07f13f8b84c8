"""The tables chapters show (gpucourse/viz/tables.py), built from hand-made records."""
import pytest

from gpucourse.models import costs
from gpucourse.viz import tables


def test_frame_shows_each_bytes_column_in_one_unit_named_in_its_header():
    df = tables.frame([{"way": "ring", "sent": 3 * 2**20, "kept": 512}, {"way": "all_gather", "sent": 2**19,
                                                                         "kept": 100}],
                      index="way", bytes_columns=("sent", "kept"))
    assert list(df.columns) == ["sent (MiB)", "kept (B)"]
    assert df.loc["ring", "sent (MiB)"] == 3.0 and df.loc["all_gather", "sent (MiB)"] == 0.5
    assert df.loc["ring", "kept (B)"] == 512


def test_backend_support_says_what_ran_failed_or_was_not_tried():
    metrics = {0: [{"available": {"gloo": True, "nccl": True, "mpi": False}},
                   {"backend": "gloo", "op": "all_reduce", "ok": True, "error": None},
                   {"backend": "gloo", "op": "all_to_all", "ok": False, "error": "gloo does not support it"}],
               1: [{"backend": "gloo", "op": "all_reduce", "ok": False, "error": "rank 1 failed"}]}
    df = tables.backend_support(metrics, ["all_reduce", "all_to_all"])
    assert df.loc["built in"].tolist() == ["yes", "yes", "no (this PyTorch)"]
    assert df.loc["all_reduce", "gloo"] == "NO: rank 1 failed"  # one rank's failure is the op's failure
    assert df.loc["all_to_all", "gloo"].startswith("NO: gloo does not")
    assert df.loc["all_reduce", "nccl"] == "not tried" and df.loc["all_reduce", "mpi"] == "—"


def test_bytes_per_rank_is_the_cost_model_in_mib():
    df = tables.bytes_per_rank(["all_reduce", "all_gather"], 64 * 2**20, [2, 1024])
    assert df.loc[2, "all_reduce (MiB)"] == 64.0  # 2(N-1)/N · S
    assert df.loc[1024, "all_gather (MiB)"] == pytest.approx(64 * 1023 / 1024, abs=0.05)


def test_bandwidth_groups_time_and_busbw_by_op_in_the_order_run():
    rows = [{"op": op, "bytes": size, "time_s": t, "busbw": bw} for op, size, t, bw in
            [("all_reduce", 1024, 1e-4, 2e7), ("all_reduce", 2**20, 1e-3, 2e9), ("broadcast", 1024, 5e-5, 1e7)]]
    df = tables.bandwidth(rows)
    assert [c[0] for c in df.columns] == ["all_reduce", "all_reduce", "broadcast", "broadcast"]
    assert df.loc["1 MiB", ("all_reduce", "time (µs)")] == 1000.0
    assert df.loc["1 KiB", ("broadcast", "busbw (GB/s)")] == 0.01


def test_link_times_puts_this_machine_beside_the_nominal_links():
    fit = costs.AlphaBeta(alpha=1e-5, beta=1e-9, collective="all_reduce", n=2)
    df = tables.link_times("all_reduce", [2**20], 2, {2**20: 2e-3}, fit)
    assert df.index[-1] == "this machine (measured)" and df.loc["this machine (measured)", "1 MiB (µs)"] == 2000.0
    nvlink = costs.INTERCONNECTS["NVLink 4 (H100 SXM)"]
    assert df.loc[nvlink.name, "1 MiB (µs)"] == round(
        costs.collective_time("all_reduce", 2**20, 2, nvlink.alpha, nvlink.beta) * 1e6, 1)
