"""Chapter 07's problems: model states under ZeRO and FSDP (costs.zero, memory.model_states), and an audit of
a public memory calculator against the course's parameter count (planner.shape_params)."""
from __future__ import annotations

from ...models import costs, memory, planner
from .base import Problem

# The shape a popular memory calculator's "Llama 3 8B" preset computes with: 12 L d^2 (a GPT layer: four d x d
# attention matrices, a 4d two-matrix MLP) and BERT's 30,522-token vocabulary, embedding tied to the head.
WIDGET_LLAMA3_8B = {"layers": 32, "d_model": 4096, "ffn": 4 * 4096, "heads": 32, "kv_heads": 32, "vocab": 30522,
                    "mlp_matrices": 2, "tied": True}


def _stage(params_b, n, stage):
    states = memory.model_states(params_b * 1e9, n, stage)
    return {"answer": states["total"], "params_GB": states["parameters"] / 1e9,
            "grads_GB": states["gradients"] / 1e9, "optimizer_GB": states["optimizer states"] / 1e9,
            "ddp": costs.zero_memory_bytes(params_b * 1e9, n, 0),
            "stage3": costs.zero_memory_bytes(params_b * 1e9, n, 3)}


def _largest(device_gb, n, stage):
    per_param = memory.model_states(1, n, stage)["total"]
    return {"answer": memory.largest_model(device_gb * 1e9, n, stage), "per_param": per_param,
            "ddp": memory.largest_model(device_gb * 1e9, n, 0)}


def _comm(params_b, stage):
    return {"answer": costs.zero_comm_volume(params_b * 1e9, stage), "ddp": costs.zero_comm_volume(params_b * 1e9, 0),
            "elements": 3 if stage == 3 else 2}


def _batch_that_fits(params_b, n, device_gb, gb_per_sequence):
    states = costs.zero_memory_bytes(params_b * 1e9, n, 1)
    left = device_gb * 1e9 - states
    return {"answer": int(left // (gb_per_sequence * 1e9)), "states_GB": states / 1e9, "left_GB": left / 1e9,
            "ddp_GB": costs.zero_memory_bytes(params_b * 1e9, n, 0) / 1e9}


def _widget_params(shown_b):
    course = planner.shape_params("llama3-8b")
    widget = planner.shape_params(WIDGET_LLAMA3_8B)
    shape = planner.shape_of("llama3-8b")
    return {"answer": course["total"] - widget["total"], "course": course["total"] / 1e9,
            "widget": widget["total"] / 1e9, "vocab": shape["vocab"], "ffn": shape["ffn"],
            "tables": (course["embedding"] + course["head"]) / 1e9, "widget_tables": widget["embedding"] / 1e9,
            "layers_diff": shape["layers"] * (course["layer_dense"] - widget["layer_dense"]) / 1e9}


def _tp_param_memory(tp):
    total = planner.shape_params("llama3-8b")["total"]
    whole = total * planner.BYTES["param"]
    return {"answer": whole / tp, "total_B": total / 1e9, "whole": whole,
            "whole_GB": total * planner.BYTES["param"] / 1e9, "bytes": planner.BYTES["param"]}


PROBLEMS = [
    Problem(
        "07.zero2-7b5",
        "A {params_b} B-parameter model, mixed-precision Adam, on {n} GPUs with ZeRO-2. How many GB of model states "
        "does each GPU hold (decimal GB, activations not counted)?",
        inputs={"params_b": 7.5, "n": 64, "stage": 2}, work=_stage, unit="GB", scale=1e9, digits=2,
        hint="ZeRO-2 shards the gradients (2 bytes) and the optimizer states (12) over the GPUs, but every GPU still "
             "keeps all the 2-byte parameters: 2 + 14/N bytes a parameter.",
        traps={"stage3": "That sharded the parameters too: that is ZeRO-3.",
               "ddp": "That is plain data parallelism, 16 bytes a parameter on every GPU."},
        solution="parameters {params_GB:.2f} GB (whole) + gradients {grads_GB:.3f} GB + optimizer states "
                 "{optimizer_GB:.3f} GB (sharded over {n}) = {answer} (DDP: {ddp:.4g} bytes)."),
    Problem(
        "07.zero1-7b5",
        "The same {params_b} B model on {n} GPUs with ZeRO-1: model states per GPU, in GB?",
        inputs={"params_b": 7.5, "n": 64, "stage": 1}, work=_stage, unit="GB", scale=1e9, digits=1,
        hint="ZeRO-1 shards only the optimizer states (12 bytes a parameter: fp32 master, momentum, variance); the "
             "2-byte parameters and 2-byte gradients stay whole: 4 + 12/N.",
        traps={"stage3": "That sharded everything: ZeRO-1 shards only the optimizer states."},
        solution="parameters {params_GB:.1f} GB + gradients {grads_GB:.1f} GB (whole) + optimizer states "
                 "{optimizer_GB:.2f} GB (1/{n}) = {answer}."),
    Problem(
        "07.largest-zero3",
        "{n} GPUs of {device_gb} GB each, mixed-precision Adam, ZeRO-3. What is the largest model whose model "
        "states fit, in billions of parameters (activations not counted)?",
        inputs={"device_gb": 80, "n": 64, "stage": 3}, work=_largest, unit="B params", scale=1e9, digits=0,
        level="combine",
        hint="with ZeRO-3 all 16 bytes a parameter are sharded: each GPU holds 16/N bytes a parameter, so the "
             "model can be N/16 bytes' worth of each GPU's memory.",
        traps={"ddp": "That is plain data parallelism's limit, 16 bytes a parameter on each GPU."},
        solution="bytes a parameter per GPU: 16/{n} = {per_param:.4f}; {device_gb} GB / {per_param:.4f} = {answer} "
                 "(DDP: {ddp:.3g} parameters)."),
    Problem(
        "07.zero3-comm",
        "Per the ZeRO paper, how many GB does each rank communicate a step for a {params_b} B model in 2-byte "
        "elements under ZeRO stage {stage}?",
        inputs={"params_b": 7.5, "stage": 3}, work=_comm, unit="GB", scale=1e9, digits=0,
        hint="ZeRO-3 all-gathers the parameters again in the backward: 3 psi elements, not data parallelism's 2 "
             "psi (a reduce-scatter and an all-gather).",
        traps={"ddp": "That is data parallelism's (and ZeRO-1/2's) 2 psi: ZeRO-3 gathers the parameters twice."},
        solution="{elements} x {params_b} B elements x 2 bytes = {answer}, 1.5 x DP's {ddp:.3g} bytes."),
    Problem(
        "07.batch-that-fits",
        "A {params_b} B model with mixed-precision Adam and ZeRO-1 on {n} GPUs of {device_gb} GB. Each sequence of "
        "the micro-batch keeps {gb_per_sequence} GB of activations. How many sequences fit in a micro-batch?",
        inputs={"params_b": 7.5, "n": 8, "device_gb": 80, "gb_per_sequence": 4.0}, work=_batch_that_fits,
        unit="sequences", digits=0, tolerance=0, level="combine",
        hint="first the model states (4 + 12/N bytes a parameter under ZeRO-1), then what is left over divided by "
             "a sequence's activations, rounded down.",
        solution="model states: {states_GB:.2f} GB (DDP would need {ddp_GB:.0f} GB); left: {left_GB:.2f} GB; "
                 "/ {gb_per_sequence} GB = {answer}."),
    Problem(
        "07.audit-widget-vocab",
        "Audit: a popular memory calculator's \"Llama 3 8B\" preset shows {shown_b} B parameters; it counts 12 L d^2 "
        "for the layers and BERT's 30,522-token vocabulary, embedding tied. How many parameters (billions) does it "
        "leave out, by the course's count of Llama 3 8B's published shape?",
        inputs={"shown_b": round(planner.shape_params(WIDGET_LLAMA3_8B)["total"] / 1e9, 2)}, work=_widget_params,
        unit="B params", scale=1e9, digits=2, level="audit",
        source="Llama 3 8B's shape: Grattafiori et al. 2024, Table 3 (planner.SHAPES)",
        hint="two things differ: the vocabulary (128,256 tokens, the embedding and the head untied) and the layer "
             "(grouped-query attention, a SwiGLU MLP of three 4,096 x 14,336 matrices), not 12 d^2.",
        solution="the course (planner.shape_params): {course:.2f} B, of which embedding + head {tables:.2f} B "
                 "(vocabulary {vocab:,}); the preset: {widget:.2f} B, its tied BERT table {widget_tables:.3f} B; the "
                 "layers differ by {layers_diff:.2f} B (ffn {ffn:,} x 3 matrices and 8 key/value heads against 12 "
                 "d^2): {answer} missing."),
    Problem(
        "07.audit-widget-tp",
        "Audit: the same calculator's parameter memory ignores tensor parallelism. Llama 3 8B in bf16 with tp = "
        "{tp}: how many GB of parameters does each GPU hold?",
        inputs={"tp": 8}, work=_tp_param_memory, unit="GB", scale=1e9, digits=2, level="audit",
        hint="tensor parallelism splits every weight matrix over the tp ranks: each holds 1/tp of the parameters "
             "(the planner splits the embedding and head too).",
        traps={"whole": "That is the whole model on every GPU, the calculator's slip: tp splits it."},
        solution="{total_B:.2f} B parameters x {bytes} bytes = {whole_GB:.2f} GB, over tp = {tp}: {answer}."),
]
