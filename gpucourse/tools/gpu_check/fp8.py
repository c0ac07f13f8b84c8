"""FP8 where the GPU has it: torch._scaled_mm with tensor-wise scales against bf16, a matrix product's speed and the
capstone's loss with its MLP in FP8, beside chapter 07b's model."""
from __future__ import annotations

import time

from ...models.units import human_si
from .harness import SCRIPTS, needs


# --- FP8 ------------------------------------------------------------------------------------------------
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def _to_fp8(t):
    """Tensor-wise scaling: (t * s) in float8_e4m3fn with s = 448 / amax(t), and 1 / s to undo it."""
    import torch

    scale = E4M3_MAX / t.detach().abs().max().float().clamp(min=1e-12)
    return (t.float() * scale).to(torch.float8_e4m3fn), scale.reciprocal()


def fp8_matmul(a, w):
    """a @ w.T with both operands in FP8 (tensor-wise scales), the product in bf16. a (M, K), w (N, K): the
    layout torch._scaled_mm wants (first operand row-major, second column-major, which w.T of a row-major w is)."""
    import torch

    a8, sa = _to_fp8(a)
    w8, sw = _to_fp8(w)
    out = torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
    return out[0] if isinstance(out, tuple) else out  # some torch versions return (out, amax)


def _fp8_linear_function():
    import torch

    class FP8Linear(torch.autograd.Function):
        """Forward in FP8 (fp8_matmul), backward in bf16 from the saved bf16/fp32 inputs."""

        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight)
            ctx.has_bias = bias is not None
            out = fp8_matmul(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), weight.to(torch.bfloat16))
            if bias is not None:
                out = out + bias.to(out.dtype)
            return out.view(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            g = grad.reshape(-1, grad.shape[-1]).to(torch.bfloat16)
            gx = (g @ weight.to(torch.bfloat16)).view(x.shape).to(x.dtype)
            gw = (g.t() @ x.reshape(-1, x.shape[-1]).to(torch.bfloat16)).to(weight.dtype)
            gb = g.float().sum(0).to(weight.dtype) if ctx.has_bias else None
            return gx, gw, gb

    return FP8Linear


def use_fp8_forward(linears) -> None:
    """Make each nn.Linear's forward matrix product FP8 (backward stays bf16)."""
    fn = _fp8_linear_function()
    for lin in linears:
        lin.forward = lambda x, lin=lin: fn.apply(x, lin.weight, lin.bias)


def _time_cuda(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() over `reps` calls, each timed by CUDA events, after `warmup` calls."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def implied_gemm_fraction(speedup: float, ratio: float) -> float | None:
    """Chapter 07b's model (costs.low_precision_speedup) read backwards: the share of the bf16 step's time in
    the FP8 matrix products that would give `speedup` if those ran `ratio` times faster and nothing else
    changed: 1/s = (1 - f) + f/r, so f = (1 - 1/s) / (1 - 1/r)."""
    if not speedup or ratio <= 1:
        return None
    return (1 - 1 / speedup) / (1 - 1 / ratio)


def _load_capstone():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_2d_for_gpucheck", SCRIPTS / "09_gpt_2d.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs(40)
def check_fp8(sizes=(4096, 8192), steps: int = 20, d_model: int = 1024, layers: int = 4, heads: int = 16,
              context: int = 512, batch: int = 16):
    """FP8 (torch._scaled_mm, float8_e4m3fn, tensor-wise scales) where the GPU has it: bf16 vs FP8 matmul speed,
    and the capstone's loss over `steps` steps with its MLP's forward matmuls in FP8 against bf16; beside
    chapter 07b's modelled FP8 figures (peak ratio, bytes per parameter)."""
    import statistics

    import torch

    from ...models import costs

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    cap = torch.cuda.get_device_capability(0)
    figures: dict = {"device": name, "capability": list(cap)}
    try:
        figures["modelled_peak_ratio"] = costs.peak_flops(name, "fp8") / costs.peak_flops(name, "bf16")
    except ValueError as err:
        figures["modelled_peak_ratio"] = None
        figures["peak_error"] = str(err)
    figures["modelled_bytes_per_param"] = {r: costs.recipe_bytes_per_param(r)["total"] for r in ("mixed", "fp8")}
    if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")):
        return True, f"FP8 not available: torch {torch.__version__} has no float8_e4m3fn/_scaled_mm", \
            {**figures, "available": False}
    try:
        probe = torch.randn(32, 32, device=dev, dtype=torch.bfloat16)
        err = (fp8_matmul(probe, probe).float() - probe.float() @ probe.float().t()).abs().max().item()
    except Exception as exc:
        return True, f"FP8 not available on {name} (capability {cap}): {type(exc).__name__}: {exc}"[:400], \
            {**figures, "available": False, "error": str(exc)[:1000]}
    figures.update(available=True, probe_max_abs_error=err)
    texts = []
    bench = {}
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        a8, sa = _to_fp8(a)
        w8, sw = _to_fp8(w)
        flops = 2 * n ** 3
        bf16_ms = _time_cuda(lambda: a @ w.t())
        fp8_ms = _time_cuda(lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16))
        quant_ms = _time_cuda(lambda: fp8_matmul(a, w))
        bench[n] = {"bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "fp8_with_scaling_ms": quant_ms,
                    "bf16_tflops": flops / bf16_ms / 1e9, "fp8_tflops": flops / fp8_ms / 1e9,
                    "speedup": bf16_ms / fp8_ms, "speedup_with_scaling": bf16_ms / quant_ms}
        texts.append(f"{n}^3: bf16 {human_si(flops / bf16_ms * 1e3, 'FLOP/s')}, fp8 "
                     f"{human_si(flops / fp8_ms * 1e3, 'FLOP/s')} "
                     f"({bench[n]['speedup']:.2f}x; {bench[n]['speedup_with_scaling']:.2f}x with the scaling)")
        del a, w, a8, w8
    figures["matmul"] = bench

    gpt = _load_capstone()
    data = gpt.CharData(gpt.DATA)
    losses, step_ms = {}, {}
    for mode in ("bf16", "fp8_mlp"):
        torch.manual_seed(0)
        model = gpt.GPT(data.vocab_size, context, d_model, heads, layers).to(dev)
        if mode == "fp8_mlp":
            use_fp8_forward([lin for b in model.blocks for lin in (b.mlp.fc, b.mlp.proj)])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
        losses[mode], times = [], []
        for step in range(steps):
            x, y = data.batch("train", batch, context, seed=step)
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16):
                _, loss = model(x.to(dev), y.to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
            times.append((time.perf_counter() - start) * 1e3)
        step_ms[mode] = statistics.median(times[3:]) if len(times) > 3 else statistics.median(times)
        del model, opt
    diffs = [abs(a - b) for a, b in zip(losses["bf16"], losses["fp8_mlp"])]
    speedup = step_ms["bf16"] / step_ms["fp8_mlp"]
    figures["training"] = {"sizes": dict(d_model=d_model, layers=layers, heads=heads, context=context, batch=batch),
                           "steps": steps, "losses": losses, "max_abs_loss_diff": max(diffs),
                           "final_loss_diff": losses["fp8_mlp"][-1] - losses["bf16"][-1],
                           "median_step_ms": step_ms, "step_speedup": speedup,
                           "implied_gemm_fraction": implied_gemm_fraction(speedup, figures["modelled_peak_ratio"] or 0)}
    texts.append(f"capstone d{d_model}x{layers}, {steps} steps: final loss bf16 {losses['bf16'][-1]:.4f}, "
                 f"FP8 MLP {losses['fp8_mlp'][-1]:.4f} (largest step difference {max(diffs):.4f}); step "
                 f"{step_ms['bf16']:.1f} -> {step_ms['fp8_mlp']:.1f} ms ({speedup:.2f}x)")
    if figures["modelled_peak_ratio"]:
        texts.append(f"chapter 07b models fp8 at {figures['modelled_peak_ratio']:.1f}x bf16's peak and "
                     f"{figures['modelled_bytes_per_param']['fp8']} vs {figures['modelled_bytes_per_param']['mixed']} "
                     "bytes/parameter")
    finite = all(map(lambda v: v == v and abs(v) < 1e4, losses["fp8_mlp"]))
    return finite, "; ".join(texts), figures
