"""Chapter 12's planner (models/planner.py): memory per GPU and a step time for a layout, modelled from the cost
models; the published runs read against it; the tables and the figure that show a plan and a dry run."""
import pytest

from gpucourse import costs
from gpucourse.models import planner
from gpucourse.viz import plots, tables


def test_shapes_have_their_published_parameter_counts():
    got = {name: planner.shape_params(name)["total"] / 1e9 for name in ("llama3-8b", "llama3-70b", "llama3-405b",
                                                                          "megatron-1t", "mixtral-8x7b")}
    assert got == pytest.approx({"llama3-8b": 8.0, "llama3-70b": 70.6, "llama3-405b": 405.8, "megatron-1t": 1009.3,
                                 "mixtral-8x7b": 46.7}, abs=0.1)


def test_a_plan_that_does_not_fit_is_reported_as_such():
    naive = planner.plan_parallelism("llama3-70b", gpus=1024, dp=1024, seq=8192)  # every GPU a replica
    assert naive["label"] == "modelled" and not naive["fits"] and naive["peak_bytes"] > 80e9
    # bf16 weights and gradients whole on every GPU, fp32 optimizer state sharded 1,024 ways (ZeRO-1)
    n = planner.shape_params("llama3-70b")["total"]
    states = naive["stages"][0]["memory"]
    assert states["params"] == states["grads"] == pytest.approx(2 * n)
    assert states["params"] + states["grads"] + states["optimizer"] == pytest.approx(
        costs.zero_memory_bytes(n, 1024, 1))
    split = planner.plan_parallelism("llama3-70b", gpus=1024, dp=32, tp=8, pp=4, seq=8192)
    assert split["fits"] and split["peak_bytes"] < naive["peak_bytes"] / 8
    assert planner.smallest_fitting("llama3-70b", gpus=1024, tp=8, seq=8192)["pp"] <= 4
    small_device = planner.plan_parallelism("llama3-70b", gpus=1024, dp=32, tp=8, pp=4, seq=8192, device_bytes=16e9)
    assert not small_device["fits"]


@pytest.mark.parametrize("layout, message", [
    ({"dp": 64, "tp": 8, "pp": 4}, "not the 1,024 GPUs"),          # 2,048 places for 1,024 GPUs
    ({"dp": 16, "tp": 8, "pp": 4}, "must equal the GPU count"),    # 512
    ({"dp": 128, "tp": 8, "ep": 2}, "no experts"),                 # ep on a dense model
    ({"dp": 1024, "tp": 1, "global_batch": 100}, "multiple of 1024"),
    ({"dp": 0, "tp": 8}, "dp must be a whole number"),
], ids=["too-many", "too-few", "ep-dense", "batch", "zero-dp"])
def test_a_layout_that_cannot_be_laid_out_is_refused_with_a_clear_error(layout, message):
    with pytest.raises(ValueError, match=message):
        planner.plan_parallelism("llama3-70b", gpus=1024, **layout)


def test_tp_across_nodes_and_a_pipeline_that_never_fills_are_flagged():
    wide = planner.plan_parallelism("llama3-70b", gpus=1024, dp=16, tp=16, pp=4, global_batch=16)
    assert wide["spans_nodes"]["tp"] and any("spans nodes" in w for w in wide["warnings"])
    assert any("never fills" in w for w in wide["warnings"])  # 1 micro-batch for 4 stages
    inside = planner.plan_parallelism("llama3-70b", gpus=1024, dp=16, tp=8, pp=8, global_batch=16 * 8 * 4)
    assert not inside["spans_nodes"]["tp"] and inside["warnings"] == []
    # the same work over more micro-batches: a smaller bubble, the same compute
    assert inside["bubble_s"] / inside["compute_s"] == pytest.approx(costs.pipeline_bubble_ratio(8, 32))


def test_step_time_adds_compute_bubble_and_communication():
    plan = planner.plan_parallelism("llama3-8b", gpus=64, dp=8, tp=8, seq=4096, global_batch=64)
    peak = costs.peak_flops(plan["device"], "bf16")
    n = planner.shape_params("llama3-8b")["matmul"]
    flops = costs.model_flops_per_token(n, 32, 4096, 4096) * 4096 * 64 / 64
    assert plan["compute_s"] == pytest.approx(flops / peak) and plan["bubble_s"] == 0
    assert plan["step_s"] == pytest.approx(plan["compute_s"] + sum(plan["comm_s"].values()))
    assert plan["mfu"] == pytest.approx(plan["compute_s"] / plan["step_s"]) and 0 < plan["mfu"] < 1


def test_published_runs_keep_the_papers_figures_apart_from_the_model():
    mega = planner.read_published("Megatron-LM 1T (Narayanan et al. 2021)")
    assert mega["reported"]["share_of_peak"] == 0.52
    # 52 % counts the recomputed forward (4 passes); model FLOPs count 3: about three quarters of it
    assert 0.36 < mega["reported_mfu"] < 0.42 and mega["plan"]["layout"] == {"dp": 6, "tp": 8, "pp": 64, "cp": 1,
                                                                               "ep": 1}
    llama = [planner.read_published(name) for name in planner.PUBLISHED if "Llama" in name]
    assert [r["reported_mfu"] for r in llama] == [0.41, 0.38]
    assert all(r["plan"]["mfu"] > r["reported_mfu"] for r in [mega, *llama])  # the model is an upper bound
    df = tables.published_runs([mega, *llama])
    assert list(df["GPUs"]) == [3072, 16384, 16384] and "reported, as MFU (%)" in df.columns
    with pytest.raises(ValueError, match="unknown published run"):
        planner.read_published("GPT-5")


def test_plan_tables_and_figure_label_everything_modelled():
    plan = planner.plan_parallelism("llama3-405b", gpus=16384, dp=128, tp=8, pp=16, seq=8192, global_batch=2048)
    df = tables.plan_memory(plan)
    assert list(df.index) == ["first", "last"] and df.index.name == "stage (modelled)"
    assert df.loc["first", "total (GB)"] == round(plan["stages"][0]["total"] / 1e9, 1)
    fig = plots.plan_plot(plan)
    texts = [ax.get_ylabel() + ax.get_xlabel() + ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text()]
    assert all("modelled" in t or t.startswith(("fits", "does NOT")) for t in texts)
    assert "modelled, not run" in fig._suptitle.get_text()


def test_dry_run_tables_show_counts_per_rank_and_group():
    rank = {"rank": 1023, "peak_bytes": 3 * 2**20, "flops": 10,
            "memory": {"params": 2**20, "grads": 0, "optimizer": 0, "activations": 2 * 2**20, "other": 0},
            "comms": [{"op": "all_reduce", "group_size": 4, "group": [1020, 1021, 1022, 1023], "calls": 6,
                       "bytes": 6 * 2**20},
                      {"op": "all_gather_single", "group_size": 256, "group": list(range(3, 1024, 4)), "calls": 3,
                       "bytes": 3 * 2**20}],
            "predicted": {"step_s": 0.01, "mfu": 0.001}}
    mem = tables.dryrun_memory({"ranks": [rank]})
    assert mem.loc[1023, "peak (MiB)"] == 3 and mem.loc[1023, "step, modelled (ms)"] == 10
    comms = tables.dryrun_comms({"ranks": [rank]})
    assert list(comms["group"]) == ["[1020, 1021, 1022, 1023]", "[3, 7, …, 1023]"]
    assert list(comms["bytes (MiB)"]) == [6, 3]
    real = {"rank": 1023, "comms": [dict(rank["comms"][0]), dict(rank["comms"][1], calls=2)]}
    assert list(tables.dry_vs_real([rank], [real])["equal"]) == [True, False]


def test_expert_parallelism_splits_the_experts_and_pays_all_to_alls():
    base = {"gpus": 64, "dp": 8, "tp": 8, "seq": 4096, "global_batch": 64}
    one, eight = (planner.plan_parallelism("mixtral-8x7b", ep=ep, **base) for ep in (1, 8))
    shape = planner.shape_params("mixtral-8x7b")
    layers = planner.SHAPES["mixtral-8x7b"]["layers"]
    assert one["stages"][0]["params"] - eight["stages"][0]["params"] == pytest.approx(
        layers * shape["layer_experts"] / 8 * (1 - 1 / 8))
    assert one["comm_s"]["ep"] == 0 < eight["comm_s"]["ep"]
    with pytest.raises(ValueError, match="must divide dp"):
        planner.plan_parallelism("mixtral-8x7b", ep=3, **{**base, "dp": 6, "gpus": 48, "global_batch": 48})
