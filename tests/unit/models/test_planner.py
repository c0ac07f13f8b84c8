"""Chapter 12's planner (models/planner.py): memory per GPU and a step-time estimate for a layout, every term shown;
the published runs it is read against (models/published.py). The tables and the figure that show a plan:
tests/unit/chapters/test_ch12.py."""
import pytest

from gpucourse import costs
from gpucourse.chapters import ch12
from gpucourse.models import planner, published

GiB = 2 ** 30


def test_shapes_have_their_published_parameter_counts():
    got = {name: planner.shape_params(name)["total"] / 1e9 for name in ("llama3-8b", "llama3-70b", "llama3-405b",
                                                                          "megatron-1t", "mixtral-8x7b")}
    assert got == pytest.approx({"llama3-8b": 8.0, "llama3-70b": 70.6, "llama3-405b": 405.8, "megatron-1t": 1008.0,
                                 "mixtral-8x7b": 46.7}, abs=0.1)
    # Narayanan et al.'s Table 1 names its GPTs by parameter count: the shapes must give those counts
    for name, billions in (("megatron-39b", 39.1), ("megatron-76b", 76.1), ("megatron-146b", 145.6),
                           ("megatron-310b", 310.1), ("megatron-530b", 529.6), ("megatron-1t", 1008.0)):
        assert planner.shape_params(name)["total"] / 1e9 == pytest.approx(billions, rel=0.01), name


def test_model_states_are_megatrons_bytes_a_parameter_and_experts_shard_over_their_own_group():
    n = planner.shape_params("llama3-70b")["total"]
    naive = planner.plan_parallelism("llama3-70b", gpus=1024, dp=1024, seq=8192, zero=1)
    states = naive["stages"][0]["memory"]
    # ZeRO-1 (Megatron's distributed optimizer): bf16 weights 2 + fp32 gradients 4 + 12 / d
    assert states["params"] == pytest.approx(2 * n) and states["grads"] == pytest.approx(4 * n)
    assert states["optimizer"] == pytest.approx(12 * n / 1024)
    assert not naive["fits"] and naive["label"] == "modelled"
    # Mixtral, ep 8 on 64 GPUs (dp 64): each expert's states are replicated over 64 / 8 = 8 ranks, not 64
    moe = planner.plan_parallelism("mixtral-8x7b", gpus=64, dp=64, ep=8, seq=4096, global_batch=64, zero=1)
    p = planner.shape_params("mixtral-8x7b")
    L = planner.SHAPES["mixtral-8x7b"]["layers"]
    dense = L * p["layer_dense"] + p["embedding"] + p["head"]
    expected = 12 * (dense / 64 + L * p["layer_experts"] / 8 / 8)
    assert moe["stages"][0]["memory"]["optimizer"] == pytest.approx(expected)
    assert moe["stages"][0]["memory"]["optimizer"] > 8e9  # about 8.8 GB, not the 1.4 GB of sharding over dp


def test_headroom_keeps_gib_and_gb_apart():
    plan = planner.plan_parallelism("llama3-70b", gpus=1024, dp=32, tp=8, pp=4, seq=8192, global_batch=512)
    assert plan["device_bytes"] == 80 * GiB
    groups = 3  # tp, pp and dp have more than one rank
    assert plan["reserved_bytes"] == pytest.approx(plan["peak_bytes"] * (1 + planner.FRAGMENTATION)
                                                   + planner.CUDA_CONTEXT_BYTES + groups * planner.NCCL_BYTES_PER_GROUP)
    assert plan["fits"] == (plan["reserved_bytes"] <= 80 * GiB)
    tight = planner.plan_parallelism("llama3-70b", gpus=1024, dp=32, tp=8, pp=4, seq=8192, global_batch=512,
                                     device_bytes=plan["peak_bytes"] * 1.01)
    assert not tight["fits"]  # the tensors alone fit; with the headroom they do not


@pytest.mark.parametrize("layout, message", [
    ({"dp": 64, "tp": 8, "pp": 4}, "not the 1,024 GPUs"),          # 2,048 places for 1,024 GPUs
    ({"dp": 16, "tp": 8, "pp": 4}, "must equal the GPU count"),    # 512
    ({"dp": 128, "tp": 8, "ep": 2}, "no experts"),                 # ep on a dense model
    ({"dp": 1024, "tp": 1, "global_batch": 100}, "multiple of 1024"),
    ({"dp": 0, "tp": 8}, "dp must be a whole number"),
    ({"dp": 128, "tp": 8, "schedule": "interleaved"}, "virtual_stages >= 2"),
    ({"dp": 32, "tp": 8, "pp": 4, "virtual_stages": 2}, "needs schedule='interleaved'"),
    ({"dp": 32, "tp": 8, "pp": 4, "schedule": "gpipe"}, "schedule must be one of"),
    ({"dp": 128, "tp": 8, "schedule": "dualpipev"}, "needs pp >= 2"),
    ({"dp": 32, "tp": 8, "pp": 4, "schedule": "interleaved", "virtual_stages": 2, "global_batch": 96},
     "at least 4 micro-batches"),
    ({"dp": 32, "tp": 8, "pp": 4, "schedule": "dualpipev", "global_batch": 224}, "at least 8 micro-batches"),
], ids=["too-many", "too-few", "ep-dense", "batch", "zero-dp", "interleaved-v1", "v-without-interleaving",
        "unknown-schedule", "dualpipev-one-stage", "interleaved-starved", "dualpipev-starved"])
def test_a_layout_that_cannot_be_laid_out_is_refused_with_a_clear_error(layout, message):
    with pytest.raises(ValueError, match=message):
        planner.plan_parallelism("llama3-70b", gpus=1024, **layout)


def test_llama3s_split_takes_a_layer_from_the_first_and_the_last_stage():
    """Llama 3 405B on 16 stages: 7, 8 x 14, 7 layers (its paper, section 3.3.2), not the even split's 8 x 14, 7, 7.
    The first stage then holds one layer's states and activations fewer; the last is unchanged."""
    plan = dict(gpus=16384, dp=128, tp=8, pp=16, seq=8192, global_batch=2048, schedule="1f1b")
    even = planner.plan_parallelism("llama3-405b", **plan)
    llama = planner.plan_parallelism("llama3-405b", **plan, stage_layers=[7] + [8] * 14 + [7])
    assert [st["layers"] for st in even["stages"]] == [8, 7] and [st["layers"] for st in llama["stages"]] == [7, 7]
    layer = planner.shape_params("llama3-405b")["layer_dense"] / 8
    assert even["stages"][0]["params"] - llama["stages"][0]["params"] == pytest.approx(layer)
    assert even["stages"][0]["memory"]["activations"] * 7 / 8 == pytest.approx(
        llama["stages"][0]["memory"]["activations"])
    assert even["stages"][1] == llama["stages"][1]
    with pytest.raises(ValueError, match="adding up to the model's 126"):
        planner.plan_parallelism("llama3-405b", **plan, stage_layers=[8] * 16)


def test_tp_across_nodes_and_a_pipeline_that_never_fills_are_flagged():
    wide = planner.plan_parallelism("llama3-70b", gpus=1024, dp=16, tp=16, pp=4, global_batch=16)
    assert wide["spans_nodes"]["tp"] and any("spans nodes" in w for w in wide["warnings"])
    assert any("never fills" in w for w in wide["warnings"])  # 1 micro-batch for 4 stages
    inside = planner.plan_parallelism("llama3-70b", gpus=1024, dp=16, tp=8, pp=8, global_batch=16 * 8 * 4)
    assert not inside["spans_nodes"]["tp"] and inside["warnings"] == []


def test_the_steps_terms_add_up_and_the_bubble_follows_the_schedule():
    base = {"gpus": 1024, "dp": 16, "tp": 8, "pp": 8, "seq": 8192, "global_batch": 16 * 32}
    plans = {s: planner.plan_parallelism("llama3-70b", schedule=s, virtual_stages=2 if s == "interleaved" else 1,
                                         **base) for s in planner.SCHEDULES}
    for plan in plans.values():
        assert plan["step_s"] == pytest.approx(sum(plan["terms"].values()))
        assert plan["step_s"] == pytest.approx(plan["compute_s"] + plan["bubble_s"] + sum(plan["comm_s"].values()))
    one = plans["1f1b"]
    per_micro_batch = sum(one["terms"][k] for k in ("matmul", "attention", "memory-bound", "tp comm", "cp comm",
                                                    "ep comm", "output head")) / one["micro_batches"]
    assert one["bubble_s"] == pytest.approx(7 * per_micro_batch)  # p - 1 micro-batch times
    assert plans["interleaved"]["bubble_s"] == pytest.approx(one["bubble_s"] / 2)
    assert plans["zero-bubble"]["bubble_s"] == pytest.approx(one["bubble_s"] / 3)
    assert plans["dualpipev"]["bubble_s"] < one["bubble_s"]
    # DualPipeV's V puts the first and the last chunk on rank 0: the embedding and the head (and logits) both
    v_first, v_last = plans["dualpipev"]["stages"]
    assert v_first["params"] > one["stages"][0]["params"] and v_last["params"] < one["stages"][1]["params"]
    # interleaving keeps more in flight on the first stage, and sends v times as often
    assert plans["interleaved"]["stages"][0]["memory"]["activations"] > one["stages"][0]["memory"]["activations"]
    assert plans["interleaved"]["comm_s"]["pp"] == pytest.approx(2 * one["comm_s"]["pp"])


def test_matmuls_run_at_a_measured_rate_and_mfu_and_hfu_are_both_named():
    plan = planner.plan_parallelism("llama3-8b", gpus=64, dp=64, seq=4096, global_batch=64, recompute="full")
    rate = planner.SUSTAINED[plan["device"]]["matmul"]
    assert rate < costs.peak_flops(plan["device"], "bf16")  # a measurement, not the datasheet
    n = planner.shape_params("llama3-8b")["layer_active"] * 32
    assert plan["terms"]["matmul"] == pytest.approx(2 * 4 * n * 4096 / (rate * planner.KERNEL_EFFICIENCY))
    assert plan["hfu"] > plan["mfu"] and plan["hfu"] / plan["mfu"] == pytest.approx(
        costs.hardware_flops_per_token(planner.shape_params("llama3-8b")["matmul"], 32, 4096, 4096, recompute="full")
        / costs.model_flops_per_token(planner.shape_params("llama3-8b")["matmul"], 32, 4096, 4096))
    assert "estimate" in plan["assumes"] and "upper bound" not in plan["assumes"]


def test_zero_under_a_pipeline_pays_per_micro_batch():
    # 8 B over 128 replicas, 4 stages: a micro-batch's compute is too short to hide a reduction of its gradients
    base = {"gpus": 512, "dp": 128, "tp": 1, "pp": 4, "seq": 2048, "global_batch": 128 * 8}
    one, two, three = (planner.plan_parallelism("llama3-8b", zero=z, **base) for z in (1, 2, 3))
    assert two["comm_s"]["dp"] > 4 * one["comm_s"]["dp"] and three["comm_s"]["dp"] > two["comm_s"]["dp"]
    assert any("every micro-batch" in w for w in two["warnings"]) and not one["warnings"]
    assert two["stages"][0]["memory"]["grads"] < one["stages"][0]["memory"]["grads"]


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


def test_activations_follow_korthikanti_for_a_gpt_layer():
    gpt = {"layers": 1, "d_model": 1024, "ffn": 4096, "heads": 16, "kv_heads": 16, "vocab": 10, "mlp_matrices": 2}
    h, a, s = 1024, 16, 2048
    # s b h (34 + 5 a s / h) for a GPT layer with dropout and unfused attention, no recomputation (b = 1, per token)
    assert planner.activation_bytes_per_token(gpt, recompute="none", attention="unfused", seq=s, dropout=True,
                                              sequence_parallel=False) == pytest.approx(h * (34 + 5 * a * s / h))
    # tensor parallel without sequence parallelism: 10 of the 34 stay whole on every rank (their eq. with t)
    assert planner.activation_bytes_per_token(gpt, tp=8, recompute="selective", dropout=True,
                                              sequence_parallel=False) == pytest.approx(h * (10 + 24 / 8))
    assert planner.activation_bytes_per_token(gpt, tp=8, recompute="selective", dropout=True) == pytest.approx(
        34 * h / 8)
    assert planner.activation_bytes_per_token(gpt, tp=8, recompute="full") == pytest.approx(2 * h / 8)


def test_what_torchs_implementation_keeps_is_an_option_and_megatrons_the_default():
    """A Llama 3 405B block at tp 8 with sequence parallelism, no recomputation: Megatron-LM's count is 78,336 bytes
    a token (the default). A dry run of scripts/13_gpt_3d.py counted 160,320 (benchmarks/dryrun_llama3_405b.py):
    DTensor keeps the gathered input of wq/wk/wv and w1/w3 (2 x 2h whole, where Megatron-LM keeps the norms'
    outputs, 2 x 2h / 8: +57,344), the CPU's RMSNorm its fp32 input and product (2 x 8h / 8 against the bf16 inputs'
    2 x 2h / 8: +24,576), and attention's logsumexp (4 bytes x 16 heads: 64, left out)."""
    block = dict(tp=8, recompute="none")
    assert planner.activation_bytes_per_token("llama3-405b", **block) == 78_336
    assert planner.activation_bytes_per_token("llama3-405b", sp_saves="gathered", **block) == 78_336 + 57_344
    assert planner.activation_bytes_per_token("llama3-405b", sp_saves="gathered", norm_kernel="composite",
                                              **block) == 160_320 - 64
    # without sequence parallelism the column-parallel layers' input is whole anyway: nothing to choose
    assert planner.activation_bytes_per_token("llama3-405b", sp_saves="gathered", sequence_parallel=False,
                                              **block) == planner.activation_bytes_per_token(
        "llama3-405b", sequence_parallel=False, **block)
    # Megatron-LM gathers the kept sharded inputs again in the backward, overlapped with the input-gradient matmul:
    # 2 all-gathers more a layer and micro-batch in the collectives, none in the step time
    job = dict(gpus=16384, dp=128, tp=8, pp=16, seq=8192, global_batch=2048, recompute="none")
    megatron, torch_sp = (planner.plan_parallelism("llama3-405b", sp_saves=saves, **job)
                          for saves in ("sharded", "gathered"))
    gathers = [{(c["group"], c["op"]): c["calls"] for c in p["stages"][0]["collectives"]}[("tp", "all_gather")]
               for p in (megatron, torch_sp)]
    layers, m = megatron["stages"][0]["layers"], megatron["micro_batches"]
    assert gathers == [6 * layers * m + m, 4 * layers * m + m]  # and the embedding's gradient, once a micro-batch
    assert megatron["step_s"] == torch_sp["step_s"] and megatron["peak_bytes"] < torch_sp["peak_bytes"]
    with pytest.raises(ValueError, match="sp_saves must be one of"):
        planner.plan_parallelism("llama3-405b", sp_saves="whole", **job)
    # the interface, every keyword given
    plan = planner.plan_parallelism("llama3-405b", gpus=16384, dp=128, tp=8, pp=16, cp=1, ep=1, seq=8192,
                                    global_batch=2048, micro_batch=1, zero=1, recompute="selective",
                                    system="h100-sxm", schedule="interleaved", virtual_stages=2,
                                    sequence_parallel=True)
    assert {"mfu", "hfu", "tflops_per_gpu", "step_s", "peak_bytes", "fits"} <= set(plan)
    assert plan["sp_saves"] == "sharded" and plan["norm_kernel"] == "fused" and plan["loss_parallel"]


def test_published_runs_are_reproduced_within_15_percent_with_one_set_of_constants():
    readings = {name: published.read_published(name) for name in published.PUBLISHED}
    ratios = {name: r["ratio"] for name, r in readings.items()}
    within = {name: ratio for name, ratio in ratios.items() if abs(ratio - 1) <= 0.15}
    # every Megatron-LM pipeline row of Table 1 and every Llama 3 row of Table 4; MT-NLG is the known exception
    outside = sorted(set(ratios) - set(within))
    assert outside == ["MT-NLG 530B (Smith et al. 2022)"], ratios
    mega = readings["Megatron-LM 1T (Narayanan et al. 2021)"]
    assert mega["reported"]["tflops_per_gpu"] == 163 and 0.36 < mega["reported_mfu"] < 0.42
    assert [readings[n]["reported_mfu"] for n in published.PUBLISHED if "Llama" in n] == [0.43, 0.41, 0.38]
    df = ch12.published_runs(list(readings.values()))
    assert list(df["modelled / reported"]) == [round(r, 2) for r in ratios.values()]
    with pytest.raises(ValueError, match="unknown published run"):
        published.read_published("GPT-5")


def test_the_capstones_llama_at_llama3_405bs_widths_has_the_planners_parameters():
    """scripts/13_gpt_3d.py --arch llama at Llama 3 405B's widths (built on the meta device: no memory; 4 layers of
    its 126, on 3 stages split as Llama 3 split its 16: one layer fewer on the first and the last) holds the
    planner's parameters, in all and on each stage: what benchmarks/dryrun_llama3_405b.py dry-runs is the model the
    planner counts. Llama 3's own split is [7, 8 x 14, 7]."""
    import importlib.util
    from types import SimpleNamespace

    import torch

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("gpt_3d", ROOT / "scripts" / "13_gpt_3d.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.stage_layers(126, 16, "llama3") == [7] + [8] * 14 + [7]
    s = {**planner.SHAPES["llama3-405b"], "layers": 4, "norm": "rmsnorm"}
    args = SimpleNamespace(arch="llama", context=8192, d_model=s["d_model"], heads=s["heads"], layers=s["layers"],
                           kv_heads=s["kv_heads"], ffn=s["ffn"], rope_theta=5e5)
    with torch.device("meta"):
        model = script.build_model(args, s["vocab"])
    p = planner.shape_params(s)
    assert sum(t.numel() for t in model.parameters()) == p["total"]
    assert script.stage_layers(4, 3, "llama3") == [1, 2, 1]
    parts = [sum(t.numel() for t in script.stage_part(model, stage, 3, "llama3").parameters()) for stage in range(3)]
    assert parts == [p["layer_dense"] + p["embedding"], 2 * p["layer_dense"], p["layer_dense"] + p["head"]
                     + p["final_norm"]]
    with pytest.raises(ValueError, match="must divide --kv-heads 8"):
        script.check_sizes(script.parse_args(["--arch", "llama", "--tp", "16", "--dp", "1", "--heads", "16",
                                              "--d-model", "64", "--kv-heads", "8"]), 16)
