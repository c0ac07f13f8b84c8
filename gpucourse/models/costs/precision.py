"""Bytes per parameter by optimizer and precision recipe (chapters 07, 07b), and FP8's modelled speedup."""
from ._checks import require
from .flops import peak_flops


# --- bytes per parameter, by optimizer and precision (chapter 07) -------------------------------------------

# fp32 tensors of the parameter's shape that each optimizer keeps per parameter
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}
PRECISIONS = ("mixed", "fp32")


def state_bytes_per_param(optimizer="adam", precision="mixed"):
    """Bytes per parameter of the model states, as zero_memory_bytes's keyword arguments.

    precision="mixed" (bf16/fp16 training, as in the ZeRO paper): a 2-byte parameter and gradient, and an
    fp32 master copy (4) besides the fp32 optimizer states (4 each): Adam 2 + 2 + (4 + 8) = 16.
    precision="fp32": 4-byte parameter and gradient, no master copy (the parameter is the master):
    Adam 4 + 4 + 8 = 16 too, SGD with momentum 4 + 4 + 4, plain SGD 4 + 4 + 0.
    The master copy counts as optimizer state, as in the ZeRO paper; recipe_bytes_per_param keeps it apart
    and knows more recipes.

        zero_memory_bytes(psi, n, stage, **state_bytes_per_param("sgd_momentum", "fp32"))
    """
    require(precision in PRECISIONS, f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    parts = recipe_bytes_per_param(precision, optimizer)  # validates optimizer
    return {"param_bytes": parts["parameters"], "grad_bytes": parts["gradients"],
            "optimizer_bytes": parts["master weights"] + parts["optimizer states"]}


# --- mixed precision, recipe by recipe: bytes per parameter (chapter 07b) -----------------------------------
# Bytes per parameter element of each model state, per recipe; "state" is one optimizer state element (Adam
# keeps two, m and v). Chapter 07 measures the first four by counting the tensors a real run holds after an
# optimizer step; "fp8" is modelled (no FP8 hardware in this course's CI), with its assumption written down.
PRECISION_RECIPES = {
    "fp32": {"parameters": 4, "gradients": 4, "master weights": 0, "state": 4},
    # autocast casts weights to 16 bits on the fly, per op: the parameters, their gradients and the optimizer
    # stay fp32, so the model states do not shrink (the 16-bit copies backward needs come on top, transiently)
    "autocast": {"parameters": 4, "gradients": 4, "master weights": 0, "state": 4},
    # 16-bit parameters and gradients, an fp32 master copy the optimizer updates, fp32 states: the ZeRO paper's
    # "mixed-precision Adam", 2 + 2 + 4 + 4 + 4 = 16
    "mixed": {"parameters": 2, "gradients": 2, "master weights": 4, "state": 4},
    # everything in bf16, optimizer states too: half the bytes, and updates below bf16's resolution are lost
    "bf16": {"parameters": 2, "gradients": 2, "master weights": 0, "state": 2},
    # MODELLED: "mixed" plus an FP8 (1-byte) copy of each weight, cast once per step and kept for the FP8
    # matrix products of forward and backward (Transformer Engine caches it across micro-batches; it may also
    # keep a transposed copy, one byte more). FP8 saves activation memory and GEMM time, not model states.
    "fp8": {"parameters": 2 + 1, "gradients": 2, "master weights": 4, "state": 4},
}
RECIPES = tuple(PRECISION_RECIPES)
MEASURED_RECIPES = ("fp32", "autocast", "mixed", "bf16")  # what a CPU run can hold and count; fp8 is modelled


def recipe_bytes_per_param(recipe="mixed", optimizer="adam"):
    """Bytes per parameter of each model state under a precision recipe and an optimizer.

    Returns {"parameters", "gradients", "master weights", "optimizer states", "total"}. With Adam:
      fp32      4 + 4 + 0 + 8 = 16
      autocast  4 + 4 + 0 + 8 = 16   (autocast does not shrink parameters)
      mixed     2 + 2 + 4 + 8 = 16   (bf16/fp16 params and grads, fp32 master, fp32 m and v)
      bf16      2 + 2 + 0 + 4 = 8    (no master: small updates are rounded away)
      fp8       3 + 2 + 4 + 8 = 17   (modelled: mixed + a 1-byte FP8 weight copy)
    Per-tensor extras (Adam's step counter, 4 bytes a tensor) and activations are not per parameter: not here.
    """
    require(recipe in PRECISION_RECIPES, f"unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    require(optimizer in OPTIMIZER_STATES,
             f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZER_STATES)}")
    r = PRECISION_RECIPES[recipe]
    parts = {"parameters": r["parameters"], "gradients": r["gradients"], "master weights": r["master weights"],
             "optimizer states": r["state"] * OPTIMIZER_STATES[optimizer]}
    return {**parts, "total": sum(parts.values())}


def low_precision_speedup(gemm_fraction, device_name, dtype="fp8", baseline="bf16"):
    """MODELLED step-time speedup from running the matrix products in `dtype` instead of `baseline`.

    Amdahl's law with the datasheet peaks (peak_flops): the GEMMs, a `gemm_fraction` of the baseline step's
    time, run peak(dtype) / peak(baseline) times faster; everything else (norms, softmax, communication, the
    casts and scale computations FP8 adds) does not change. An upper bound: GEMMs rarely run at peak, and small
    ones gain less. On an H100 SXM fp8's dense peak is twice bf16's, so the bound is 1 / (1 - f/2).
    """
    require(0 <= gemm_fraction <= 1, f"gemm_fraction must be between 0 and 1 (the share of the step's time "
                                      f"spent in matrix products), got {gemm_fraction!r}")
    ratio = peak_flops(device_name, dtype) / peak_flops(device_name, baseline)
    return 1.0 / ((1 - gemm_fraction) + gemm_fraction / ratio)
