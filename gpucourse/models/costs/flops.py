"""FLOPs (chapters 07b, 09): dense datasheet peaks by exact device name, model and hardware FLOPs per token of a
transformer, MFU and HFU."""
from typing import NamedTuple

from ._checks import check_nonneg, require


# --- peak FLOP/s, model and hardware FLOPs per token, MFU and HFU (chapters 07b, 09) -------------------------

# Dense (no 2:4 structured sparsity) peak TFLOP/s per device, keyed by the exact string
# torch.cuda.get_device_name() returns. NVIDIA's datasheets print tensor-core rates "with sparsity" (marked *) and say
# in a footnote that the dense rate is one half of that; FP32 is the non-tensor (CUDA core) rate, never sparse.
# One rule, so every figure below can be checked against its datasheet: dense = printed sparse figure / 2.
# Variants of one chip differ (H100 SXM, PCIe and NVL have different clocks, power and SM counts), so a name is
# matched exactly, never by substring: an unknown name, or a dtype whose rate the table does not list, is an error
# that asks for the peak, never the nearest guess. A SKU or rate whose datasheet figure could not be confirmed is
# left out on purpose (H200 NVL; the H100 NVL's tf32, fp32 and fp8 rates).
DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp8")


class DevicePeak(NamedTuple):
    """One device's dense peaks: TFLOP/s by dtype, and the datasheet they come from (name, URL, figures as printed)."""
    tflops: dict
    source: str


_H100_DATASHEET = ("NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/ "
                   "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)")
_A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet (one table for the 40/80 GB PCIe and SXM boards), "
                   "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                   "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A100 = DevicePeak({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                   f"{_A100_DATASHEET}; printed: FP32 19.5, TF32 156 (312*), BF16 312 (624*), FP16 312 (624*) "
                   "(the A100 datasheet prints the dense rate, and the sparse one beside it)")
_H100_SXM_RATES = {"bf16": 1979 / 2, "fp16": 1979 / 2, "tf32": 989 / 2, "fp32": 67.0, "fp8": 3958 / 2}
PEAK_DENSE_TFLOPS = {
    "NVIDIA H100 80GB HBM3": DevicePeak(  # the H100 SXM5 board
        _H100_SXM_RATES, f"{_H100_DATASHEET}, H100 SXM column; printed: FP32 67, TF32 989*, BF16 1,979*, "
                         "FP16 1,979*, FP8 3,958* (* with sparsity)"),
    "NVIDIA H100 PCIe": DevicePeak(
        {"bf16": 1513 / 2, "fp16": 1513 / 2, "tf32": 756 / 2, "fp32": 51.0, "fp8": 3026 / 2},
        f"{_H100_DATASHEET}, H100 PCIe column; printed: FP32 51, TF32 756*, BF16 1,513*, FP16 1,513*, FP8 3,026*"),
    "NVIDIA H100 NVL": DevicePeak(  # per GPU (some datasheet versions print a pair of NVL cards' figures)
        {"bf16": 1671 / 2, "fp16": 1671 / 2},
        f"{_H100_DATASHEET}, H100 NVL column, per GPU; printed: BF16 1,671*, FP16 1,671*; its other rates are not "
        "listed here (not confirmed): pass peak="),
    "NVIDIA H200": DevicePeak(  # the H200 SXM board; same GH100 compute as the H100 SXM, more and faster memory
        _H100_SXM_RATES, "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/, "
                         "H200 SXM column; printed: FP32 67, TF32 989*, BF16 1,979*, FP16 1,979*, FP8 3,958*"),
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L4": DevicePeak(
        {"bf16": 242 / 2, "fp16": 242 / 2, "tf32": 120 / 2, "fp32": 30.3, "fp8": 485 / 2},
        "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/; printed: FP32 30.3, "
        "TF32 120*, BF16 242*, FP16 242*, FP8 485*"),
    "Tesla T4": DevicePeak(  # Turing: no bf16, tf32 or fp8 tensor cores, and no structured sparsity
        {"fp16": 65.0, "fp32": 8.1},
        "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/tesla-t4/; printed: "
        "single precision 8.1, mixed precision (FP16/FP32) 65 (dense: Turing has no sparsity)"),
    "NVIDIA B200": DevicePeak(  # HGX B200, configured up to 1,000 W; a B200 run at a lower power limit peaks lower
        {"bf16": 4500 / 2, "fp16": 4500 / 2, "tf32": 2200 / 2, "fp32": 75.0, "fp8": 9000 / 2},
        "NVIDIA HGX B200 specifications, individual Blackwell GPU, https://www.nvidia.com/en-us/data-center/hgx/; "
        "printed: FP32 75 TFLOPS, TF32 2.2 PFLOPS*, FP16/BF16 4.5 PFLOPS*, FP8 9 PFLOPS*"),
}


def _known_devices():
    return ", ".join(sorted(PEAK_DENSE_TFLOPS))


def peak_flops(device_name, dtype="bf16"):
    """Dense peak FLOP/s of one device for `dtype` ('bf16', 'fp16', 'tf32', 'fp32', 'fp8'), from its datasheet.

    `device_name` is exactly what torch.cuda.get_device_name() returns ('NVIDIA H100 80GB HBM3' is the SXM board,
    'NVIDIA H100 PCIe' and 'NVIDIA H100 NVL' are slower ones). A device the table does not know, or a dtype the
    device has no listed rate for, raises ValueError telling the caller to pass the peak themselves: a wrong peak
    is how published MFU figures go over 100 % (a fallback table) or halve (a sparse rate for dense work).
    PEAK_DENSE_TFLOPS[device_name].source says where each figure comes from.
    """
    require(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device_name not in PEAK_DENSE_TFLOPS:
        raise ValueError(f"no datasheet peak for {device_name!r} (known, by exact name: {_known_devices()}): "
                         "look up its dense (not 'with sparsity') peak for your dtype and pass it yourself, "
                         "e.g. mfu(..., peak=<FLOP/s per device>)")
    rates = PEAK_DENSE_TFLOPS[device_name].tflops
    require(dtype in rates, f"{device_name} has no {dtype!r} rate in gpucourse's table (it lists "
                             f"{', '.join(rates)}): choose one of those dtypes or pass the peak yourself "
                             "(peak=<dense FLOP/s per device>)")
    return rates[dtype] * 1e12


def mfu(achieved_flops_per_second, device_name=None, dtype="bf16", n_devices=1, *, peak=None):
    """Model FLOPs utilisation: achieved *model* FLOP/s over the devices' total dense peak (0..1).

    achieved_flops_per_second: model FLOPs per token (model_flops_per_token) x tokens/s, summed over all
    n_devices. The peak is peak_flops(device_name, dtype) per device, or `peak` (FLOP/s per device) when given,
    for a device the table does not list. Recomputation is not model work: count it in hfu, not here
    (Chowdhery et al. 2022, PaLM, appendix B).
    """
    check_nonneg(achieved_flops_per_second, "achieved_flops_per_second")
    require(isinstance(n_devices, int) and not isinstance(n_devices, bool) and n_devices >= 1,
             f"n_devices must be a whole number >= 1, got {n_devices!r}")
    if peak is None:
        require(device_name is not None, "give device_name (torch.cuda.get_device_name()) or peak= "
                                          "(dense FLOP/s per device)")
        peak = peak_flops(device_name, dtype)
    require(peak > 0, f"peak must be > 0 (dense FLOP/s per device), got {peak!r}")
    return achieved_flops_per_second / (peak * n_devices)


def hfu(achieved_hardware_flops_per_second, device_name=None, dtype="bf16", n_devices=1, *, peak=None):
    """Hardware FLOPs utilisation: the same division as mfu, of the FLOPs the hardware executed.

    Pass hardware_flops_per_token(...) x tokens/s: it adds what recomputation runs again. HFU >= MFU; only MFU
    compares runs that recompute differently (the PaLM paper reports both: 46.2 % MFU, 57.8 % HFU).
    """
    return mfu(achieved_hardware_flops_per_second, device_name, dtype, n_devices, peak=peak)


def _check_transformer(n_params, n_layers, attn_width, seq_len):
    for value, name in ((n_params, "n_params"), (n_layers, "n_layers"), (attn_width, "attn_width"),
                        (seq_len, "seq_len")):
        require(value >= 0 if name == "n_params" else value >= 1, f"{name} must be >= "
                 f"{0 if name == 'n_params' else 1}, got {value!r}")


def _attention_keys(seq_len, causal):
    """Keys each query is scored against, averaged over the sequence: T, or (T + 1) / 2 under a causal mask."""
    return (seq_len + 1) / 2 if causal else seq_len


def model_flops_per_token(n_params, n_layers, attn_width, seq_len, *, causal=False):
    """Training FLOPs per token (forward + backward) of a decoder-only transformer: 6 N + 12 L d T.

    n_params (N): parameters that take part in matrix products - every Linear weight, the output head included.
    Not the embedding tables (a lookup does no arithmetic), biases or norms; FlopCounterMode counts the same.
    Each such weight costs 2 FLOPs per token forward (multiply + add) and 4 backward (the input's gradient and
    the weight's): 6 N.
    Attention (PaLM appendix B's 12 L H Q T): attn_width d = H Q, heads x head size, the width of q, k and v -
    d_model in most models, but not all (PaLM 540B: 48 x 256 = 12288, d_model 18432). Per layer and token the
    scores q.K^T and the weighted sum of V each take 2 d FLOPs per key: 4 d T forward, x 3 with backward.
    causal=False is PaLM's convention, and what most published MFU figures (and FlopCounterMode) use: every
    query against all T keys. A causal model needs only the unmasked half: query i against i + 1 keys, (T + 1)/2
    on average, so causal=True gives 6 N + 6 L d (T + 1), the useful work of a kernel that skips masked blocks.
    """
    _check_transformer(n_params, n_layers, attn_width, seq_len)
    return 6 * n_params + 12 * n_layers * attn_width * _attention_keys(seq_len, causal)


RECOMPUTE = ("none", "selective", "full")


def hardware_flops_per_token(n_params, n_layers, attn_width, seq_len, *, recompute="none", causal=False):
    """FLOPs per token the hardware executes: model FLOPs plus what activation recomputation runs again.

    recompute="full": every layer's forward runs twice (checkpointed layers), + 2 N + 4 L d T.
    recompute="selective" (Korthikanti et al. 2022): only attention's core (scores, softmax, weighted sum) is
    recomputed, + 4 L d T. These count in HFU, never in MFU: the model did not get any more work done.
    """
    require(recompute in RECOMPUTE, f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    flops = model_flops_per_token(n_params, n_layers, attn_width, seq_len, causal=causal)
    attention_forward = 4 * n_layers * attn_width * _attention_keys(seq_len, causal)
    return flops + {"none": 0, "selective": attention_forward, "full": 2 * n_params + attention_forward}[recompute]
