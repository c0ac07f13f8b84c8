"""Chapter 09's problems: the 2-D mesh's model FLOPs per token and MFU (costs), the blocks' model states per rank
under tensor parallelism and FSDP (planner.shape_params), the tensor-parallel all-reduces of a step, and an audit
of PaLM's 46.2 % MFU."""
from __future__ import annotations

from ...models import costs, planner
from .base import Problem

H100 = costs.SYSTEMS["h100-sxm"]["device"]
PALM = ("Chowdhery et al., PaLM: Scaling Language Modeling with Pathways, arXiv 2204.02311: 540.35 B parameters, "
        "118 layers, 48 heads of 256, sequence 2,048 (table 1), 238.3 K tokens/s on 6,144 TPU v4 chips, 46.2 % MFU "
        "(table 3, appendix B); TPU v4: 275 TFLOP/s bf16 a chip")


def _gpt(layers, d_model, heads, context, vocab):
    """Chapter 09's GPT (nanoGPT: LayerNorms, biases, learned positions, 4 d MLP, the head a Linear) as a shape."""
    return {"layers": layers, "d_model": d_model, "ffn": 4 * d_model, "heads": heads, "kv_heads": heads,
            "vocab": vocab, "mlp_matrices": 2, "norm": "layernorm", "biases": True, "positions": context}


def _per_token(layers, d_model, heads, context, vocab):
    p = planner.shape_params(_gpt(layers, d_model, heads, context, vocab))
    n = p["matmul"]
    return {"answer": costs.model_flops_per_token(n, layers, d_model, context), "N_M": n / 1e6,
            "six_n": 6 * n, "attention": 12 * layers * d_model * context,
            "causal": costs.model_flops_per_token(n, layers, d_model, context, causal=True)}


def _mfu(layers, d_model, heads, context, vocab, tokens_per_s, gpus):
    flops = _per_token(layers, d_model, heads, context, vocab)["answer"]
    return {"answer": costs.mfu(tokens_per_s * flops, H100, n_devices=gpus), "flops_M": flops / 1e6,
            "peak_T": costs.peak_flops(H100) / 1e12, "one_gpu": costs.mfu(tokens_per_s * flops, H100)}


def _block_states(layers, d_model, heads, context, vocab, dp, tp):
    p = planner.shape_params(_gpt(layers, d_model, heads, context, vocab))
    per_bytes = costs.recipe_bytes_per_param("fp32", "adamw")["total"]
    held = layers * (p["layer_split"] / tp + p["layer_whole"])
    return {"answer": held / dp * per_bytes, "held_M": held / 1e6, "per_rank_M": held / dp / 1e6,
            "per_bytes": per_bytes, "split_M": p["layer_split"] / 1e6, "whole_k": p["layer_whole"] / 1e3,
            "even": layers * p["layer_dense"] / (dp * tp) * per_bytes, "no_fsdp": held * per_bytes}


def _tp_bytes(layers, d_model, context, batch, dp, tp):
    size = batch // dp * context * d_model * 4  # fp32 activations of the dp group's rows
    once = costs.bytes_moved_per_rank("all_reduce", size, tp)
    return {"answer": 6 * layers * once, "size_MB": size / 1e6, "once_MB": once / 1e6, "calls": 6 * layers,
            "fused": 4 * layers * once, "rows": batch // dp}


def _palm(params_b, layers, heads, head_dim, seq, tokens_per_s, chips, peak_tflops, d_model):
    n, peak = params_b * 1e9, peak_tflops * 1e12
    achieved = lambda per_token: costs.mfu(per_token * tokens_per_s, n_devices=chips, peak=peak)  # noqa: E731
    return {"answer": achieved(costs.model_flops_per_token(n, layers, heads * head_dim, seq)),
            "flops_T": costs.model_flops_per_token(n, layers, heads * head_dim, seq) / 1e12,
            "six_n": achieved(6 * n), "width_d_model": achieved(costs.model_flops_per_token(n, layers, d_model, seq)),
            "causal": achieved(costs.model_flops_per_token(n, layers, heads * head_dim, seq, causal=True)),
            "width": heads * head_dim}


GPT2_SMALL = {"layers": 12, "d_model": 768, "heads": 12, "context": 1024, "vocab": 65}

PROBLEMS = [
    Problem(
        "09.flops-per-token",
        "Chapter 09's GPT at GPT-2 small's sizes ({layers} layers, d_model {d_model}, {heads} heads, context "
        "{context:,}) with its {vocab}-character vocabulary: model FLOPs per trained token, 6N + 12 L d T, in MFLOP?",
        inputs=dict(GPT2_SMALL), work=_per_token, unit="MFLOP", scale=1e6, digits=0,
        hint="N is the weights of the matrix products: each block's 12 d^2 (q, k, v, out, and the 4d MLP) and the "
             "head, not the embeddings; attention adds 12 L d T at PaLM's convention (every key, causal or not).",
        traps={"six_n": "That is 6N alone: attention's 12 L d T is left out.",
               "causal": "That counted the causal half of attention: published MFUs use all T keys."},
        solution="N = {N_M:.2f} M weights in matrix products: 6N = {six_n:,.0f}; 12 L d T = {attention:,}; "
                 "{answer} a token."),
    Problem(
        "09.your-mfu",
        "Your chapter 09 run on GPUs, the GPT-2-small-sized model of above on {gpus} H100 SXM GPUs (bf16): the job "
        "trained {tokens_per_s:,} tokens a second in all. What MFU is that?",
        inputs={**GPT2_SMALL, "tokens_per_s": 400_000, "gpus": 8}, own=("tokens_per_s", "gpus", "vocab"),
        work=_mfu, unit="%", scale=0.01, digits=2, level="your run", source=costs.PEAK_DENSE_TFLOPS[H100].source,
        hint="the achieved model FLOP/s (tokens/s x 6N + 12LdT) over the peak of every GPU: GPUs x the dense bf16 "
             "peak.",
        traps={"one_gpu": "That divided by one GPU's peak: the tokens are the whole job's."},
        solution="{tokens_per_s:,} x {flops_M:.0f} MFLOP / ({gpus} x {peak_T:.1f} TFLOP/s) = {answer}."),
    Problem(
        "09.block-states",
        "The same GPT's blocks on a dp {dp} x tp {tp} mesh, FSDP over dp, fp32 AdamW (16 bytes a parameter). How many "
        "MB of model states do the blocks leave on each rank?",
        inputs={**GPT2_SMALL, "dp": 2, "tp": 2}, work=_block_states, unit="MB", scale=1e6, digits=1,
        level="combine",
        hint="tensor parallelism splits a block's weight matrices and column-parallel biases, but leaves its "
             "LayerNorms and row-parallel biases whole on every tp rank; FSDP then divides what each rank holds "
             "by dp.",
        traps={"no_fsdp": "That kept every block's states whole on each dp rank: FSDP shards them by dp."},
        solution="a block: {split_M:.3f} M split by tp, {whole_k:.2f} k whole; {layers} blocks: {held_M:.3f} M on "
                 "a tp rank, / {dp} = {per_rank_M:.3f} M x {per_bytes} bytes = {answer}."),
    Problem(
        "09.tp-bytes-per-step",
        "That model ({layers} layers, d_model {d_model}, context {context:,}) trains a global batch of {batch} "
        "sequences on dp {dp} x tp {tp}, fp32. Counting chapter 09's block all-reduces (2 forward, 4 backward: q, k "
        "and v separate), how many MB does each tp rank send per step?",
        inputs={"layers": 12, "d_model": 768, "context": 1024, "batch": 16, "dp": 2, "tp": 2}, work=_tp_bytes,
        unit="MB", scale=1e6, digits=0, level="combine",
        hint="each dp group trains batch / dp rows; every all-reduce carries those rows' activations (rows x "
             "context x d_model x 4 bytes), and each rank sends 2(tp-1)/tp of it.",
        traps={"fused": "That counted Megatron's 4 all-reduces a block (q, k, v fused into one layer): this model "
                        "keeps three Linears, so backward has four."},
        solution="{rows} rows: {size_MB:.2f} MB an all-reduce, {once_MB:.2f} MB sent a rank; x {calls} all-reduces "
                 "= {answer}."),
    Problem(
        "09.audit-palm-mfu",
        "Audit: PaLM 540B ({params_b} B parameters, {layers} layers, {heads} heads of {head_dim}, sequence "
        "{seq:,}) trained {tokens_per_s:,} tokens/s on {chips:,} TPU v4 chips of {peak_tflops} TFLOP/s. Its model "
        "width is {d_model:,}. What MFU do 6N + 12 L H Q T give?",
        inputs={"params_b": 540.35, "layers": 118, "heads": 48, "head_dim": 256, "seq": 2048,
                "tokens_per_s": 238_300, "chips": 6144, "peak_tflops": 275, "d_model": 18432},
        work=_palm, unit="%", scale=0.01, digits=1, tolerance=0.001, level="audit", source=PALM,
        hint="attention's width is H x Q (heads x head size), not d_model: PaLM's 48 x 256 is 12,288, narrower than "
             "its 18,432.",
        traps={"width_d_model": "That used d_model as attention's width: PaLM's H x Q is 12,288.",
               "six_n": "That is 6N alone, attention left out.",
               "causal": "That counted the causal half of attention: PaLM's convention counts every key."},
        solution="6N + 12 L ({heads} x {head_dim}) T = {flops_T:.4f} TFLOP a token; x {tokens_per_s:,} / ({chips:,} "
                 "x {peak_tflops} TFLOP/s) = {answer}: the paper's 46.2 % (attention's width taken as d_model: "
                 "{width_d_model:.2%}; 6N alone: {six_n:.2%}; causal half: {causal:.2%})."),
]
