"""The tables chapters show (gpucourse/viz/tables.py), built from hand-made records: values and headers."""
import math

import pandas as pd
import pytest

from gpucourse.models import costs
from gpucourse.viz import tables


def test_frame_shows_each_bytes_column_in_one_unit_named_in_its_header():
    df = tables.frame([{"way": "ring", "sent": 3 * 2**20, "kept": 512}, {"way": "all_gather", "sent": 2**19,
                                                                         "kept": 100}],
                      index="way", bytes_columns=("sent", "kept"))
    assert list(df.columns) == ["sent (MiB)", "kept (bytes)"]
    assert df.loc["ring", "sent (MiB)"] == 3.0 and df.loc["all_gather", "sent (MiB)"] == 0.5
    assert df.loc["ring", "kept (bytes)"] == 512


def test_cell_texts_is_one_rule_for_numbers_and_empty_cells():
    assert tables.cell_texts([1314816, 12845056, 3]) == ["1,314,816", "12,845,056", "3"]
    assert tables.cell_texts([448.0, 57344.0]) == ["448", "57,344"]  # never 4.480000e+02
    assert tables.cell_texts([1.0, 1.27, 0.5]) == ["1.00", "1.27", "0.50"]  # a column aligned
    assert tables.cell_texts([0.3916, 12.5]) == ["0.3916", "12.500"]
    assert tables.cell_texts([6.103515625e-05, 3.3895313892515355e38, 0.0]) == ["6.10e-05", "3.39e+38", "0"]
    assert tables.cell_texts([None, float("nan"), pd.NA, "text", True]) == ["—", "—", "—", "text", "True"]


def test_every_table_shows_by_the_rule_and_keeps_its_numbers():
    df = tables.recomputation({(8, "none"): 1000}, {(8, "none"): 100}, {(8, "none"): 100},
                              {(8, "none"): [0.01] * 3, (8, "control"): [0.02] * 3})
    assert isinstance(df, tables.Table) and math.isnan(df.loc[(8, "control"), "kept (× none)"])  # numbers kept
    html = df._repr_html_()
    assert "NaN" not in html and "None" not in html and "<td>—</td>" in html
    assert "kept (×\u00a0none)" in html and "median step\u00a0(ms)" not in html  # no break inside a unit
    assert "<table" in html and isinstance(df.round(1), tables.Table)
    plain = [name for name, f in vars(tables).items() if callable(f) and getattr(f, "__wrapped__", None)
             and not name.startswith("_")]
    assert len(plain) > 60 and "diagnoses" in plain and "frame" in plain  # every chapter's tables


def test_a_bytes_column_never_reads_zero_for_a_few_bytes():
    df = tables.frame([{"op": "all_reduce", "sent": 4}, {"op": "all_gather", "sent": 12845056}], index="op",
                      bytes_columns=["sent"])
    assert list(df.columns) == ["sent (bytes)"] and df.loc["all_reduce", "sent (bytes)"] == 4
    assert "12,845,056" in df._repr_html_()
    big = tables.frame([{"x": 3 * 10**9}, {"x": 10**8}], bytes_columns=["x"], decimal=True)
    assert list(big["x (GB)"]) == [3.0, 0.1]


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


# --- chapter 02 ---------------------------------------------------------------------------------------
def test_equivalence_has_a_row_per_variant_and_a_column_per_step():
    df = tables.equivalence({"mean": [1e-8, 2e-8], "sum": [0.5, 0.7]})
    assert list(df.columns) == ["step 1", "step 2"] and df.columns.name == "max |Δθ| after"
    assert df.loc["sum", "step 2"] == 0.7 and df.loc["mean", "step 1"] == 1e-8
    with pytest.raises(ValueError, match="variant"):
        tables.equivalence({})


def test_sampler_shards_name_the_padding_and_the_dropped():
    shards = {("with set_epoch", 0): {0: [4, 1, 0], 1: [2, 3, 4]}, ("drop_last", 0): {0: [3, 1], 1: [0, 2]}}
    df = tables.sampler_shards(shards, items=5)
    assert list(df.columns) == ["rank 0", "rank 1", "read twice", "read by none"]
    assert df.loc[("with set_epoch", 0), "read twice"] == [4] and df.loc[("with set_epoch", 0), "read by none"] == []
    assert df.loc[("drop_last", 0), "read by none"] == [4] and df.loc[("drop_last", 0), "rank 1"] == [0, 2]


def test_accumulation_reads_the_last_profiled_step_and_the_worst_difference():
    records = [{"mode": "big", "max_diff": 0.0}, {"mode": "every", "max_diff": 2e-7},
               {"mode": "every", "max_diff": 1e-7}, {"step": 3}]
    comm = {"big": [(2, 4096), (2, 4096)], "every": [(8, 16384), (8, 16384)]}
    df = tables.accumulation(records, comm)
    assert list(df.columns) == ["all_reduces / step", "KiB / step", "max |Δθ| vs big",
                                "profiled steps (calls, bytes)"]
    assert df.loc["every", "all_reduces / step"] == 8 and df.loc["every", "KiB / step"] == 16.0
    assert df.loc["every", "max |Δθ| vs big"] == 2e-7 and df.loc["big", "max |Δθ| vs big"] == 0.0


def test_precision_merges_a_modes_records_and_keeps_what_did_not_run():
    rec = {"output_dtype": "torch.float32", "param_dtype": "torch.float32", "grad_dtype": "torch.float32",
           "scaler": False}
    records = [{"mode": "fp32", "max_diff": 0.0, **rec}, {"mode": "fp16_hook", "max_diff": 1e-4, **rec},
               {"mode": "fp16_hook", "max_diff": 3e-4, **rec}, {"mode": "fp16", "error": "RuntimeError: no"}]
    df = tables.precision(records, {"fp32": (2, 2048), "fp16_hook": (2, 1024)})
    assert list(df.index) == ["fp32", "fp16_hook", "fp16"]
    assert df.loc["fp16_hook", "KiB / step"] == 1.0 and df.loc["fp32", "KiB / step"] == 2.0
    assert df.loc["fp16_hook", "max |Δθ| vs fp32"] == 3e-4 and df.loc["fp16", "not run"] == "RuntimeError: no"
    assert not df.loc["fp32", "GradScaler"] and df.loc["fp32", "params"] == "torch.float32"
    assert str(df["all_reduces / step"].dtype) == "Int64" and df.loc["fp32", "all_reduces / step"] == 2


def test_ddp_compare_skips_the_first_step_in_the_median():
    rows = [{"loss": {"torch DDP": 2.0, "yours": 2.0}, "seconds": {"torch DDP": 9.0, "yours": 9.0},
             "max_diff": {"yours": 1e-7}}]
    rows += [{"loss": {"torch DDP": 1.0 - s / 10, "yours": 1.0 - s / 10}, "seconds": {"torch DDP": s / 1e3,
             "yours": 2 * s / 1e3}, "max_diff": {"yours": 3e-7}} for s in (1, 2, 3)]
    df = tables.ddp_compare(rows)
    assert list(df.columns) == ["final loss", "median step (ms)", "max |Δθ| vs torch DDP"]
    assert math.isclose(df.loc["torch DDP", "median step (ms)"], 2.0)
    assert math.isclose(df.loc["yours", "median step (ms)"], 4.0)
    assert df.loc["yours", "max |Δθ| vs torch DDP"] == 3e-7 and df.loc["torch DDP", "max |Δθ| vs torch DDP"] == 0
    assert math.isclose(df.loc["yours", "final loss"], 0.7)
    with pytest.raises(ValueError, match="two steps"):
        tables.ddp_compare(rows[:1])


# --- chapter 08 ---------------------------------------------------------------------------------------
def test_whoami_has_a_row_per_rank_in_rank_order():
    def me(rank, node):
        return [{"RANK": rank, "GROUP_RANK": node, "LOCAL_RANK": rank % 2, "WORLD_SIZE": 4, "agent_pid": 100 + node,
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}, {"ranks_seen": [0, 1, 2, 3]}]
    df = tables.whoami({3: me(3, 1), 0: me(0, 0), 1: me(1, 0), 2: me(2, 1)})
    assert list(df.index) == [0, 1, 2, 3] and df.index.name == "RANK"
    assert list(df.columns) == ["GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "agent pid", "rendezvous"]
    assert df.loc[3, "GROUP_RANK"] == 1 and df.loc[3, "agent pid"] == 101 and df.loc[2, "rendezvous"] == "127.0.0.1:29500"


def test_process_outcomes_show_each_exit_and_the_exception_line():
    out = {"right": [(0, "rank 0 ok\n"), (0, "rank 1 ok\n")],
           "wrong port": [(1, "Traceback:\n  x\ntorch.distributed.DistStoreError: Timed out after 10s\n[W] frames")]}
    df = tables.process_outcomes(out)
    assert list(df.columns) == ["exit code", "last words"]
    assert df.loc[("right", 1), "last words"] == "rank 1 ok"
    assert df.loc[("wrong port", 0), "exit code"] == 1
    assert df.loc[("wrong port", 0), "last words"] == "torch.distributed.DistStoreError: Timed out after 10s"


def test_placement_gives_milliseconds_and_the_ratio():
    df = tables.placement({"TP": (0.00123, 0.0246), "DP": (0.5, 2.0)})
    assert list(df.columns) == ["inside a node (ms)", "across nodes (ms)", "across / inside (×)"]
    assert df.loc["TP", "inside a node (ms)"] == 1.2 and df.loc["TP", "across nodes (ms)"] == 24.6
    assert df.loc["TP", "across / inside (×)"] == 20 and df.loc["DP", "across / inside (×)"] == 4


def test_diagnoses_show_each_runs_fault_and_whom_it_blames():
    from gpucourse.run.forensics import Diagnosis

    class Run:  # what diagnoses reads of a RunResult
        def __init__(self, status, found):
            self.status, self.world_size, self.found = status, 4, found

        def diagnosis(self):
            return self.found

    df = tables.diagnoses({"skip": Run("failed", Diagnosis([1], "all_reduce", 4, "missing")),
                           "fine": Run("ok", None)})
    assert df.loc["skip", "kind"] == "missing" and df.loc["skip", "blamed rank(s)"] == [1]
    assert df.loc["skip", "collective"] == "all_reduce #4"
    assert df.loc["fine", "ended"] == "ok" and pd.isna(df.loc["fine", "kind"])


def test_attempt_logs_read_every_attempts_folder(tmp_path):
    class Run:  # what attempt_logs reads of a RunResult
        run_dir = tmp_path

        def log(self, rank, attempt):
            return f"attempt {attempt} rank {rank} step 1\nstep 2\n"

    for k in (0, 1):
        (tmp_path / "logs" / f"attempt{k}").mkdir(parents=True)
    df = tables.attempt_logs(Run(), ranks=2)
    assert list(df.index) == [(0, 0), (0, 1), (1, 0), (1, 1)] and list(df.columns) == ["printed"]
    assert df.loc[(1, 0), "printed"] == "attempt 1 rank 0 step 1 | step 2"


# --- chapter 04 ---------------------------------------------------------------------------------------
RULES = {"keep": "(a) keep η", "warmup": "(c) warmup"}


def run(rule, lr, accs, losses, final_loss=0.5):
    head = {"global_batch": 64, "base_lr": 0.1, "target_lr": lr}
    pts = [{"epoch": e, "opt_step": 10 * i, "step_losses": ls, "test_acc": a, "test_loss": final_loss,
            "seconds": 1.25 * i} for i, (e, a, ls) in enumerate(zip((0.0, 0.5, 1.0, 2.0), accs, losses))]
    return {"header": {**head, "rule": rule}, "points": pts}


def large_batch_runs():
    losses = ([], [2.3, 2.5], [1.0], [0.5])
    base = run("keep", 0.1, (0.1, 0.5, 0.7, 0.9), losses)
    return {1: {"keep": base}, 2: {"keep": run("keep", 0.1, (0.1, 0.4, 0.6, 0.8), losses),
                                   "warmup": run("warmup", 0.2, (0.1, 0.1, 0.1, 0.1), ([], [9.0], [8.0], [7.0]),
                                                 final_loss=float("nan"))}}, base


def test_large_batch_runs_have_a_row_per_world_size_and_rule():
    runs, _ = large_batch_runs()
    df = tables.large_batch_runs(runs, names=RULES, early=0.5)
    assert list(df.columns) == ["global batch", "lr (after warmup)", "steps", "loss: step 1", "max, epoch 1",
                                "test acc @ epoch 0.5", "final test acc", "final test loss", "time (s)"]
    assert list(df.index) == [(1, "baseline (all rules are one)"), (2, "(a) keep η"), (2, "(c) warmup")]
    row = df.loc[(2, "(c) warmup")]
    assert row["lr (after warmup)"] == 0.2 and row["steps"] == 30 and row["max, epoch 1"] == 9.0
    assert df.loc[(1, "baseline (all rules are one)"), "time (s)"] == 3.8  # 3.75 at one decimal


def test_large_batch_vs_baseline_gives_differences_and_divergence():
    runs, base = large_batch_runs()
    df = tables.large_batch_vs_baseline(runs, base, names=RULES, early=0.5)
    assert list(df.index) == [(2, "(a) keep η"), (2, "(c) warmup")]
    assert df.loc[(2, "(a) keep η"), "Δ vs 1 rank (early)"] == -0.1
    assert df.loc[(2, "(a) keep η"), "Δ vs 1 rank (final)"] == -0.1
    assert not df.loc[(2, "(a) keep η"), "diverged"] and df.loc[(2, "(c) warmup"), "diverged"]
    assert df.loc[(2, "(c) warmup"), "loss: step 1"] == 9.0


def test_sgd_assumptions_table_shows_percent_and_the_noise_scale():
    measured = {"initial weights": {"g2": 4.0, "b_noise": {32: 8.0, 64: 8.81234}, "trace": 8.4,
                                    "noise_scale": 2.1, "ks": {2: 0.05, 4: 0.2549}}}
    df = tables.sgd_assumptions(measured)
    assert list(df.columns) == ["‖G‖²", "B×noise, B=32", "B×noise, B=64", "noise scale (samples)",
                                "k=2: k steps vs one (%)", "k=4: k steps vs one (%)"]
    assert df.loc["initial weights", "k=4: k steps vs one (%)"] == 25.0
    assert df.loc["initial weights", "noise scale (samples)"] == 2.1
    assert df.loc["initial weights", "B×noise, B=64"] == 8.81  # three significant digits


# --- chapter 06 ---------------------------------------------------------------------------------------
def tp_metrics():
    def rec(diffs, calls):
        return {"case": "row", "shapes": {"W": [8, 4]}, "diffs": diffs, "calls": calls}
    call = {"phase": "forward", "op": "all_reduce", "bytes": 2048}
    return {1: {0: [{"case": "impl"}, rec({"Y": 0.0, "partial": 0.0}, [])]},
            2: {0: [rec({"Y": 1e-7, "partial": 0.5}, [call])], 1: [rec({"Y": 3e-5, "partial": 0.4}, [call])]}}


def test_tp_check_takes_the_worst_rank_and_names_what_differs():
    df = tables.tp_check(tp_metrics(), "row", tol=1e-5, skip=("partial",))
    assert list(df.columns) == ["shapes", "Y", "partial", "verdict", "collectives (rank 0)"]
    assert df.loc[2, "Y"] == 3e-5 and df.loc[2, "partial"] == 0.5  # rank 1's Y, rank 0's partial
    assert df.loc[2, "verdict"] == "DIFFERENT from dense: Y" and df.loc[1, "verdict"] == "all within 1e-05 of dense"
    assert df.loc[2, "collectives (rank 0)"] == "forward: all_reduce 2 KiB" and df.loc[1, "collectives (rank 0)"] == "none"


def test_tp_block_traffic_checks_one_all_reduce_each_way_of_the_formulas_size():
    size = 2 * 4 * 8 * 4
    ok = [{"phase": "forward", "op": "all_reduce", "bytes": size}, {"phase": "backward", "op": "all_reduce", "bytes": size}]
    records = {1: {"mlp": {"calls": []}, "attention": {"calls": []}},
               2: {"mlp": {"calls": ok}, "attention": {"calls": ok + [{"phase": "forward", "op": "all_gather", "bytes": 8}]}}}
    df = tables.tp_block_traffic(records, batch=2, seq=4, hidden=8)
    assert list(df.columns) == ["forward all-reduces", "backward all-reduces", "bytes each (run)",
                                "b·s·h·4 (bytes, formula)", "sent per rank per all-reduce", "Megatron's count"]
    assert df.loc[(1, "mlp"), "Megatron's count"] == "matches" and df.loc[(2, "mlp"), "Megatron's count"] == "matches"
    assert df.loc[(2, "attention"), "Megatron's count"] == "DIFFERS"
    assert df.loc[(2, "mlp"), "bytes each (run)"] == str(size) and df.loc[(2, "mlp"), "b·s·h·4 (bytes, formula)"] == size
    assert df.loc[(2, "mlp"), "sent per rank per all-reduce"] == "256 B"  # 2(N-1)/N × 256 B on 2 ranks


def test_comm_counts_list_each_phases_collectives():
    df = tables.comm_counts({"DTensor": {"diffs": {"Y": 1e-7}, "comms": {"forward": {"all_reduce": 1}, "backward": {}}},
                             "yours": {"diffs": {}, "comms": {}}})
    assert list(df.columns) == ["Y", "forward collectives", "backward collectives"]
    assert df.loc["DTensor", "forward collectives"] == "all_reduce ×1" and df.loc["DTensor", "backward collectives"] == "none"
    assert df.loc["yours", "forward collectives"] == "none"


def test_tp_cost_gives_ms_and_the_ratio_per_degree_and_link():
    df = tables.tp_cost({(2, "NVLink 4 (H100 SXM)"): (0.004, 0.001), (2, "100 GbE"): (0.004, 0.02)})
    assert list(df.columns) == ["compute (ms)", "link (GB/s, nominal)", "4 all-reduces (ms)", "comm / compute"]
    assert df.loc[(2, "100 GbE"), "comm / compute"] == 5.0 and df.loc[(2, "NVLink 4 (H100 SXM)"), "compute (ms)"] == 4.0
    assert df.loc[(2, "100 GbE"), "link (GB/s, nominal)"] == 12  # 100 Gbit/s


# --- chapter 07b: precision and recomputation ---------------------------------------------------------
def _recipe_record(name, numel=100, **over):
    per = costs.recipe_bytes_per_param(name, "adamw")
    rec = {"num_params": numel, "num_tensors": 4, "dtype": "torch.float32", "state_dtype": "torch.float32",
           "parameters": per["parameters"] * numel, "gradients": per["gradients"] * numel,
           "master_weights": per["master weights"] * numel, "optimizer_states": per["optimizer states"] * numel,
           "step_counters": 16, "weight_copies": 150, "cuda_peak": None, "cuda_held": None}
    return rec | over


def test_recipe_tables_flag_a_part_off_its_formula_and_mark_fp8_modelled():
    assert tables.recipe_bytes().loc["fp8", "source"] == "MODELLED"
    assert tables.recipe_bytes().loc["mixed", "total (bytes/param)"] == 16
    df = tables.recipe_states({"fp32": _recipe_record("fp32"), "bf16": _recipe_record("bf16", gradients=400),
                               "mixed": _recipe_record("mixed", step_counters=12)})
    assert df["= formula"].tolist() == [True, False, True]
    assert df["= 4 B per tensor"].tolist() == [True, True, False]
    assert df.loc["bf16", "gradients (bytes/param)"] == 4 and df.loc["fp32", "16-bit weight copies kept (bytes/param)"] == 1.5
    assert "CUDA peak (bytes/param)" not in df  # no GPU: no column pretending to a measurement
    gpu = tables.recipe_states({"fp32": _recipe_record("fp32", cuda_peak=2000, cuda_held=1600)})
    assert gpu.loc["fp32", "CUDA peak (bytes/param)"] == 20


def test_loss_scale_steps_and_faults():
    good = [{"scaler_step": 0, "scale": 2.0**28, "overflow": True, "params_changed": False, "new_scale": 2.0**27, "loss": 1},
            {"scaler_step": 1, "scale": 2.0**27, "overflow": False, "params_changed": True, "new_scale": 2.0**27, "loss": .5}]
    assert tables.loss_scale_steps(good).loc[0, "new scale"] == "2^27"
    assert tables.loss_scale_faults(good) == []
    stepped_anyway = [good[0] | {"params_changed": True}]
    not_halved = [good[0] | {"new_scale": 2.0**28}]
    assert len(tables.loss_scale_faults(stepped_anyway)) == 1 and len(tables.loss_scale_faults(not_halved)) == 1


def test_underflow_shares_and_float_formats():
    df = tables.underflow([{"residual": 1e-3, "median_abs_grad": 2e-6, "nonzero_fp32": 200, "zero_fp16": 50,
                            "zero_fp16_scaler": 0}])
    assert df.loc["1e-03", "lost, no scaler (%)"] == 25.0 and df.loc["1e-03", "lost in fp16 + GradScaler"] == 0
    import torch

    formats = tables.float_formats([torch.float16, torch.bfloat16])
    assert formats.loc["float16", "max"] == 65504 and formats.loc["bfloat16", "relative step (eps)"] == 2**-7


def test_cast_errors_counts_zeros_and_can_leave_an_outlier_out():
    import torch

    ref = torch.tensor([10.0, 1.0, 2.0, 4.0])
    df = tables.cast_errors(ref, {"exact": ref.clone(), "lossy": torch.tensor([10.0, 0.0, 2.0, 4.0])})
    assert df.loc["exact", "became zero"] == 0 and df.loc["exact", "relative error"] == 0
    assert df.loc["lossy", "became zero"] == 1 and df.loc["lossy", "of"] == 4
    rest = tables.cast_errors(ref, {"outlier zeroed": torch.tensor([0.0, 1.0, 2.0, 4.0])}, skip_first=True)
    assert rest.loc["outlier zeroed", "became zero"] == 0 and rest.loc["outlier zeroed", "of"] == 3


def test_activation_and_recomputation_tables():
    kept = {(8, "none"): 1000, (8, "selective"): 400, (8, "full"): 100}
    df = tables.activations_kept(kept, {8: 300}, kept | {(8, "full"): 99})
    assert df.loc[8, "selective (bytes)"] == 400 and not df.loc[8, "= formula"]
    flops = {(8, "none"): 100, (8, "selective"): 110, (8, "full"): 150}
    times = {(8, "none"): [0.010, 0.012, 0.011], (8, "selective"): [0.022] * 3, (8, "full"): [0.014] * 3,
             (8, "control"): [0.033] * 3}
    rec = tables.recomputation(kept, flops, flops | {(8, "full"): 1}, times)
    assert rec.index.tolist() == [(8, "none"), (8, "selective"), (8, "full"), (8, "control")]
    assert rec.loc[(8, "selective"), "kept (× none)"] == 0.4 and rec.loc[(8, "full"), "FLOPs run (× none)"] == 1.5
    assert rec.loc[(8, "none"), "FLOPs = formula"] and not rec.loc[(8, "full"), "FLOPs = formula"]
    assert rec.loc[(8, "selective"), "time (× none)"] == 2.0 and rec.loc[(8, "none"), "median step (ms)"] == 11.0
    assert rec.loc[(8, "control"), "time (× none)"] == 3.0 and math.isnan(rec.loc[(8, "control"), "kept (× none)"])


def test_low_precision_speedup_is_amdahl_and_labelled_modelled_in_its_header():
    df = tables.low_precision_speedup("NVIDIA H100 80GB HBM3", (0.0, 0.5))
    assert df.loc[0, "at most × faster in fp8"] == 1.0
    assert df.loc[50, "at most × faster in fp8"] == round(1 / (0.5 + 0.5 / 2), 2)


# --- chapter 07: ZeRO and FSDP ------------------------------------------------------------------------
def test_zero_stages_reproduce_the_zero_papers_figure_1():
    df = tables.zero_stages(7.5e9, 64)
    assert df["per device (GB)"].tolist() == [120.0, 31.4, 16.6, 1.9]
    assert df.loc[3, "communication per step (GB)"] == 1.5 * df.loc[0, "communication per step (GB)"]


def test_model_sizes_say_what_fits_and_when_zero1_never_does():
    df = tables.model_sizes((1e9, 70e9), 80e9)
    assert df.loc["1B", "fits under DDP"] and not df.loc["70B", "fits under DDP"]
    assert df.loc["70B", "fewest devices, ZeRO-1"] == "never" and df.loc["70B", "fewest devices, ZeRO-3"] == 16


def _state_row(n, mode, measured, total_model, diff=None):
    return {"N": n, "mode": mode, "numel": 10, "measured": measured, "total": sum(measured.values()),
            "model": {"total": total_model}, "diff": diff, "impl": None}


def test_memory_per_rank_and_share_of_ddp():
    rows = [_state_row(2, "ddp", {"params": 4e6, "grads": 4e6, "optimizer": 8e6}, 16e6),
            _state_row(2, "fsdp2", {"params": 2e6, "grads": 2e6, "optimizer": 4.4e6}, 8e6, diff=1e-7)]
    df = tables.memory_per_rank(rows)
    assert df.loc[(2, "fsdp2"), "total (MB)"] == 8.4 and df.loc[(2, "fsdp2"), "measured / formula"] == 1.05
    assert df.loc[(2, "fsdp2"), "|θ − θ_DDP|"] == 1e-7
    share = tables.share_of_ddp(rows)
    assert share.loc[(2, "fsdp2"), "parameters"] == 0.5 and share.loc[(2, "fsdp2"), "optimizer states"] == 0.55


class _Step:
    def __init__(self, us):
        self.duration_us = us


class _Rank:
    def __init__(self, per_step):
        self.per_step = per_step

    def collective(self, name):
        return self.per_step


class _Analysis:
    kind = "cpu-gloo"

    def __init__(self, per_step, step_us):
        self.ranks = {0: _Rank(per_step)}
        self.steps = [_Step(us) for us in step_us]


def test_prefetch_table_from_traces_and_counts():
    analyses = {"defaults": _Analysis([(4000.0, 4000.0), (6000.0, 6000.0)], [20000, 22000]),
                "prefetch": _Analysis([(6000.0, 1500.0), (6000.0, 1500.0)], [18000, 18000])}
    rec = {"all_gathers": 6, "all_gather_bytes": [1.5e6], "async_all_gathers": 0}
    df = tables.prefetch(analyses, {"defaults": rec, "prefetch": rec | {"async_all_gathers": 6}})
    assert df.loc["defaults", "hidden (%)"] == 0 and df.loc["prefetch", "hidden (%)"] == 75
    assert df.loc["defaults", "all-gather (ms)"] == 5.0 and df.loc["defaults", "max (ms)"] == 6.0
    assert df.loc["prefetch", "exposed (ms)"] == 1.5 and df.loc["defaults", "step (ms)"] == 21.0
    assert df.loc["prefetch", "async"] == 6


def test_unsharded_hsdp_and_accumulation_tables():
    rec = {"all_gathers": 1, "all_gather_bytes": [4e6], "reduce_scatters": 1, "peak_unsharded_bytes": 4e6,
           "model_bytes": 4e6}
    assert tables.unsharded({"root only": rec}).loc["root only", "unsharded at most (MB)"] == 4.0
    row = {"variant": "hsdp", "mesh": "2x2", "measured": {"params": 1, "grads": 1, "optimizer": 2},
           "model": {"params": 1, "grads": 1, "optimizer": 3}, "loss diff": 0.0, "param diff": 1e-8}
    assert not tables.hsdp_states([row]).loc["hsdp", "= formula"]
    comm = {"hsdp": {"all_reduce": {"group": "replicate", "ranks_list": [0, 2], "counted": 2e6, "calls_bytes": 2e6,
                                    "sent": 1e6}}}
    assert tables.hsdp_comm(comm).loc[("hsdp", "all_reduce"), "ranks"] == "[0, 2]"
    calls = [{"op": "all_gather", "bytes": 1e6}] * 8 + [{"op": "reduce_scatter", "bytes": 1e6}]
    df = tables.accumulation_calls({"no-sync": {"calls": calls, "max_param_diff": 1e-9}})
    assert df.loc["no-sync", "all_gather calls"] == 8 and df.loc["no-sync", "reduce_scatter (MB)"] == 1.0


# --- chapters 03, 09, 10 ------------------------------------------------------------------------------
def fake_analysis(rows):
    return type("A", (), {"table": lambda self: rows, "label": lambda self: "t", "problems": []})()


def trace_row(rank, overlap, comm=4.0, exposed=1.0):
    return {"rank": rank, "steps": 3, "step_ms": 20.0, "compute_ms": 15.0, "comm_ms": comm, "exposed_comm_ms": exposed,
            "other_ms": 4.0, "overlap": overlap}


def test_trace_breakdown_has_a_row_per_rank_and_blank_overlap_without_comm():
    df = tables.trace_breakdown(fake_analysis([trace_row(0, 0.75), trace_row(1, math.nan, 0.0, 0.0)]))
    assert df.loc[0, "hidden (%)"] == 75.0 and math.isnan(df.loc[1, "hidden (%)"])
    assert list(df.columns)[:2] == ["steps", "step (ms)"]
    with pytest.raises(ValueError, match="no rank"):
        tables.trace_breakdown(fake_analysis([]))


def test_trace_breakdowns_stack_the_runs():
    df = tables.trace_breakdowns({"a": fake_analysis([trace_row(0, 0.5)]), "b": fake_analysis([trace_row(0, 0.25),
                                                                                             trace_row(1, 0.75)])})
    assert df.loc[("b", 1), "hidden (%)"] == 75.0 and len(df) == 3
    with pytest.raises(ValueError, match="no runs"):
        tables.trace_breakdowns({})


def test_ddp_modes_give_what_communication_adds_to_compute_alone():
    from tests.unit.models.test_ddpsteps import fake_run

    df = tables.ddp_modes(fake_run())
    assert df.loc["compute alone (no-ddp)", "median step (ms)"] == 12.0
    assert df.loc["DDP (overlap)", "comm adds (ms)"] == 3.0 and df.loc["DDP (overlap)", "comm adds (%)"] == 25.0
    assert df.loc["DDP without overlap", "comm adds (ms)"] == 9.0
    assert math.isnan(df.loc["compute alone (no-ddp)", "comm adds (ms)"])


def test_bucket_runs_and_predictions_read_each_variants_own_launch():
    from tests.unit.models.test_ddpsteps import fake_run

    fast = fake_run("fast", modes={"no-ddp": [(6, 2, 4)] * 3, "ddp": [(8, 2, 4)] * 3, "no-overlap": [(9, 2, 4)] * 3})
    variants = {"main": (fake_run("main"), "ddp-rank", "ddp"), "other": (fast, "ddp-rank", "ddp")}
    analyses = {"main": fake_analysis([trace_row(0, 0.75)]), "other": fake_analysis([trace_row(0, 0.5, 4.0, 2.0)])}
    df = tables.bucket_runs(variants, analyses)
    assert df.loc["main", "compute alone (ms)"] == 12.0 and df.loc["other", "compute alone (ms)"] == 6.0
    assert df.loc["main", "hidden (%)"] == 75.0 and df.loc["other", "hidden (%)"] == 50.0
    load = {"main": (1.0, 1.5), "fast": (3.0, 2.0)}
    pred = tables.step_predictions(variants, overlap_cost=1.0, fit=costs.AlphaBeta(1e-4, 1e-9), load=load)
    # overlap cost 1: hiding buys nothing, the step is compute + all of comm (5 ms of buckets)
    assert pred.loc["main", "predicted (ms)"] == 17.0 and pred.loc["other", "predicted (ms)"] == 11.0
    assert pred.attrs["errors"]["alone"]["main"] == pytest.approx((17 - 15) / 15)
    assert pred.loc["main", "predicted, free overlap (ms)"] < 17.0
    assert pred.loc["other", "load before → after"] == "3.0 → 2.0"
    misses = tables.prediction_misses(variants, {"main": 0.5, "other": 0.05}, load=load, cores=2, goal=0.2)
    assert "load 3.0" not in misses.loc["main", "why it missed"] and misses.loc["other", "why it missed"] == ""
    assert misses.loc["main", "compute noise (%)"] == round(100 * (30 - 10) / 12)


def test_scaling_fit_and_overlap_tables():
    df = tables.scaling_runs({1: [100.0, 110.0], 2: [150.0]}, {1: 1.0, 2: 0.714})
    assert df.loc[1, "mean (samples/s)"] == 105 and df.loc[2, "efficiency (%)"] == 71
    fit = costs.AlphaBeta(1e-3, 1e-9)
    ar = tables.allreduce_fit([(2**20, 0.002)], fit)
    assert ar.loc["1 MiB", "measured (ms)"] == 2.0
    assert ar.loc["1 MiB", "α–β fit (ms)"] == round(fit.predict(2**20) * 1e3, 3)
    ov = tables.overlap_trials({"compute": 10.0, "comm": 4.0, "both": 12.0})
    assert ov.loc["free overlap would take", "time (ms)"] == 10.0
    assert ov.loc["one after the other would take", "time (ms)"] == 14.0


def test_modelled_scaling_and_compiled_ddp():
    points = [{"world_size": n, "efficiency": e, "comm_bound": e < 0.5} for n, e in ((8, 0.9), (256, 0.4), (4096, 0.1))]
    df = tables.modelled_scaling({"curve": points})
    assert df.loc["curve", "efficiency, N=256 (%)"] == 40 and df.loc["curve", "comm-bound from N"] == 256
    with pytest.raises(ValueError, match="no modelled point"):
        tables.modelled_scaling({"curve": points}, at=(2,))
    cmp = {"graphs": {"compiled": 3, "one-graph": 1}, "compile_s": {"eager": 0.1, "compiled": 9.0, "one-graph": 7.0},
           "step_ms": {"eager": 5.0, "compiled": 4.0, "one-graph": 4.5}, "loss": {"eager": 1.0, "compiled": 1.0,
                                                                               "one-graph": 1.0}}
    out = tables.compiled_ddp(cmp)
    assert out.loc["compiled", "graphs"] == 3 and out["graphs"].isna()["eager"]


# --- chapter 05: pipeline parallelism ---------------------------------------------------------------
def test_pipeline_orders_bubbles_and_stage_activations_show_the_runs_numbers():
    orders = tables.pipeline_orders(lambda kind, s, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)],
                                    ("gpipe",), p=2, m=2)
    assert orders.loc[("gpipe", 1), "actions, in order"] == "F0 F1 B0 B1"
    df = tables.pipeline_bubbles([{"p": 2, "kind": "gpipe", "m": 4, "measured": 0.2614, "formula": 0.2,
                                   "step_ms": 180.3, "ideal_ms": 150}])
    assert df.loc[(2, "gpipe", 4)].tolist() == [26.1, 20.0, 180, 150]
    assert list(df.columns) == ["bubble measured (%)", "(p-1)/(m+p-1) (%)", "step (ms)", "(m+p-1)·3·work (ms)"]
    held = tables.stage_activations([{"p": 2, "schedule": "1f1b", "m": 4, "held": [2, 1], "bytes": [32768, 24576],
                                      "rule": [2, 1], "matches": False}])
    assert held.loc[(2, "1f1b", 4), "saved (KiB, by stage)"] == [32, 24]
    assert held.loc[(2, "1f1b", 4), "matches the rule"] == "✗"
    real = tables.pipeline_real_compute({4: {0: [("F0", 0, 4), ("B0", 4, 12)], 1: [("F0", 4, 8), ("B0", 8, 16)]}}, p=2)
    assert real.loc[4, "(p-1)/(m+p-1) (%)"] == 20.0 and real.loc[4, "F+B per micro-batch, stage 1 (ms)"] == 3.0
    assert real.loc[4, "bubble measured (%)"] == 25.0


def test_gpipe_check_and_schedule_runs_show_losses_differences_and_refusals():
    metrics = {0: [{"pipeline": "gpipe_step", "error": "NotImplementedError: write it\nmore", "loss": None}],
               1: [{"pipeline": "torch ScheduleGPipe", "error": None, "max_grad_diff": 3e-9, "loss": 1.05,
                    "ref_loss": 1.06}, {"other": 1}]}
    df = tables.gpipe_check(metrics)
    assert df.loc[(0, "gpipe_step"), "error"] == "NotImplementedError: write it"
    assert df.loc[(1, "torch ScheduleGPipe"), "unsplit loss"] == 1.06
    ok = {"error": None, "stages": [0, 2], "max_grad_diff": 1e-18, "loss": 0.5, "ref_loss": 0.5}
    runs = {("Interleaved1F1B", 4): {0: ok, 1: {**ok, "stages": [1, 3], "loss": None, "max_grad_diff": 2e-18}},
            ("1F1B", 1): {0: {"error": "ValueError: too few"}, 1: {"error": "ValueError: too few"}}}
    df = tables.schedule_runs(runs)
    assert df.loc[("Interleaved1F1B", 4), "stages by rank"] == [[0, 2], [1, 3]]
    assert df.loc[("Interleaved1F1B", 4), "max |grad − unsplit|"] == 2e-18
    assert df.loc[("Interleaved1F1B", 4), "loss"] == "0.500000000000"
    assert df.loc[("1F1B", 1), "refused"] == "ValueError: too few"


def test_schedule_bubbles_versus_1f1b_overheads_and_few_micro_batches():
    row = {"v": 1, "step": 173.2, "busy": 126.4, "share": 0.272, "ratio": 0.374, "free": 0.252, "nominal": 0.25,
           "f_share": 0.2, "f_ratio": 0.25}
    zbv = {**row, "v": 2, "ratio": 0.112, "nominal": 0.042, "step": 151.0}
    del zbv["f_share"], zbv["f_ratio"]
    table = {("1F1B", 4): row, ("ZBVZeroBubble", 4): zbv, ("GPipe", 1): {**row, "ratio": 1.054, "nominal": 1.0}}
    df = tables.schedule_bubbles(table, refused={("1F1B", 1): "ValueError: too few"})
    assert list(df.index) == [("1F1B", 1), ("1F1B", 4), ("ZBVZeroBubble", 4), ("GPipe", 1)]
    assert df.loc[("1F1B", 1), "refused"] == "ValueError" and df.loc[("1F1B", 4), "idle/work measured (%)"] == 37.4
    assert math.isnan(df.loc[("ZBVZeroBubble", 4), "idle/work formula (%)"])
    vs = tables.versus_1f1b(table, 4)
    assert vs.loc["ZBVZeroBubble", "measured vs 1F1B"] == "smaller" and list(vs.index) == ["ZBVZeroBubble"]
    extra = tables.action_overheads({"GPipe": {"F": (0.61, 8), "B": (1.2, 8)}, "ZBV": {"F": (0.5, 16), "W": (0.8, 16)}})
    assert extra.loc["GPipe", "F: extra (ms)"] == 0.6 and extra.loc["ZBV", "W: actions"] == 16
    assert extra["B: actions"].isna().tolist() == [False, True]
    runs = {("GPipe", 1): {0: {"error": None}}, ("1F1B", 1): {0: {"error": "ValueError: m < p"}},
            ("1F1B", 4): {0: {"error": None}}}
    few = tables.few_micro(runs, table, p=2)
    assert list(few.index) == [(1, "GPipe"), (1, "1F1B")]
    assert few.loc[(1, "1F1B"), "what happened"] == "refused: ValueError: m < p"
    assert few.loc[(1, "GPipe"), "idle/work modelled (%)"] == 100.0 and few.loc[(1, "GPipe"), "(p-1)/m (%)"] == 100.0


def test_dualpipev_idle_chunks_and_stage_costs_tables():
    plan = tables.dualpipev_plan({1: {0: {"error": "ValueError: m >= 2p"}},
                                  4: {0: {"error": None, "stages": [0, 3], "max_grad_diff": 0.0,
                                          "order": ["0F0", "3B0"]}}})
    assert plan.loc[(1, 0), "plan"] == "refused: ValueError: m >= 2p" and plan.loc[(4, 0), "plan"] == "0F0 3B0"
    idle = tables.timeline_idle({"measured": (145.44, {0: 16.94, 1: 16.6})})
    assert idle.loc["measured"].tolist() == [145.4, 16.9, 16.6]
    chunks = tables.chunk_activations([{"schedule": "1F1B", "m": 4, "rank": 0, "chunks": 2, "formula": None,
                                        "micro-batches": 2.0, "bytes": 8192, "matches": True}])
    assert chunks.loc[("1F1B", 4, 0)].tolist() == [2, "—", 2.0, 8, "✓"]
    counted = [{"stage": 0, "params": 10, "flops_per_token": 60}]
    assert tables.stage_costs(counted, [{"stage": 0, "params": 10, "flops_per_token": 61}]).loc[0].tolist() == [
        10, 10, 60, 61]
    with pytest.raises(ValueError, match="1 counted stages but 2 modelled"):
        tables.stage_costs(counted, counted * 2)
    cuts = tables.stage_cuts({"even": [1, 1]}, d_model=8, vocab=16, seq_len=4)
    flops = [st["flops_per_token"] for st in costs.pipeline_stage_costs([1, 1], 8, 16, 4)]
    assert cuts.loc["even", "pace vs balanced (%)"] == round(100 * sum(flops) / 2 / max(flops)) < 100


# --- chapter 11: expert parallelism -------------------------------------------------------------------
def test_moe_per_rank_shows_the_named_values_and_each_difference_from_one_process():
    recs = {1: {"dropped": 3, "ep_ranks": [0, 1], "diffs": {"output": 2e-7, "router.grad": 1e-8}},
            0: {"dropped": 0, "ep_ranks": [0, 1], "diffs": {"output": 1e-7, "router.grad": 0.5}}}
    df = tables.moe_per_rank(recs, {"dropped": "dropped", "ep group": "ep_ranks"})
    assert list(df.index) == [0, 1] and list(df.columns) == ["dropped", "ep group", "|Δ| output", "|Δ| router.grad"]
    assert df.loc[0, "|Δ| router.grad"] == 0.5 and df.loc[1, "dropped"] == 3 and df.loc[1, "ep group"] == [0, 1]
    assert list(tables.moe_per_rank(recs, {"dropped": "dropped"}, diffs=False).columns) == ["dropped"]
    with pytest.raises(ValueError, match="rank: record"):
        tables.moe_per_rank({})


# --- chapter 04: large batches ----------------------------------------------------------------------------------------
def test_warmup_lrs_reads_the_schedule_at_step_0_the_end_of_warmup_and_scaled_lr():
    from types import SimpleNamespace

    def warmup_lr(step, *, base_lr, base_batch, global_batch, warmup_steps, total_steps=None):
        target = base_lr * global_batch / base_batch
        return target if step >= warmup_steps else base_lr + (target - base_lr) * step / warmup_steps
    schedule = SimpleNamespace(warmup_lr=warmup_lr, scaled_lr=lambda lr, b, g: lr * g / b)
    kwargs = {n: (dict(base_lr=0.0125, base_batch=32, global_batch=32 * n, warmup_steps=w), t)
              for n, w, t in ((1, 256, 512), (4, 64, 3))}  # 4 ranks: the run ends (step 3) before warmup does
    df = tables.warmup_lrs(schedule, kwargs)
    assert df.loc[1].tolist() == [32, 256, 0.0125, 0.0125, 0.0125]
    assert df.loc[4, "lr at end of warmup"] == float(f"{0.0125 + 0.0375 * 3 / 64:.5g}")
    assert df.loc[4, "scaled_lr"] == 0.05


def test_best_rules_and_noise_spread():
    runs, _ = large_batch_runs()
    df = tables.best_rules(runs, names=RULES, early=0.5)
    assert list(df.index) == [2]  # one rank is the baseline, not a contest
    assert df.loc[2, "best at epoch 0.5"] == "(a) keep η" and df.loc[2, "best at the end"] == "(a) keep η"
    assert df.loc[2, "its test acc (end)"] == 0.8
    measured = {"initial weights": {"b_noise": {32: 8.0, 64: 8.81234, 128: 10.0}, "noise_scale": 2.1234}}
    spread = tables.noise_spread(measured)
    assert spread.loc["initial weights"].tolist() == [1.25, "32..128", 2.12]


# --- chapter 08: checkpoints that reshard -----------------------------------------------------------------------------
def test_reshard_compares_losses_and_sample_ids_and_counts_repeats():
    def run(losses, batches, first=0, **extra):
        return [{"step": first + s, "loss": loss, "ids": ids, "layout": "fsdp", "world": 4, **extra}
                for s, (loss, ids) in enumerate(zip(losses, batches))] + [{"event": "setup"}]
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    reference = run([4.0, 3.0, 2.0, 1.0], batches)
    exact = run([2.0, 1.0 + 1e-12], batches[2:], first=2, world=2)
    dropped = run([2.5, 1.5], batches[:2], first=2)  # the loader started again at sample 0
    df = tables.reshard(reference, {"exact": exact, "dropped": dropped}, save_at=1)
    assert df.loc["exact", "world"] == 2 and df.loc["exact", "steps after the save"] == 2
    assert 0 < df.loc["exact", "max |loss − uninterrupted|"] < 1e-11
    assert df.loc["exact", "steps with the same sample ids"] == 2
    assert df.loc["exact", ["samples repeated", "samples skipped"]].tolist() == [0, 0]
    assert df.loc["dropped", "steps with the same sample ids"] == 0
    assert df.loc["dropped", ["samples repeated", "samples skipped"]].tolist() == [4, 4]
    assert df.loc["dropped", "max |loss − uninterrupted|"] == 0.5
    with pytest.raises(ValueError, match="no step records"):
        tables.reshard(reference, {"failed": [{"event": "setup"}]}, save_at=1)
    with pytest.raises(ValueError, match="must run past step"):
        tables.samples_out_of_place(reference[:2], exact, save_at=1)
