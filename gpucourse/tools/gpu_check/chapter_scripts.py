"""The chapters' scripts launched on the GPU: a CUDA trace (03), precision (02, 07b), memory (07), the default sizes
(03, 07b), chapter 05's pipeline schedules one by one."""
from __future__ import annotations

from ...models.units import human_bytes
from .harness import SCRIPTS, failed_run, launch, needs


@needs(17)
def check_cuda_trace():
    """A profiled DDP step on the GPU: CUDA kernels, NCCL kernels and streams read back by gpucourse.models.traces."""
    from ...viz.timeline import timeline_plot
    from ...models.traces import analyze_run, load_trace

    res = launch(SCRIPTS / "03_ddp_train.py", nproc=1, backend="nccl", name="gpucheck-trace",
                  args=["--steps", "5", "--warmup", "2", "--profile-steps", "3"])
    if not res.ok:
        return False, failed_run(res), {}, res
    analysis = analyze_run(res)
    events = [e for e in load_trace(next(iter(res.traces.values()))).get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    nccl = [e for e in kernels if "nccl" in e.get("name", "").lower()]
    streams = sorted({e.get("tid") for e in kernels}, key=str)
    figures = {"kind": analysis.kind, "kernels": len(kernels), "nccl_kernels": len(nccl), "streams": len(streams),
               "steps_analysed": sum(len(r.steps) for r in analysis.ranks.values()),
               "problems": list(analysis.problems)}
    fig = timeline_plot(analysis)
    figures["timeline_drawn"] = bool(fig.axes)
    ok = analysis.kind == "gpu" and kernels and figures["steps_analysed"] > 0
    return ok, (f"trace kind {analysis.kind}: {len(kernels)} kernels ({len(nccl)} NCCL) on {len(streams)} "
                f"stream(s), {figures['steps_analysed']} steps analysed"), figures, res


@needs(19)
def check_bf16_autocast_ddp():
    """Chapter 02's precision script on the GPU: fp32, bf16 autocast and the bf16/fp16 compression hooks."""
    res = launch(SCRIPTS / "02_precision.py", nproc=1, backend="nccl", name="gpucheck-precision")
    rows = [m for m in res.metrics.get(0, []) if "mode" in m]
    figures = {"modes": {m["mode"]: {k: v for k, v in m.items() if k not in ("rank", "time", "mode")} for m in rows}}
    ok = res.ok and {"fp32", "autocast"} <= set(figures["modes"])
    return ok, failed_run(res) or f"modes run: {', '.join(figures['modes'])}", figures, res


@needs(18)
def check_fsdp_memory(width: int = 2048, depth: int = 8):
    """Chapter 07's memory script on the GPU: the allocator's peak per mode beside the counted state bytes."""
    res = launch(SCRIPTS / "07_memory.py", nproc=1, backend="nccl", name="gpucheck-memory",
                  args=["--modes", "ddp", "zero1", "fsdp2", "--width", str(width), "--depth", str(depth)])
    rows = [m for m in res.metrics.get(0, []) if "mode" in m]
    figures = {m["mode"]: {"state_bytes": m["params"] + m["grads"] + m["optimizer"], "cuda_peak": m.get("cuda_peak"),
                           "peak_over_state": (m["cuda_peak"] / (m["params"] + m["grads"] + m["optimizer"])
                                               if m.get("cuda_peak") else None)} for m in rows}
    ok = res.ok and rows and all(v["cuda_peak"] for v in figures.values())
    text = "; ".join(f"{k}: state {human_bytes(v['state_bytes'])}, CUDA peak {human_bytes(v['cuda_peak'])}"
                     for k, v in figures.items() if v["cuda_peak"])
    return ok, failed_run(res) or text, figures, res


@needs(20)
def check_precision_recipes(width: int = 2048, depth: int = 8):
    """Chapter 07b's mixed-precision script on the GPU: each recipe's counted bytes (checked against the formula in
    the run) beside torch.cuda.max_memory_allocated; fp16 autocast with GradScaler("cuda") skipping and halving."""
    res = launch(SCRIPTS / "07b_precision.py", nproc=1, backend="nccl", name="gpucheck-precision-recipes",
                  args=["--width", str(width), "--depth", str(depth)])
    rows = [m for m in res.metrics.get(0, []) if m.get("part") == "recipe"]
    parts = ("parameters", "gradients", "master_weights", "optimizer_states")
    figures = {m["recipe"]: {"state_bytes": sum(m[p] for p in parts), "cuda_held": m.get("cuda_held"),
                             "cuda_peak": m.get("cuda_peak"), "num_params": m["num_params"]} for m in rows}
    skipped = sum(1 for m in res.metrics.get(0, []) if m.get("part") == "scaler" and m["overflow"])
    figures["scaler_steps_skipped"] = skipped
    ok = res.ok and len(rows) == 4 and all(figures[m["recipe"]]["cuda_peak"] for m in rows) and skipped > 0
    text = "; ".join(f"{m['recipe']}: {figures[m['recipe']]['state_bytes'] / m['num_params']:g} B/parameter counted, "
                     f"CUDA peak {(figures[m['recipe']]['cuda_peak'] or 0) / m['num_params']:.1f}" for m in rows)
    return ok, failed_run(res) or f"{text}; GradScaler skipped {skipped} step(s)", figures, res


# --- one chapter at its default sizes ---------------------------------------------------------------------
@needs(45)
def check_default_sizes():
    """Chapter 03's DDP training script and chapter 07b's precision script at their default sizes, 1 rank on the
    GPU (what the notebooks launch there): time per step, and torch.cuda.max_memory_allocated per recipe."""
    import statistics

    figures: dict = {}
    res03 = launch(SCRIPTS / "03_ddp_train.py", nproc=1, name="gpucheck-default-03", timeout=150)
    steps = [m for m in res03.metrics.get(0, []) if "step_ms" in m and m.get("mode") != "comm"]
    head = next((m for m in res03.metrics.get(0, []) if "params" in m), {})
    figures["03_ddp_train"] = {"status": res03.status, "backend": res03.manifest.get("backend"),
                               "params": head.get("params"), "batch": head.get("batch"), "hidden": head.get("hidden"),
                               "layers": head.get("layers"),
                               "median_step_ms": statistics.median(m["step_ms"] for m in steps) if steps else None,
                               "median_forward_ms": statistics.median(m["forward_ms"] for m in steps) if steps else None,
                               "median_backward_ms": statistics.median(m["backward_ms"] for m in steps) if steps else None,
                               "steps": len(steps), "error": failed_run(res03)}
    res07 = launch(SCRIPTS / "07b_precision.py", nproc=1, name="gpucheck-default-07", timeout=150)
    rows = [m for m in res07.metrics.get(0, []) if m.get("part") == "recipe"]
    figures["07b_precision"] = {"status": res07.status, "backend": res07.manifest.get("backend"),
                               "error": failed_run(res07),
                               "recipes": {m["recipe"]: {"num_params": m["num_params"], "cuda_peak": m.get("cuda_peak"),
                                                         "cuda_held": m.get("cuda_held")} for m in rows}}
    f3, f7 = figures["03_ddp_train"], figures["07b_precision"]
    text = (f"ch03 DDP defaults ({f3['params']} params, batch {f3['batch']}, {f3['backend']}): "
            + (f"{f3['median_step_ms']:.2f} ms/step (forward {f3['median_forward_ms']:.2f}, backward "
               f"{f3['median_backward_ms']:.2f})" if f3["median_step_ms"] else f"FAILED {f3['error']}")
            + "; ch07 precision defaults: "
            + (", ".join(f"{k} peak {human_bytes(v['cuda_peak'] or 0)}" for k, v in f7["recipes"].items())
               or f"FAILED {f7['error']}"))
    return res03.ok and res07.ok and bool(steps) and bool(rows), text, figures, res07


# --- chapter 05's pipeline schedules, one launch each ------------------------------------------------------
@needs(30)
def check_pipeline_schedules(schedules=None, nproc: int = 2):
    """Chapter 05's schedules script, one launch per schedule (by default every one the script knows; 2 gloo
    ranks on the CPU, as the chapter runs it beside a GPU): which schedules run on this machine's torch. The
    2026-11-26 run stopped in a schedule's first batch_isend_irecv ('Pair is not connected') without saying which."""
    if schedules is None:
        from ..exercises import load_file
        schedules = load_file(SCRIPTS / "05_schedules.py", "schedules_05").SCHEDULES
    figures, last = {}, None
    for name in schedules:
        res = last = launch(SCRIPTS / "05_schedules.py", nproc=nproc, name=f"gpucheck-05-{name}", timeout=120,
                             args=["--schedules", name, "--micro", "4", "--work-ms", "1", "--steps", "1"])
        figures[name] = {"status": res.status, "error": failed_run(res)}
    failed = [k for k, v in figures.items() if v["status"] != "ok"]
    text = (f"{len(schedules) - len(failed)} of {len(schedules)} schedules ran at {nproc} ranks"
            + (f"; failed: {', '.join(failed)} ({figures[failed[0]]['error'][:300]})" if failed else ""))
    return not failed, text, figures, last
