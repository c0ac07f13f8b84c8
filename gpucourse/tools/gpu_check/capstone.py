"""The capstone GPT (scripts/09_gpt_2d.py) on one GPU: its MFU, eager against compiled, where the kernel time goes,
and the dry run's predicted memory peak against the allocator's."""
from __future__ import annotations

from ...models.units import human_bytes, human_percent, human_si
from .harness import SCRIPTS, failed_run, launch, needs, seconds_left


def _capstone(name: str, sizes: dict, steps: int, warmup: int, extra=(), timeout: float = 540):
    """Launch the capstone GPT (1 rank, NCCL, bf16, profiled) and read back its figures: (result, figures)."""
    import torch

    from ...models import costs

    args = ["--dp-mode", "allreduce", "--d-model", sizes["d_model"], "--layers", sizes["layers"],
            "--heads", sizes["heads"], "--context", sizes["context"], "--batch", sizes["batch"], "--steps", steps,
            "--warmup-steps", warmup, "--dtype", "bfloat16", "--eval-batches", 0, "--sample", 0, "--profile", 2,
            *extra]
    res = launch(SCRIPTS / "09_gpt_2d.py", nproc=1, backend="nccl", name=name, timeout=timeout, args=args)
    if not res.ok:
        return res, {}
    header = next(m for m in res.metrics[0] if m.get("header"))
    summary = next(m for m in res.metrics[0] if m.get("summary"))
    achieved = summary["tokens_per_s"] * header["flops_per_token"]
    device = torch.cuda.get_device_name(0)
    step_s = [m["seconds"] for m in res.metrics[0] if "seconds" in m and "step" in m]
    figures = {"device": device, "params": header["params"], "flops_per_token": header["flops_per_token"],
               "tokens_per_s": summary["tokens_per_s"], "achieved_tflops": achieved / 1e12, "sizes": dict(sizes),
               "step_seconds": [round(x, 4) for x in step_s]}
    figures.update(_kernel_time(res))
    try:
        figures["peak_tflops"] = costs.peak_flops(device, "bf16") / 1e12
        figures["mfu"] = costs.mfu(achieved, device, "bf16")
    except ValueError as err:  # a device the peak table does not know: the figure is left out, not guessed
        figures["mfu_error"] = str(err)
    return res, figures


def _capstone_text(figures: dict) -> str:
    text = (f"{figures['params'] / 1e6:.0f} M params, {figures['tokens_per_s']:,.0f} tokens/s, "
            f"{human_si(figures['achieved_tflops'] * 1e12, 'FLOP/s')} of model FLOPs")
    if "mfu" in figures:
        text += (f" = {human_percent(figures['mfu'], 1)} MFU of {human_si(figures['peak_tflops'] * 1e12, 'FLOP/s')}"
                 " dense bf16")
    if figures.get("kernel_time_share"):
        text += (f"; GPU busy {human_percent(figures['gpu_busy_fraction'])} of the profiled steps, kernel time: " +
                 ", ".join(f"{k} {human_percent(v)}" for k, v in figures["kernel_time_share"].items()))
    return text


@needs(30)
def check_capstone_mfu(d_model: int = 2048, layers: int = 8, heads: int = 16, context: int = 1024,
                       batch: int = 32, steps: int = 12):
    """The capstone GPT on one GPU in bf16: tokens/s, and MFU from gpucourse.models.costs (model FLOPs, dense peak)."""
    sizes = dict(d_model=d_model, layers=layers, heads=heads, context=context, batch=batch)
    res, figures = _capstone("gpucheck-mfu", sizes, steps, 4)
    if not res.ok:
        return False, failed_run(res), {}, res
    figures.pop("step_seconds", None)
    return True, _capstone_text(figures), figures, res


def compile_seconds(step_seconds: list[float], warmup: int) -> float | None:
    """Seconds the warm-up steps took beyond as many ordinary steps: torch.compile's compilation (and the first
    steps' CUDA/cuBLAS set-up, which the eager run pays too). The median timed step is 'an ordinary step'."""
    import statistics

    timed = step_seconds[warmup:]
    if not timed or len(step_seconds) < warmup:
        return None
    return sum(step_seconds[:warmup]) - warmup * statistics.median(timed)


CAPSTONE_VARIANTS = {"eager": (), "compiled_fused": ("--compile", "--fused-optimizer"), "fused": ("--fused-optimizer",)}


@needs(110)
def check_capstone_compiled(d_model: int = 2048, layers: int = 8, heads: int = 16, context: int = 1024,
                            batch: int = 32, steps: int = 12, warmup: int = 4,
                            variants=("eager", "compiled_fused", "fused")):
    """The capstone GPT (capstone_mfu's sizes) eager, then with torch.compile and a fused AdamW, then fused AdamW
    alone (if time is left): MFU of each, where the kernel time goes, and the compilation's seconds apart."""
    sizes = dict(d_model=d_model, layers=layers, heads=heads, context=context, batch=batch)
    figures, texts, last = {}, [], None
    for i, variant in enumerate(variants):
        left = seconds_left()
        if i and left is not None and left < 60:
            figures[variant] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        res, fig = _capstone(f"gpucheck-capstone-{variant.replace('_', '-')}", sizes, steps, warmup,
                             CAPSTONE_VARIANTS[variant], timeout=300)
        last = res
        if not res.ok:
            figures[variant] = {"failed": failed_run(res), "run": str(res.run_dir)}
            texts.append(f"{variant}: FAILED ({failed_run(res)})")
            continue
        fig["warmup_extra_seconds"] = compile_seconds(fig["step_seconds"], warmup)
        figures[variant] = fig
        texts.append(f"{variant}: {fig['tokens_per_s']:,.0f} tokens/s"
                     + (f", MFU {human_percent(fig['mfu'], 1)}" if "mfu" in fig else "")
                     + (f", GPU busy {human_percent(fig['gpu_busy_fraction'])}" if fig.get("gpu_busy_fraction") else "")
                     + (", kernels " + "/".join(f"{k} {human_percent(v)}" for k, v in fig["kernel_time_share"].items())
                        if fig.get("kernel_time_share") else "")
                     + f", warm-up beyond ordinary steps {fig['warmup_extra_seconds']:.1f} s")
    eager, compiled = figures.get("eager", {}), figures.get("compiled_fused", {})
    if eager.get("tokens_per_s") and compiled.get("tokens_per_s"):
        figures["compiled_fused_speedup"] = compiled["tokens_per_s"] / eager["tokens_per_s"]
        figures["compile_seconds"] = compiled["warmup_extra_seconds"] - eager["warmup_extra_seconds"]
        texts.append(f"compiled+fused / eager = {figures['compiled_fused_speedup']:.2f}x, compilation about "
                     f"{figures['compile_seconds']:.0f} s")
    ok = all("tokens_per_s" in figures.get(v, {}) for v in variants[:2])
    return ok, "; ".join(texts), figures, last


KERNEL_KINDS = (("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas")), ("attention", ("flash", "fmha", "attention")),
                ("optimizer", ("adam", "multi_tensor", "foreach")))


def _kernel_time(res) -> dict:
    """Where the GPU's time went in the profiled steps: share of kernel time by kind, and how busy the GPU was."""
    from ...models.traces import analyze_run, load_trace

    analysis = analyze_run(res)
    steps = [s for r in analysis.ranks.values() for s in r.steps]
    kernels = [e for e in load_trace(next(iter(res.traces.values()))).get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") == "kernel"]
    by_kind: dict[str, float] = {}
    for e in kernels:
        name = e.get("name", "").lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in name for w in words)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + float(e.get("dur", 0))
    busy = sum(by_kind.values())
    return {"gpu_busy_fraction": sum(s.compute_us for s in steps) / sum(s.duration_us for s in steps) if steps else None,
            "kernel_time_share": {k: v / busy for k, v in sorted(by_kind.items())} if busy else {},
            "profiled_step_ms": [round(s.duration_us / 1e3, 1) for s in steps]}


@needs(30)
def check_dryrun_memory(d_model: int = 1024, layers: int = 8, heads: int = 16, context: int = 1024, batch: int = 16,
                        steps: int = 3, modes=("allreduce", "fsdp")):
    """The dry run's predicted peak (`gpucourse dryrun --fake-tensors`, world 1, on the CPU) against the capstone's
    real step on the GPU (1 rank, NCCL, bf16 autocast): torch.cuda.max_memory_allocated of its last step."""
    from ...run.dryrun import dryrun

    figures, texts, last = {}, [], None
    for mode in modes:
        args = ["--dp-mode", mode, "--d-model", d_model, "--layers", layers, "--heads", heads, "--context", context,
                "--batch", batch, "--steps", steps, "--warmup-steps", 0, "--dtype", "bfloat16", "--eval-batches", 0,
                "--sample", 0]
        res = last = launch(SCRIPTS / "09_gpt_2d.py", nproc=1, backend="nccl", name=f"gpucheck-dryrun-{mode}",
                             timeout=240, args=args)
        real = [m["cuda_peak_bytes"] for m in res.metrics.get(0, []) if "cuda_peak_bytes" in m]
        try:
            report = dryrun(SCRIPTS / "09_gpt_2d.py", world=1, args=args, fake_tensors=True, timeout=300)
            rank = report["ranks"][0]
            predicted, parts = rank["peak_bytes"], rank["memory"]
        except Exception as err:  # the dry run's own failure is this mode's result, not the check's crash
            predicted, parts = None, {"error": f"{type(err).__name__}: {err}"[:500]}
        fig = {"sizes": dict(d_model=d_model, layers=layers, heads=heads, context=context, batch=batch),
               "real_step_peaks": real, "predicted_peak": predicted, "predicted_parts": parts,
               "run_error": failed_run(res)}
        if real and predicted:
            fig["predicted_over_real"] = predicted / real[-1]
            texts.append(f"{mode}: predicted {human_bytes(predicted)}, allocator {human_bytes(real[-1])} "
                         f"(last of {len(real)} steps): {fig['predicted_over_real']:.3f}x")
        else:
            texts.append(f"{mode}: FAILED ({fig['run_error'] or parts.get('error', 'no peak logged')})")
        figures[mode] = fig
    ok = all("predicted_over_real" in f for f in figures.values())
    return ok, "; ".join(texts), figures, last
