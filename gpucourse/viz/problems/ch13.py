"""Chapter 13's problems: what a 3-D job's groups carry (the planner's pipeline sends, tensor parallelism's
all-gathers and FSDP's collectives over dp for Llama 3 405B on its published layout), how many times more the tp
group carries than the pp group (why tp is innermost), and which rank holds less than its share (FSDP2's shards)."""
from __future__ import annotations

from ...models import planner, sharding
from .base import Problem

LLAMA3_LAYOUT = ("Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.2 and Table 4: tp 8 "
                 "x pp 16 x dp 128 on 16,384 H100s, 8K sequences, 16M tokens a step")


def llama3_plan(model, tp, pp, dp, seq, global_batch, micro):
    """The planner's plan of the job, split as Llama 3 split its layers (the first and last stage one short), with
    sequence parallelism as chapter 13's script has it (torch's DTensor: the gathered inputs kept, nothing gathered
    again in the backward; the logits gathered whole)."""
    split = planner.llama3_stage_layers(planner.SHAPES[model]["layers"], pp)
    return planner.plan_parallelism(model, gpus=tp * pp * dp, dp=dp, tp=tp, pp=pp, seq=seq, global_batch=global_batch,
                                    micro_batch=global_batch // dp // micro, schedule="1f1b", sequence_parallel=True,
                                    stage_layers=split, sp_saves="gathered", loss_parallel=False)


def _stage_op(model, tp, pp, dp, seq, global_batch, micro, group, op):
    plan = llama3_plan(model, tp, pp, dp, seq, global_batch, micro)
    found = next(c for c in plan["stages"][0]["collectives"] if (c["group"], c["op"]) == (group, op))
    return found, plan["stages"][0]["layers"], planner.SHAPES[model]["d_model"]


def _pp_send(model, tp, pp, dp, seq, global_batch, micro):
    send, _, d = _stage_op(model, tp, pp, dp, seq, global_batch, micro, "pp", "send")
    return {"answer": send["bytes"], "calls": send["calls"], "per_call_MB": send["bytes"] / send["calls"] / 1e6,
            "whole_MB": seq * d * 2 / 1e6, "no_sp": send["bytes"] * tp, "one_micro": send["bytes"] / send["calls"]}


def _tp_gathers(model, tp, pp, dp, seq, global_batch, micro):
    gather, layers, d = _stage_op(model, tp, pp, dp, seq, global_batch, micro, "tp", "all_gather")
    each = gather["bytes"] / gather["calls"]
    return {"answer": gather["bytes"], "calls": gather["calls"], "layers": layers, "per_call_MB": each / 1e6,
            "forward_only": 2 * layers * micro * each, "blocks_only": 4 * layers * micro * each,
            "one_layer": 4 * micro * each}


def _dp_traffic(model, tp, pp, dp, seq, global_batch, micro):
    gather, _, _ = _stage_op(model, tp, pp, dp, seq, global_batch, micro, "dp", "all_gather")
    scatter, _, _ = _stage_op(model, tp, pp, dp, seq, global_batch, micro, "dp", "reduce_scatter")
    return {"answer": gather["bytes"] + scatter["bytes"], "gather_GB": gather["bytes"] / 1e9,
            "scatter_GB": scatter["bytes"] / 1e9, "params_B": gather["bytes"] / 2 / 1e9,
            "gather_only": gather["bytes"], "every_micro": micro * gather["bytes"] + scatter["bytes"]}


def _tp_over_pp(model, tp, pp, dp, seq, global_batch, micro):
    gather, layers, _ = _stage_op(model, tp, pp, dp, seq, global_batch, micro, "tp", "all_gather")
    scatter, _, _ = _stage_op(model, tp, pp, dp, seq, global_batch, micro, "tp", "reduce_scatter")
    send, _, _ = _stage_op(model, tp, pp, dp, seq, global_batch, micro, "pp", "send")
    return {"answer": (gather["bytes"] + scatter["bytes"]) / send["bytes"], "layers": layers,
            "tp_GB": (gather["bytes"] + scatter["bytes"]) / 1e9, "pp_GB": send["bytes"] / 1e9,
            "gathers_only": gather["bytes"] / send["bytes"]}


def _last_shard(vocab, tp, dp):
    rows = vocab // tp
    return {"answer": sharding.dim0_shard_rows(rows, dp, dp - 1), "rows": rows, "even": rows / dp,
            "per": sharding.dim0_shard_rows(rows, dp, 0), "last_rank": dp - 1}


LLAMA = {"model": "llama3-405b", "tp": 8, "pp": 16, "dp": 128, "seq": 8192, "global_batch": 2048, "micro": 16}

PROBLEMS = [
    Problem(
        "13.pp-send",
        "{model} on tp {tp} x pp {pp} x dp {dp}, {micro} micro-batches of one {seq:,}-token sequence a dp rank, bf16, "
        "sequence parallel: how many GB does one rank of the first stage send to the next stage in a step (the "
        "forward's activations)?",
        inputs=dict(LLAMA), work=_pp_send, unit="GB", scale=1e9, digits=3, source=LLAMA3_LAYOUT,
        hint="a send per micro-batch, of the sequence's activations (seq x d_model x 2 bytes); with sequence "
             "parallelism each tp rank holds, and sends, 1/tp of the sequence.",
        traps={"no_sp": "That sent the whole sequence from every tp rank: with sequence parallelism each sends 1/tp.",
               "one_micro": "That is one micro-batch's send: a step sends one per micro-batch."},
        solution="{calls} sends of {whole_MB:.1f} MB / {tp} = {per_call_MB:.1f} MB each: {answer} a step (chapter 12's "
                 "dry run counts the same)."),
    Problem(
        "13.tp-gathers",
        "The same job, split as Llama 3 split it (the first stage one layer short of the others'): tensor "
        "parallelism with sequence parallelism (chapter 13's, torch's DTensor) all-gathers the sequence before each "
        "attention and each MLP, forward and backward, and the vocabulary-parallel embedding's output is "
        "reduce-scattered into sequence slices. On a rank of the first stage, how many GB do its all-gathers carry "
        "in a step (nccl-tests' convention: the gathered buffer's bytes)?",
        inputs=dict(LLAMA), work=_tp_gathers, unit="GB", scale=1e9, digits=1, level="combine", source=LLAMA3_LAYOUT,
        hint="per layer and micro-batch: 2 all-gathers in the forward (before attention, before the MLP) and 2 in "
             "the backward, each of the whole sequence's activations (seq x d_model x 2 bytes); the embedding's "
             "reduce-scatter is an all-gather in the backward, once a micro-batch.",
        traps={"forward_only": "That counted the forward's all-gathers only: the backward gathers again.",
               "blocks_only": "That is the blocks' all-gathers: the embedding's gradient is gathered too, once a "
                              "micro-batch.",
               "one_layer": "That is one layer's: the stage has several."},
        solution="({layers} layers x 4 + the embedding's 1) x {micro} micro-batches = {calls} all-gathers of "
                 "{per_call_MB:.1f} MB: {answer} (chapter 12's dry run of the script counts the same; Megatron-LM "
                 "would gather each layer's inputs again in the backward: 2 more a layer)."),
    Problem(
        "13.dp-traffic",
        "The same job: FSDP over dp shards each stage's tp shards. Under the pipeline it all-gathers the bf16 weights "
        "once a step (reshard_after_forward=False) and reduce-scatters the fp32 gradients once, after the last "
        "micro-batch. How many GB do a first-stage rank's dp collectives carry in a step (the whole buffers' bytes)?",
        inputs=dict(LLAMA), work=_dp_traffic, unit="GB", scale=1e9, digits=2, source=LLAMA3_LAYOUT,
        hint="the buffers are the stage's tp shard of the weights: 2 bytes a parameter gathered, 4 a parameter "
             "reduce-scattered, once each a step.",
        traps={"gather_only": "That is the all-gather alone: the gradients' reduce-scatter carries twice as much "
                              "(fp32).",
               "every_micro": "That gathered the weights for every micro-batch (resharding after each forward): "
                              "under a pipeline FSDP keeps them for the step."},
        solution="the first stage's tp shard holds {params_B:.2f} B parameters: {gather_GB:.2f} GB gathered + "
                 "{scatter_GB:.2f} GB reduce-scattered = {answer}."),
    Problem(
        "13.tp-over-pp",
        "Section 1 puts tp innermost because it talks most. On a first-stage rank of the same job, how many times "
        "more bytes do the tp group's all-gathers and reduce-scatters carry in a step than the pp group's sends?",
        inputs=dict(LLAMA), work=_tp_over_pp, unit="x", digits=0, tolerance=0.01, level="combine",
        source=LLAMA3_LAYOUT,
        hint="tp: 2 all-gathers and 2 reduce-scatters of the whole sequence's activations per layer and micro-batch, "
             "forward and backward, and the embedding's reduce-scatter and all-gather; pp: one send per micro-batch "
             "of 1/tp of them (sequence parallel).",
        traps={"gathers_only": "That counted the all-gathers only: sequence parallelism reduce-scatters as much."},
        solution="tp {tp_GB:.1f} GB against pp {pp_GB:.3f} GB: {answer}. Per micro-batch, {layers} layers x 8 "
                 "buffers of the whole sequence (4 all-gathers, 4 reduce-scatters) and the embedding's 2, against "
                 "one send of 1/{tp} of one: the group that talks most gets the fastest links."),
    Problem(
        "13.audit-last-shard",
        "Audit: a planner counts each dp rank's share of {model}'s vocabulary-parallel head as the rows a tp rank "
        "holds over dp ({vocab:,} / {tp} / {dp}). How many rows does FSDP2 actually give the last dp rank?",
        inputs={"model": "llama3-405b", "vocab": 128256, "tp": 8, "dp": 128},
        work=lambda model, vocab, tp, dp: _last_shard(vocab, tp, dp), unit="rows", digits=0, tolerance=0.0,
        level="audit", source=LLAMA3_LAYOUT,
        hint="FSDP2 cuts the first dimension as torch.chunk does: pieces of ceil(rows / dp), in order; the last rank "
             "gets what is left.",
        traps={"even": "That is the even share, which no rank holds.",
               "per": "That is every other rank's piece: the last holds the remainder."},
        solution="{rows:,} rows a tp rank, in pieces of {per}: the first {last_rank} dp ranks hold {per} each, "
                 "the last {answer} (chapter 12's dry run sees it: rank 16,383's states are 0.94 of an even share)."),
]
