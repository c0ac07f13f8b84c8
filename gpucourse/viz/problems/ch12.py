"""Chapter 12's problems: the planner's memory per GPU, the interleaved bubble, MFU against HFU, published runs'
TFLOP/s (planner, published, costs), and audits of MFU figures computed the wrong way."""
from __future__ import annotations

from ...models import costs, planner, published
from .base import Problem

H100 = costs.SYSTEMS["h100-sxm"]["device"]
A100 = costs.SYSTEMS["a100-sxm"]["device"]
LLAMA_16K = "Llama 3 405B, 8K, 16,384 GPUs (Grattafiori et al. 2024)"
MEGATRON_1T = "Megatron-LM 1T (Narayanan et al. 2021)"
LLAMA_PLAN = published.PUBLISHED[LLAMA_16K]["plan"]


def _flops_per_token(model, seq, recompute=None):
    """Model FLOPs a token (6N + 12LdT), or with recompute= the hardware's (what recomputation runs again)."""
    shape, params = planner.shape_of(model), planner.shape_params(model)
    if recompute is None:
        return costs.model_flops_per_token(params["matmul"], shape["layers"], shape["d_model"], seq)
    return costs.hardware_flops_per_token(params["matmul"], shape["layers"], shape["d_model"], seq,
                                          recompute=recompute)


def _zero1(model, dp):
    total = planner.shape_params(model)["total"]
    b = planner.BYTES
    return {"answer": costs.zero_memory_bytes(total, dp, 1, param_bytes=b["param"], grad_bytes=b["grad"],
                                              optimizer_bytes=b["optimizer"]),
            "bf16_grads": costs.zero_memory_bytes(total, dp, 1), "total_B": total / 1e9,
            "replicated": b["param"] + b["grad"], "optimizer": b["optimizer"]}


def _first_stage(model, gpus, dp, tp, pp):
    plan = planner.plan_parallelism(model, gpus=gpus, dp=dp, tp=tp, pp=pp, zero=1)
    first = plan["stages"][0]
    params = planner.shape_params(model)
    states = sum(first["memory"][k] for k in ("params", "grads", "optimizer"))
    return {"answer": states, "layers": first["layers"], "held_B": first["params"] / 1e9,
            "layer_M": params["layer_dense"] / 1e6, "embedding_M": params["embedding"] / 1e6,
            "per_param": planner.BYTES["param"] + planner.BYTES["grad"] + planner.BYTES["optimizer"] / dp,
            "unsharded": first["params"] * sum(planner.BYTES.values())}


def _interleaved(pp, v, global_batch, dp):
    m = global_batch // dp
    slots = planner.bubble_slots("interleaved", pp, v)
    return {"answer": costs.pipeline_bubble_fraction(pp, m, v), "m": m, "slots": slots, "total": m + slots,
            "plain": costs.pipeline_bubble_fraction(pp, m)}


def _utilisation(model, seq, tokens_per_s, system, recompute):
    device = costs.SYSTEMS[system]["device"]
    achieved = tokens_per_s * _flops_per_token(model, seq)
    executed = tokens_per_s * _flops_per_token(model, seq, recompute)
    return {"mfu": costs.mfu(achieved, device), "answer": costs.hfu(executed, device),
            "model_G": _flops_per_token(model, seq) / 1e9,
            "hardware_G": _flops_per_token(model, seq, recompute) / 1e9,
            "peak_T": costs.peak_flops(device) / 1e12}


def _mfu(model, seq, tokens_per_s, system):
    out = _utilisation(model, seq, tokens_per_s, system, "full")
    return {**out, "answer": out["mfu"], "hfu": out["answer"]}


def _published_step(model, tflops, batch, seq, gpus):
    per_token = _flops_per_token(model, seq)
    return {"answer": batch * seq * per_token / (gpus * tflops * 1e12), "tokens_M": batch * seq / 1e6,
            "per_token_T": per_token / 1e12}


def _megatron_mfu(run):
    reading = published.read_published(run)
    plan = published.PUBLISHED[run]["plan"]
    shape = planner.shape_of(plan["model"])
    tokens = plan["global_batch"] * plan["seq"]
    eq3 = published.megatron_flops_per_iteration(plan["global_batch"], plan["seq"], shape["layers"],
                                                 shape["d_model"], shape["vocab"]) / tokens
    model = _flops_per_token(plan["model"], plan["seq"])
    reported = reading["reported"]["tflops_per_gpu"] * 1e12
    return {"answer": reading["reported_mfu"], "eq3_T": eq3 / 1e12, "model_T": model / 1e12, "ratio": model / eq3,
            "peak_T": costs.peak_flops(A100) / 1e12, "as_reported": reported / costs.peak_flops(A100)}


def _max_context(model, max_seq, seq):
    right, wrong = _flops_per_token(model, seq), _flops_per_token(model, max_seq)
    return {"answer": wrong / right - 1, "right_G": right / 1e9, "wrong_G": wrong / 1e9}


def _sparse_peak(tflops_per_gpu, sparse_tflops):
    return {"answer": costs.mfu(tflops_per_gpu * 1e12, H100), "shown": tflops_per_gpu / sparse_tflops,
            "dense_T": costs.peak_flops(H100) / 1e12}


PROBLEMS = [
    Problem(
        "12.zero1-fp32-grads",
        "{model} on {dp} data-parallel GPUs (no tp or pp), ZeRO-1 with the planner's bytes: bf16 weights, fp32 "
        "gradients, fp32 master weights and Adam's two moments. Model states per GPU, in GB?",
        inputs={"model": "llama3-8b", "dp": 64}, work=_zero1, unit="GB", scale=1e9, digits=1,
        hint="the gradients are fp32 here (4 bytes, as Megatron-LM and Llama 3 reduce them), and ZeRO-1 does not "
             "shard them: 2 + 4 bytes stay on every GPU, only the 12 optimizer bytes are divided by dp.",
        traps={"bf16_grads": "That counted 2-byte gradients (the ZeRO paper's fp16): the planner keeps fp32 ones."},
        solution="{total_B:.2f} B parameters x ({replicated} + {optimizer}/{dp}) bytes = {answer}."),
    Problem(
        "12.first-stage-states",
        "{model} on {gpus} GPUs, tp {tp} x pp {pp} x dp {dp}, ZeRO-1 (fp32 gradients). The first pipeline stage "
        "also holds the embedding. Its model states per GPU, in GiB?",
        inputs={"model": "llama3-70b", "gpus": 1024, "dp": 32, "tp": 8, "pp": 4}, work=_first_stage, unit="GiB",
        scale=2 ** 30, digits=2, level="combine",
        hint="first the parameters a GPU holds: its stage's layers and the embedding, divided by tp; then the bytes "
             "a parameter, 2 + 4 + 12/dp under ZeRO-1 (the optimizer shards over dp, not over tp or pp).",
        traps={"unsharded": "That kept the whole optimizer on every GPU: ZeRO-1 divides its 12 bytes by dp."},
        solution="{layers} layers x {layer_M:.1f} M + the embedding {embedding_M:.1f} M, over tp: {held_B:.3f} B "
                 "parameters; x {per_param:.3f} bytes = {answer}."),
    Problem(
        "12.interleaved-bubble",
        "{run}: pp {pp} with {v} chunks a rank (interleaved), {global_batch:,} sequences a step over dp {dp}, "
        "micro-batch 1. Which share of the step is the pipeline bubble?",
        inputs={"run": LLAMA_16K, "pp": LLAMA_PLAN["pp"], "v": LLAMA_PLAN["virtual_stages"],
                "global_batch": LLAMA_PLAN["global_batch"], "dp": LLAMA_PLAN["dp"]},
        work=lambda run, **given: _interleaved(**given), unit="%", scale=0.01,
        digits=1, source=published.PUBLISHED[LLAMA_16K]["source"],
        hint="the micro-batches a step are per replica: global batch / dp, not the global batch; then the bubble "
             "is (p-1)/v micro-batch times out of m + (p-1)/v.",
        traps={"plain": "That is plain 1F1B's bubble: interleaving with v chunks divides the p-1 slots by v."},
        solution="m = {global_batch} / {dp} = {m}; bubble (p-1)/v = {slots:.2f} micro-batch times of {total:.2f}: "
                 "{answer} (1F1B: {plain:.1%})."),
    Problem(
        "12.mfu",
        "A {model} run at sequence {seq} on H100 SXM GPUs ({system}) processes {tokens_per_s} tokens a second per GPU "
        "with full activation recomputation. What is its MFU (bf16, 6N + 12LdT)?",
        inputs={"model": "llama3-70b", "seq": 4096, "tokens_per_s": 900, "system": "h100-sxm"}, work=_mfu,
        unit="%", scale=0.01, digits=1, source=costs.PEAK_DENSE_TFLOPS[H100].source,
        hint="model FLOPs a token are 6N + 12 L d T with N the weights in matrix products (not the embedding); "
             "recomputation is not model work; and the peak is the dense one, half the datasheet's starred figure.",
        traps={"hfu": "That counted the recomputed forward: that is HFU."},
        solution="6N + 12LdT = {model_G:.1f} GFLOP a token; x {tokens_per_s} / {peak_T:.1f} TFLOP/s = {answer} "
                 "(HFU {hfu:.1%})."),
    Problem(
        "12.hfu",
        "The same {model} run ({tokens_per_s} tokens/s a GPU, sequence {seq}, full recomputation, {system}): what is "
        "its HFU?",
        inputs={"model": "llama3-70b", "seq": 4096, "tokens_per_s": 900, "system": "h100-sxm", "recompute": "full"},
        work=_utilisation, unit="%", scale=0.01, digits=1, level="combine",
        source=costs.PEAK_DENSE_TFLOPS[H100].source,
        hint="full recomputation runs every layer's forward twice: add 2N + 4LdT a token to the model's 6N + 12LdT.",
        traps={"mfu": "That is the MFU: HFU counts the recomputed forward too."},
        solution="hardware FLOPs a token: {model_G:.1f} G + the forward again = {hardware_G:.1f} G; x "
                 "{tokens_per_s} / {peak_T:.1f} TFLOP/s = {answer} (MFU {mfu:.1%})."),
    Problem(
        "12.published-step",
        "{run} reports {tflops} TFLOP/s a GPU (model FLOPs, 6N + 12LdT). With its batch of {batch:,} sequences of "
        "{seq:,} tokens ({model}), how long is a step?",
        inputs={"run": LLAMA_16K, "tflops": published.PUBLISHED[LLAMA_16K]["reported"]["tflops_per_gpu"],
                **{k: LLAMA_PLAN[v] for k, v in (("model", "model"), ("batch", "global_batch"), ("seq", "seq"),
                                                 ("gpus", "gpus"))}},
        work=lambda run, **given: _published_step(**given), unit="s", digits=2, level="combine",
        source=published.PUBLISHED[LLAMA_16K]["source"],
        hint="the FLOPs of a step are tokens x (6N + 12LdT), shared by every GPU: divide by GPUs x TFLOP/s.",
        solution="{tokens_M:.2f} M tokens x {per_token_T:.3f} TFLOP a token / ({gpus:,} GPUs x {tflops} TFLOP/s) "
                 "= {answer}."),
    Problem(
        "12.megatron-mfu",
        "{run} reports {tflops} TFLOP/s a GPU on A100s, counted with its equation 3 (which includes the recomputed "
        "forward). What is that as MFU (6N + 12LdT over the dense bf16 peak)?",
        inputs={"run": MEGATRON_1T, "tflops": published.PUBLISHED[MEGATRON_1T]["reported"]["tflops_per_gpu"]},
        work=lambda run, tflops: _megatron_mfu(run), unit="%", scale=0.01, digits=1, level="combine",
        source=published.PUBLISHED[MEGATRON_1T]["source"],
        hint="the paper's FLOPs are hardware FLOPs (4 passes with full recomputation): convert its TFLOP/s to model "
             "FLOPs by the ratio of 6N + 12LdT to its equation 3 per token, then divide by the peak.",
        traps={"as_reported": "That divided the paper's hardware TFLOP/s by the peak: an HFU, not the MFU."},
        solution="equation 3: {eq3_T:.2f} TFLOP a token; 6N + 12LdT: {model_T:.2f} (x {ratio:.3f}); {tflops} x "
                 "{ratio:.3f} / {peak_T:.0f} TFLOP/s = {answer}."),
    Problem(
        "12.audit-max-context",
        "Audit: a training script computes MFU with 12 L d T at its config's maximum context, {max_seq} tokens, while "
        "it trains {model} on {seq}-token sequences. By how much is its MFU too high?",
        inputs={"model": "gpt-1.3b", "max_seq": 2048, "seq": 1024}, work=_max_context, unit="%", scale=0.01,
        digits=1, level="audit",
        hint="only the attention term depends on T: the error is 12 L d (T_max - T) over 6N + 12 L d T, small when "
             "6N dominates.",
        solution="at {seq}: {right_G:.3f} GFLOP a token; at {max_seq}: {wrong_G:.3f}; {answer} too high."),
    Problem(
        "12.audit-sparse-peak",
        "Audit: a report divides its {tflops_per_gpu} TFLOP/s a GPU (model FLOPs, bf16, H100 SXM) by "
        "{sparse_tflops:,.0f} TFLOP/s, the datasheet's starred BF16 figure, and prints the quotient as MFU. What is "
        "the MFU against the dense peak?",
        inputs={"tflops_per_gpu": 400, "sparse_tflops": costs.peak_flops(H100) * 2 / 1e12}, work=_sparse_peak,
        unit="%", scale=0.01, digits=1, level="audit", source=costs.PEAK_DENSE_TFLOPS[H100].source,
        hint="the starred figures are 'with sparsity', twice the dense rate that dense training can reach.",
        traps={"shown": "That is the report's figure, against the sparse peak."},
        solution="dense bf16 peak {dense_T:.1f} TFLOP/s; {tflops_per_gpu} / {dense_T:.1f} = {answer} (the report: "
                 "{shown:.1%})."),
]
