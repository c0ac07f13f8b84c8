"""Chapter 07b's problems: model states recipe by recipe (costs.recipe_bytes_per_param), a layer's activations by
Korthikanti et al.'s count and what full recomputation keeps (memory, planner), the FLOPs recomputation adds and
FP8's modelled speed-up (costs), your run's step time under recomputation (recompute.expected_flops), and an audit
of the MFU figures of Korthikanti et al.'s abstract."""
from __future__ import annotations

from ...models import costs, memory, planner, recompute
from .base import Problem

H100 = costs.SYSTEMS["h100-sxm"]["device"]
# GPT-3 175B's shape (Brown et al. 2020, Table 2.1: 96 layers, d_model 12,288, 96 heads), as planner.shape_params
# reads a shape; the vocabulary plays no part in the problems below.
GPT3 = {"layers": 96, "d_model": 12288, "ffn": 4 * 12288, "heads": 96, "kv_heads": 96, "vocab": 50257,
        "mlp_matrices": 2}
# chapter 07b's section 2 model: chapter 09's nanoGPT, ACT_LAYERS 4, ACT_WIDTH 64, ACT_HEADS 4, a 65-token vocabulary
CH07B_GPT = {"layers": 4, "d_model": 64, "ffn": 256, "heads": 4, "kv_heads": 4, "vocab": 65, "mlp_matrices": 2}
KORTHIKANTI = ("Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models, arXiv 2205.05198, "
               "abstract: a 530B GPT-3 style model on 2,240 A100 GPUs, 54.2 % MFU with selective recomputation, "
               "42.1 % with full recomputation; its per-layer count s b h (34 + 5 a s / h), section 4.1")


def _recipe(params_b, recipe):
    per = costs.recipe_bytes_per_param(recipe, "adamw")
    mixed = costs.recipe_bytes_per_param("mixed", "adamw")
    return {"answer": params_b * 1e9 * per["total"], "per": per["total"], "params": per["parameters"],
            "grads": per["gradients"], "master": per["master weights"], "states": per["optimizer states"],
            "mixed": params_b * 1e9 * mixed["total"]}


def _layer_activations(seq, batch, hidden, heads):
    total = memory.transformer_layer_activation_bytes(seq, batch, hidden, heads)
    sbh = seq * batch * hidden
    return {"answer": total, "sbh_M": sbh / 1e6, "scores": 5 * heads * seq / hidden, "linear": 34 * sbh}


def _full_recompute(seq, batch):
    shape = planner.shape_of(GPT3)
    kept = planner.activation_bytes_per_token(GPT3, recompute="full") * seq * batch * shape["layers"]
    none = memory.transformer_layer_activation_bytes(seq, batch, shape["d_model"], shape["heads"]) * shape["layers"]
    return {"answer": kept, "none_GB": none / 1e9, "ratio": none / kept, "layers": shape["layers"],
            "per_layer_MB": kept / shape["layers"] / 1e6, "none": none}


def _recompute_flops(model, seq, recompute):
    shape, p = planner.shape_of(model), planner.shape_params(model)
    args = (p["matmul"], shape["layers"], shape["d_model"], seq)
    hardware = costs.hardware_flops_per_token(*args, recompute=recompute)
    plain = costs.model_flops_per_token(*args)
    return {"answer": hardware / plain - 1, "hardware_G": hardware / 1e9, "model_G": plain / 1e9,
            "selective": costs.hardware_flops_per_token(*args, recompute="selective") / plain - 1}


def _fp8(gemm_pct):
    return {"answer": costs.low_precision_speedup(gemm_pct / 100, H100),
            "ratio": costs.peak_flops(H100, "fp8") / costs.peak_flops(H100, "bf16"),
            "rest": 1 - gemm_pct / 100, "gemm": gemm_pct / 100}


def _your_recompute(none_ms, seq, batch, layers, width):
    shape = {**CH07B_GPT, "layers": layers, "d_model": width, "ffn": 4 * width}  # the chapter's GPT, as it ran
    p = planner.shape_params(shape)
    sizes = dict(batch=batch, layers=layers, width=width, matmul_params=p["matmul"],
                 block_matmul_params=layers * p["layer_dense"])
    flops = {mode: recompute.expected_flops(seq, mode, **sizes) for mode in ("none", "full")}
    ratio = flops["full"] / flops["none"]
    return {"answer": none_ms / 1e3 * ratio, "none_G": flops["none"] / 1e9, "full_G": flops["full"] / 1e9,
            "ratio": ratio, "four_thirds": none_ms / 1e3 * 4 / 3}


def _korthikanti(model, seq, mfu_full_pct, mfu_selective_pct):
    shape, p = planner.shape_of(model), planner.shape_params(model)
    args = (p["matmul"], shape["layers"], shape["d_model"], seq)
    plain = costs.model_flops_per_token(*args)
    full = costs.hardware_flops_per_token(*args, recompute="full") / plain
    selective = costs.hardware_flops_per_token(*args, recompute="selective") / plain
    return {"answer": mfu_full_pct / 100 * full, "full": full, "sel": selective,
            "hfu_sel": mfu_selective_pct / 100 * selective, "as_mfu": mfu_full_pct / 100,
            "params_B": p["total"] / 1e9}


PROBLEMS = [
    Problem(
        "07b.bf16-states",
        "A {params_b} B-parameter model trained with AdamW in the \"{recipe}\" recipe (parameters, gradients and "
        "Adam's states all in bf16, no fp32 master copy). How many GB of model states?",
        inputs={"params_b": 7.0, "recipe": "bf16"}, work=_recipe, unit="GB", scale=1e9, digits=0,
        hint="all-bf16 keeps 2 bytes each for the parameter, its gradient and Adam's m and v, and no master: 2 + 2 + "
             "(2 + 2) = 8 bytes a parameter, half of mixed precision's 16.",
        traps={"mixed": "That is mixed precision's 16 bytes a parameter (bf16 weights, fp32 master and states)."},
        solution="{params} + {grads} + {master} + {states} = {per} bytes a parameter; x {params_b} B = {answer}."),
    Problem(
        "07b.layer-activations",
        "One GPT-3-sized layer (hidden {hidden:,}, {heads} heads), sequence {seq:,}, micro-batch {batch}, 16-bit with "
        "dropout, no recomputation and no tensor parallelism: how many GB of activations does it keep for backward, "
        "by Korthikanti et al.'s count?",
        inputs={"seq": 2048, "batch": 1, "hidden": 12288, "heads": 96}, work=_layer_activations, unit="GB", scale=1e9,
        digits=2, source=KORTHIKANTI,
        hint="s b h (34 + 5 a s / h) bytes: the 5 a s / h term is attention's s x s scores (softmax output, dropout "
             "mask and output, a per head), and here it is larger than the 34.",
        traps={"linear": "That is the 34 s b h alone: attention's 5 a s^2 b scores are left out."},
        solution="s b h = {sbh_M:.2f} M; 5 a s / h = {scores:.0f}; {sbh_M:.2f} M x (34 + {scores:.0f}) bytes = "
                 "{answer}."),
    Problem(
        "07b.full-recompute-kept",
        "GPT-3 175B (96 layers, hidden 12,288), sequence {seq:,}, micro-batch {batch}, 16-bit, every layer fully "
        "recomputed: how many GB of activations do the 96 layers keep between forward and backward (no tensor "
        "parallelism)?",
        inputs={"seq": 2048, "batch": 1}, work=_full_recompute, unit="GB", scale=1e9, digits=2, level="combine",
        source=KORTHIKANTI,
        hint="a fully checkpointed layer keeps only its input, s b h values of 2 bytes, and recomputes the rest in "
             "backward; compare the layer's s b h (34 + 5 a s / h) without it.",
        traps={"none": "That is without recomputation, Korthikanti's full count in every layer."},
        solution="{per_layer_MB:.1f} MB a layer x {layers} = {answer} (without recomputation {none_GB:.0f} GB, "
                 "{ratio:.0f} x more)."),
    Problem(
        "07b.recompute-flops",
        "{model} at sequence {seq:,} with {recompute} recomputation: how many more FLOPs per token does the hardware "
        "run than the model's 6N + 12LdT?",
        inputs={"model": "llama3-8b", "seq": 8192, "recompute": "full"}, work=_recompute_flops, unit="%", scale=0.01,
        digits=1,
        hint="full recomputation runs every layer's forward again: + 2N + 4LdT a token, about a third of the model's "
             "FLOPs (forward is a third of forward + backward).",
        traps={"selective": "That is selective recomputation (attention's core only, + 4LdT)."},
        solution="hardware {hardware_G:.2f} GFLOP a token against the model's {model_G:.2f}: {answer} more."),
    Problem(
        "07b.fp8-speedup",
        "On an H100 SXM, {gemm_pct} % of a bf16 step's time is matrix products. Moving them to FP8 (and nothing "
        "else), what step-time speed-up does costs.low_precision_speedup give at most?",
        inputs={"gemm_pct": 70}, work=_fp8, unit="x", digits=2, source=costs.PEAK_DENSE_TFLOPS[H100].source,
        hint="Amdahl's law: only the GEMMs' share gets faster, by FP8's peak over bf16's; the rest of the step "
             "stays as it was.",
        traps={"ratio": "That is the peak ratio, as if the whole step were matrix products."},
        solution="1 / ({rest:.2f} + {gemm:.2f} / {ratio:g}) = {answer}."),
    Problem(
        "07b.your-recompute-time",
        "Your chapter 07b run: its {layers}-layer GPT of width {width}, batch {batch}, at s = {seq}: one forward + "
        "backward with no recomputation took {none_ms} ms (median). If time followed the FLOPs counted, how long "
        "would the step with full recomputation take?",
        inputs={"none_ms": 30.0, "seq": 256, "batch": 4, "layers": 4, "width": 64},
        own=("none_ms", "seq", "batch", "layers", "width"), work=_your_recompute,
        unit="ms", scale=1e-3, digits=1, level="your run",
        hint="full recomputation reruns each block's forward (less its last projection, and not the head or "
             "embeddings): scale your time by the FLOPs ratio recompute.expected_flops gives, not by 4/3.",
        traps={"four_thirds": "That is 4/3: the head and embeddings are not recomputed, nor the MLP's last "
                              "projection, so this model's ratio is smaller."},
        solution="FLOPs: {none_G:.3f} G without, {full_G:.3f} G with full recomputation (x {ratio:.3f}); {none_ms} ms "
                 "x {ratio:.3f} = {answer}."),
    Problem(
        "07b.audit-korthikanti-hfu",
        "Audit: Korthikanti et al. train a 530B GPT ({model}, sequence {seq:,}) at {mfu_full_pct} % MFU with full "
        "recomputation and {mfu_selective_pct} % with selective. By the course's FLOP counts, what hardware FLOPs "
        "utilisation (HFU) did the full-recomputation run reach?",
        inputs={"model": "megatron-530b", "seq": 2048, "mfu_full_pct": 42.1, "mfu_selective_pct": 54.2},
        work=_korthikanti, unit="%", scale=0.01, digits=1, level="audit", source=KORTHIKANTI,
        hint="HFU = MFU x hardware FLOPs / model FLOPs: full recomputation adds 2N + 4LdT to 6N + 12LdT a token.",
        traps={"as_mfu": "That is the MFU as reported: HFU counts the recomputed forward too."},
        solution="hardware / model FLOPs: x {full:.3f} with full recomputation, x {sel:.3f} with selective; HFU "
                 "{mfu_full_pct} % x {full:.3f} = {answer}, against selective's {hfu_sel:.1%}: the GPUs were as "
                 "busy, the speed-up is the recomputation left out."),
]
