"""Published training runs, read against the planner's estimate (chapter 12).

Each row holds what its paper reports and the plan that reproduces the paper's layout. Only "reported" and the
layout are the paper's; every figure `read_published` derives from the plan is the course's model, with one set of
constants for every row (planner.SUSTAINED and the links of costs.SYSTEMS: no per-run factor). Where a paper is
silent on a setting the plan needs (micro-batch size, chunks per rank), the row says "assumed" and why.

Throughput is compared the paper's way: Llama 3 reports model FLOPs (6 N + 12 L d T, PaLM's convention, which
counts attention over every key although a causal kernel computes half); Megatron-LM and MT-NLG count hardware FLOPs
with their equation 3, the recomputed forward included.
"""
from __future__ import annotations

from . import costs
from .planner import plan_parallelism, shape_of, shape_params

_MEGATRON = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
             "SC21, arXiv 2104.04473: Table 1; section 5.1 (interleaved schedule, scatter/gather, full "
             "activation recomputation, sequence 2,048, vocabulary 51,200)")
_LLAMA = ("Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783: section 3.3.2 and Table 4 (BF16 MFU "
          "against 989 TFLOP/s; 16M tokens a batch; FSDP-style data parallelism, interleaved pipeline)")
_MEGATRON_ASSUMED = ("micro-batch 1 and 2 chunks a rank where the stage's layers split evenly (the paper does not "
                     "give them per row); unfused attention, no sequence parallelism (2021)")


def _megatron(model, gpus, pp, batch, tflops):
    layers = shape_of(model)["layers"] // pp
    v = 2 if layers % 2 == 0 else (3 if layers % 3 == 0 else 1)
    plan = {"model": model, "gpus": gpus, "dp": gpus // (8 * pp), "tp": 8, "pp": pp, "seq": 2048,
            "global_batch": batch, "system": "a100-sxm", "recompute": "full", "attention": "unfused",
            "sequence_parallel": False, "dropout": True, "zero": 0,
            **({"schedule": "interleaved", "virtual_stages": v} if v > 1 else {})}
    return {"source": _MEGATRON, "plan": plan, "counted": "megatron", "assumed": _MEGATRON_ASSUMED,
            "reported": {"tflops_per_gpu": tflops, "text": f"{tflops} TFLOP/s a GPU (their eq. 3)"}}


def _llama(gpus, dp, cp, seq, tflops, mfu):
    """A row of Llama 3's Table 4: tp 8, pp 16, 16M tokens a batch."""
    plan = {"model": "llama3-405b", "gpus": gpus, "dp": dp, "tp": 8, "pp": 16, "cp": cp, "seq": seq,
            "global_batch": 16 * 2 ** 20 // seq, "system": "h100-sxm", "schedule": "interleaved",
            "virtual_stages": 4, "recompute": "none", "zero": 1}
    return {"source": f"{_LLAMA}: tp 8, cp {cp}, pp 16, dp {dp}, {seq:,} tokens, {tflops} TFLOP/s, {mfu:.0%}",
            "plan": plan, "counted": "model",
            "assumed": "micro-batch 1; 4 chunks a rank (the paper gives no number); no recomputation",
            "reported": {"tflops_per_gpu": tflops, "mfu": mfu,
                         "text": f"{tflops} TFLOP/s a GPU, {mfu:.0%} BF16 MFU"}}


PUBLISHED = {
    "Megatron-LM 39B (Narayanan et al. 2021)": _megatron("megatron-39b", 512, 2, 1536, 138),
    "Megatron-LM 76B (Narayanan et al. 2021)": _megatron("megatron-76b", 1024, 4, 1792, 140),
    "Megatron-LM 146B (Narayanan et al. 2021)": _megatron("megatron-146b", 1536, 8, 2304, 148),
    "Megatron-LM 310B (Narayanan et al. 2021)": _megatron("megatron-310b", 1920, 16, 2160, 155),
    "Megatron-LM 530B (Narayanan et al. 2021)": _megatron("megatron-530b", 2520, 35, 2520, 163),
    "Megatron-LM 1T (Narayanan et al. 2021)": _megatron("megatron-1t", 3072, 64, 3072, 163),
    "MT-NLG 530B (Smith et al. 2022)": {
        "source": "Smith et al., Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, arXiv 2201.11990: "
                  "section 2.3 (tp 8 x pp 35, 280 DGX A100 nodes, batch 1,920, sequence 2,048, 126 TFLOP/s a GPU)",
        "plan": {"model": "megatron-530b", "gpus": 2240, "dp": 8, "tp": 8, "pp": 35, "seq": 2048,
                 "global_batch": 1920, "system": "a100-sxm", "recompute": "full", "attention": "unfused",
                 "sequence_parallel": False, "dropout": True, "zero": 1},
        "counted": "megatron", "assumed": "micro-batch 1, 1F1B (DeepSpeed's pipeline engine), ZeRO-1",
        "reported": {"tflops_per_gpu": 126, "text": "126 TFLOP/s a GPU"},
    },
    "Llama 3 405B, 8K, 8,192 GPUs (Grattafiori et al. 2024)": _llama(8192, 64, 1, 8192, 430, 0.43),
    "Llama 3 405B, 8K, 16,384 GPUs (Grattafiori et al. 2024)": _llama(16384, 128, 1, 8192, 400, 0.41),
    "Llama 3 405B, 128K, 16,384 GPUs (Grattafiori et al. 2024)": _llama(16384, 8, 16, 131072, 380, 0.38),
}


def megatron_flops_per_iteration(batch, seq, layers, hidden, vocab):
    """Narayanan et al. 2021's FLOPs per iteration (their equation 3): 96 B s l h^2 (1 + s / 6h + V / 16 l h).

    It counts activation recomputation (a second forward: 4 passes instead of 3), so the paper's "share of peak"
    is a hardware utilisation; model_flops_per_token's 6 N + 12 L d T gives the model FLOPs utilisation (MFU)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def read_published(name) -> dict:
    """One PUBLISHED run: what the paper reports next to the planner's estimate of the same layout. Returns
    {"name", "source", "assumed", "reported", "plan" (plan_parallelism's result), "modelled_tflops" (the estimate,
    counted the paper's way), "ratio" (modelled / reported), "reported_mfu" (the paper's throughput as MFU by
    6 N + 12 L d T over the dense peak)}."""
    if name not in PUBLISHED:
        raise ValueError(f"unknown published run {name!r}: one of {', '.join(PUBLISHED)}")
    entry = PUBLISHED[name]
    spec = dict(entry["plan"])
    plan = plan_parallelism(spec.pop("model"), **spec)
    shape = shape_of(entry["plan"]["model"])
    peak = costs.peak_flops(plan["device"], "bf16")
    per_token = costs.model_flops_per_token(shape_params(shape)["matmul"], shape["layers"], shape["d_model"],
                                            plan["seq"])
    tokens = plan["global_batch"] * plan["seq"]
    reported = entry["reported"]["tflops_per_gpu"] * 1e12
    if entry["counted"] == "megatron":
        per_iteration = megatron_flops_per_iteration(plan["global_batch"], plan["seq"], shape["layers"],
                                                     shape["d_model"], shape["vocab"]) / plan["gpus"]
        modelled = per_iteration / plan["step_s"]
        reported_mfu = reported / per_iteration * tokens / plan["gpus"] * per_token / peak
    else:
        modelled = plan["tflops_per_gpu"] * 1e12
        reported_mfu = entry["reported"].get("mfu", reported / peak)
    return {"name": name, "source": entry["source"], "assumed": entry["assumed"], "reported": entry["reported"],
            "plan": plan, "modelled_tflops": modelled / 1e12, "ratio": modelled / reported,
            "reported_mfu": reported_mfu}
