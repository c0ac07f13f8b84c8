"""`gpucourse gpu-check`: run every GPU path the course has on this machine's GPU(s), and write it up.

The course is built and tested on CPUs (gloo); the same code takes NCCL and CUDA tensors on GPUs. This
command is how a GPU claim gets made: each check below launches what a learner would launch (the doctor job,
the chapters' scripts, the notebooks) on the GPU, checks what came back, and the report (`docs/`, dated)
records the device, the versions, what passed and every figure measured. Nothing in it is typed in.

    gpucourse gpu-check                       every check, notebooks at smoke sizes
    gpucourse gpu-check --only capstone_mfu   one check (names: gpucourse gpu-check --list)
    gpucourse gpu-check --budget 520 --results out/results.jsonl   start no check once 520 s are spent; each
                                              outcome is appended to the JSONL as soon as it is known
    gpucourse gpu-check --report-from out/results.jsonl --report-dir out   the report of such a file (no GPU needed)

docs/gpu-run.sh runs it on a bare GPU machine (wheels, kernel, the checks in order of priority).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..argtypes import positive_int, positive_seconds
from ...run.paths import project_root
from ...models.units import human_bytes, human_percent, human_si

ROOT = project_root() or Path.cwd()
SCRIPTS = ROOT / "scripts"
DOCTOR_JOB = Path(__file__).parent.parent / "doctor_job.py"


class GpuCheckError(ValueError):
    """The request was wrong (no GPU here, an unknown check): one line, exit code 2."""


# --- time budget and results written as they come -----------------------------------------------------
_deadline: float | None = None  # time.time() after which no check (and no notebook) is started
_results: Path | None = None  # JSONL: one line per outcome, appended as soon as it is known

def needs(seconds: float):
    """Mark a check with the seconds it needs on one H100 (measured 2026-11-25 where a run exists, else estimated):
    it is not started when less than this is left of the budget (it would be cut off and say nothing)."""
    def mark(check):
        check.needs_s = seconds
        return check
    return mark


NOTEBOOK_MIN_S = 45  # a notebook is not started with less than this left

# What the report says was not checked, whatever ran (one line each).
NOT_CHECKED = ["Chapter 13's 3-D capstone (scripts/13_gpt_3d.py) on NCCL: its ranks stay on the CPU with gloo "
               "(gloo's send/recv failed on CUDA tensors, docs/gpu-report-2026-11-25.md), so no check runs it on GPUs."]


def seconds_left() -> float | None:
    """Seconds left of the time budget (--budget/--deadline), None without one."""
    return None if _deadline is None else _deadline - time.time()


def _emit(record: dict) -> None:
    """Append one record to the results file (if any) at once: a run cut off later still leaves it."""
    if _results is None:
        return
    with open(_results, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Outcome:
    name: str
    status: str  # "passed" | "failed" | "skipped" (not started: the time budget)
    summary: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    run: str | None = None  # run directory of the job it launched, if one


def _launch(script, **kw):
    from ...run.launcher import launch

    kw.setdefault("live", False)
    kw.setdefault("check", False)
    kw.setdefault("timeout", 300)
    return launch(script, **kw)


def _failed_run(res) -> str | None:
    return None if res.ok else res.summary().splitlines()[0] + (f" — {res.error.summary}" if res.error else "")


def _doctor_record(res, rank=0) -> dict:
    """What the doctor job logged on `rank`: the all-reduce's sum, backend and device."""
    return next((m for m in res.metrics.get(rank, []) if "device" in m), {})


# --- the checks: each returns (passed, summary, figures[, result]) ---------------------------------------
@needs(10)
def check_nccl_one_rank():
    """The doctor job (an all-reduce with a known answer) at 1 rank on NCCL."""
    res = _launch(DOCTOR_JOB, nproc=1, backend="nccl", name="gpucheck-nccl")
    setup = _doctor_record(res)
    ok = res.ok and setup.get("backend") == "nccl" and str(setup.get("device", "")).startswith("cuda")
    return ok, _failed_run(res) or f"1 rank, backend {setup.get('backend')}, device {setup.get('device')}", \
        {"backend": setup.get("backend"), "device": setup.get("device")}, res


@needs(12)
def check_gloo_ranks_share_a_gpu(nproc: int = 4):
    """More ranks than GPUs: gloo, each rank's tensors on the (shared) GPU, the all-reduce still exact."""
    res = _launch(DOCTOR_JOB, nproc=nproc, backend="gloo", name="gpucheck-gloo-cuda")
    devices = {r: _doctor_record(res, r).get("device") for r in range(nproc)}
    ok = res.ok and all(str(d).startswith("cuda") for d in devices.values())
    return ok, _failed_run(res) or f"{nproc} ranks on gloo, devices {sorted(set(map(str, devices.values())))}", \
        {"devices": devices}, res


@needs(1)
def check_nccl_refused_beyond_gpus():
    """Asking NCCL for more ranks than GPUs is refused before anything starts, with a message that says why."""
    from ...run.hardware import gpu_count
    from ...run.launcher import LaunchConfigError

    n = gpu_count() + 1
    try:
        res = _launch(DOCTOR_JOB, nproc=n, backend="nccl", name="gpucheck-nccl-too-many")
    except LaunchConfigError as err:
        return True, f"{n} ranks on NCCL refused: {err}", {"message": str(err)}
    return False, f"{n} ranks on NCCL were started ({res.status}) instead of refused", {}, res


@needs(17)
def check_cuda_trace():
    """A profiled DDP step on the GPU: CUDA kernels, NCCL kernels and streams read back by gpucourse.models.traces."""
    from ...viz.timeline import timeline_plot
    from ...models.traces import analyze_run, load_trace

    res = _launch(SCRIPTS / "03_ddp_train.py", nproc=1, backend="nccl", name="gpucheck-trace",
                  args=["--steps", "5", "--warmup", "2", "--profile-steps", "3"])
    if not res.ok:
        return False, _failed_run(res), {}, res
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


@needs(2)
def check_data_parallel():
    """nn.DataParallel on the GPU(s) gives the same output and gradients as the plain module."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    x = torch.randn(32, 64, device="cuda")
    net(x).square().mean().backward()
    plain = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    dp = nn.DataParallel(net)
    out = dp(x)
    out.square().mean().backward()
    diff = max((p.grad - g).abs().max().item() for p, g in zip(net.parameters(), plain))
    ok = diff < 1e-5 and out.device.type == "cuda"
    return ok, f"{torch.cuda.device_count()} GPU(s): largest gradient difference from the plain module {diff:.2e}", \
        {"max_grad_diff": diff, "gpus": torch.cuda.device_count()}


@needs(19)
def check_bf16_autocast_ddp():
    """Chapter 02's precision script on the GPU: fp32, bf16 autocast and the bf16/fp16 compression hooks."""
    res = _launch(SCRIPTS / "02_precision.py", nproc=1, backend="nccl", name="gpucheck-precision")
    rows = [m for m in res.metrics.get(0, []) if "mode" in m]
    figures = {"modes": {m["mode"]: {k: v for k, v in m.items() if k not in ("rank", "time", "mode")} for m in rows}}
    ok = res.ok and {"fp32", "autocast"} <= set(figures["modes"])
    return ok, _failed_run(res) or f"modes run: {', '.join(figures['modes'])}", figures, res


@needs(18)
def check_fsdp_memory(width: int = 2048, depth: int = 8):
    """Chapter 07's memory script on the GPU: the allocator's peak per mode beside the counted state bytes."""
    res = _launch(SCRIPTS / "07_memory.py", nproc=1, backend="nccl", name="gpucheck-memory",
                  args=["--modes", "ddp", "zero1", "fsdp2", "--width", str(width), "--depth", str(depth)])
    rows = [m for m in res.metrics.get(0, []) if "mode" in m]
    figures = {m["mode"]: {"state_bytes": m["params"] + m["grads"] + m["optimizer"], "cuda_peak": m.get("cuda_peak"),
                           "peak_over_state": (m["cuda_peak"] / (m["params"] + m["grads"] + m["optimizer"])
                                               if m.get("cuda_peak") else None)} for m in rows}
    ok = res.ok and rows and all(v["cuda_peak"] for v in figures.values())
    text = "; ".join(f"{k}: state {human_bytes(v['state_bytes'])}, CUDA peak {human_bytes(v['cuda_peak'])}"
                     for k, v in figures.items() if v["cuda_peak"])
    return ok, _failed_run(res) or text, figures, res


@needs(20)
def check_precision_recipes(width: int = 2048, depth: int = 8):
    """Chapter 07b's mixed-precision script on the GPU: each recipe's counted bytes (checked against the formula in
    the run) beside torch.cuda.max_memory_allocated; fp16 autocast with GradScaler("cuda") skipping and halving."""
    res = _launch(SCRIPTS / "07b_precision.py", nproc=1, backend="nccl", name="gpucheck-precision-recipes",
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
    return ok, _failed_run(res) or f"{text}; GradScaler skipped {skipped} step(s)", figures, res


def _capstone(name: str, sizes: dict, steps: int, warmup: int, extra=(), timeout: float = 540):
    """Launch the capstone GPT (1 rank, NCCL, bf16, profiled) and read back its figures: (result, figures)."""
    import torch

    from ...models import costs

    args = ["--dp-mode", "allreduce", "--d-model", sizes["d_model"], "--layers", sizes["layers"],
            "--heads", sizes["heads"], "--context", sizes["context"], "--batch", sizes["batch"], "--steps", steps,
            "--warmup-steps", warmup, "--dtype", "bfloat16", "--eval-batches", 0, "--sample", 0, "--profile", 2,
            *extra]
    res = _launch(SCRIPTS / "09_gpt_2d.py", nproc=1, backend="nccl", name=name, timeout=timeout, args=args)
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
        return False, _failed_run(res), {}, res
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
            figures[variant] = {"failed": _failed_run(res), "run": str(res.run_dir)}
            texts.append(f"{variant}: FAILED ({_failed_run(res)})")
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


def _pick_notebooks(books: list[Path], only: list[str] | None) -> list[Path]:
    """The notebooks to run, in the order of `only`'s prefixes (all of them, in order, without)."""
    if not only:
        return list(books)
    picked: list[Path] = []
    for prefix in only:
        picked += [b for b in books if b.stem.startswith(prefix) and b not in picked]
    return picked


def _notebook_row(run) -> dict:
    return {"status": run.status, "seconds": round(run.duration, 1), "failing_cell": run.failing_cell,
            "error": run.error[:2000]}


@needs(60)
def check_notebooks(smoke: bool = True, only: list[str] | None = None, output: Path | None = None,
                    workers: int = 1):
    """Chapter notebooks executed with papermill on this machine (the launcher picks NCCL or gloo); `only` runs
    the notebooks whose names start so, in that order; `workers` > 1 runs that many at once (kernels apart)."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import get_context

    from ..course import execute_notebook, find_notebooks

    output = output or ROOT / "executed" / "gpu-check"
    todo, rows = _pick_notebooks(find_notebooks(), only), {}

    def done(path, row):
        rows[path.stem] = row
        print(f"  {path.stem}: {row['status']} in {row.get('seconds', 0):.0f} s {row.get('error', '')[:300]}",
              flush=True)
        _emit({"progress": "notebooks", "notebook": path.stem, **row})

    def cell_timeout():
        left = seconds_left()
        return 600 if left is None else int(max(60, min(600, left)))  # papermill takes whole seconds

    def may_start(path) -> bool:
        left = seconds_left()
        if left is not None and left < NOTEBOOK_MIN_S:
            done(path, {"status": "skipped", "seconds": 0, "error": f"not started: {left:.0f} s of the budget left"})
            return False
        return True

    if workers <= 1:
        for path in todo:
            if may_start(path):
                done(path, _notebook_row(execute_notebook(path, output, smoke=smoke, cell_timeout=cell_timeout())))
    else:  # processes, not threads: each papermill run has its own event loop and kernel manager
        queue = list(todo)
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            running = {}
            while queue or running:
                while queue and len(running) < workers:
                    path = queue.pop(0)
                    if may_start(path):
                        running[pool.submit(execute_notebook, path, output, smoke=smoke,
                                            cell_timeout=cell_timeout())] = path
                if not running:
                    continue
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    path = running.pop(future)
                    try:
                        done(path, _notebook_row(future.result()))
                    except Exception as err:  # the worker process died: that notebook failed, the rest go on
                        done(path, {"status": "failed", "seconds": 0, "failing_cell": None,
                                    "error": f"{type(err).__name__}: {err}"})
    rows = {p.stem: rows[p.stem] for p in todo if p.stem in rows}  # in the order asked
    ran = [r for r in rows.values() if r["status"] != "skipped"]
    passed = sum(r["status"] == "ok" for r in ran)
    skipped = len(rows) - len(ran)
    text = (f"{passed} of {len(ran)} notebooks ran to the end ({'smoke' if smoke else 'default'} sizes"
            + (f", {workers} at a time" if workers > 1 else "") + ")"
            + (f"; {skipped} not started (time budget)" if skipped else ""))
    failed = [f"{k} (cell {r['failing_cell']}: {r['error'][:160]})" for k, r in rows.items() if r["status"] == "failed"]
    return passed == len(rows) > 0, text + ("; failed: " + "; ".join(failed) if failed else ""), rows


# --- graders on the GPU machine -----------------------------------------------------------------------
GRADED = ("ex02_ddp", "ex06_tensor_parallel", "ex07_sharded_optimizer", "ex07_fsdp")


def job_devices(runs_dir: Path) -> list[dict]:
    """Every run under `runs_dir`: its name, status, world size, the launcher's backend and device (manifest),
    and each rank's own backend and device as runtime.setup() recorded them (metrics/rank<r>.jsonl)."""
    from ...run.contract import EVENT_SETUP, manifest_file, metrics_files

    jobs = []
    for run in sorted(p for p in Path(runs_dir).iterdir() if p.is_dir()) if Path(runs_dir).is_dir() else []:
        try:
            manifest = json.loads(manifest_file(run).read_text())
        except (OSError, ValueError):
            continue
        ranks = {}
        for rank, path in metrics_files(run).items():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == EVENT_SETUP:
                    ranks[rank] = {"backend": rec.get("backend"), "device": rec.get("device")}
                    break
        jobs.append({"name": manifest.get("name", run.name), "status": manifest.get("status"),
                     "world_size": manifest.get("world_size"), "backend": manifest.get("backend"),
                     "launcher_device": manifest.get("planned_device", manifest.get("device")),
                     "rank_devices": sorted({str(r["device"]) for r in ranks.values()}),
                     "rank_backends": sorted({str(r["backend"]) for r in ranks.values()})})
    return jobs


def _job_exercise(job_name: str, exercises) -> str | None:
    """Which exercise a grading job's run belongs to: 'grade-ex07-fsdp-w2-...' -> 'ex07_fsdp' (longest match)."""
    name = job_name.lower().replace("_", "-")
    best = None
    for ex in exercises:
        num, _, rest = ex.partition("_")
        words = [num] + rest.split("_")
        # the run names use the exercise number and, where one chapter has two exercises, its first word
        for n in range(len(words), 0, -1):
            tag = "-".join(words[:n])
            if f"-{tag}-" in f"-{name}-" or name.startswith(f"grade-{tag}"):
                if best is None or n > best[1]:
                    best = (ex, n)
                break
    return best[0] if best else None


@needs(120)
def check_graders(exercises=GRADED, target: str = "solutions", workers: int = 4):
    """`gpucourse grade EX --target solutions` for the GPU-relevant exercises, on this machine (full marks
    expected); which backend and device each grading job's ranks used, read from its runs."""
    from concurrent.futures import ThreadPoolExecutor

    from .. import grading
    from ...run.contract import RUNS_ENV

    runs = Path(tempfile.mkdtemp(prefix="gpucheck-grade-"))
    before = os.environ.get(RUNS_ENV)
    os.environ[RUNS_ENV] = str(runs)  # the grading subprocess keeps its jobs' runs there (read below)
    figures: dict = {}
    try:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            futures = {ex: pool.submit(grading.grade, ex, target) for ex in exercises}
            for ex, future in futures.items():
                try:
                    report = future.result()
                    figures[ex] = {"score": report.score, "max_score": report.max_score, "problems": report.problems,
                                   "seconds": round(report.duration, 1),
                                   "not_passed": [f"{t.name}: {t.outcome} {t.why}"[:300] for t in report.tests
                                                  if not t.passed]}
                except Exception as err:
                    figures[ex] = {"error": f"{type(err).__name__}: {err}"[:1000]}
                print(f"  {ex}: {figures[ex]}", flush=True)
    finally:
        if before is None:
            os.environ.pop(RUNS_ENV, None)
        else:
            os.environ[RUNS_ENV] = before
    jobs = job_devices(runs)
    for job in jobs:
        ex = _job_exercise(job["name"], exercises)
        figures.setdefault(ex or "unattributed", {}).setdefault("jobs", []).append(job)
    figures["runs_dir"] = str(runs)
    ok = all(f.get("score") == f.get("max_score") and f.get("max_score") and not f.get("problems")
             for ex, f in figures.items() if ex in exercises)
    texts = []
    for ex in exercises:
        f = figures.get(ex, {})
        used = sorted({f"{j['backend']}/{','.join(j['rank_devices']) or '?'}" for j in f.get("jobs", [])})
        score = f"{f['score']:g}/{f['max_score']:g}" if "score" in f else f.get("error", "no result")[:200]
        texts.append(f"{ex} {score} ({'; '.join(used) or 'no jobs seen'})")
    return ok, "; ".join(texts), figures


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


# --- chapter 07's SIGSEGV: gloo ranks sharing a GPU with CUDA tensors ----------------------------------------
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)[^\n]*\(most recent call first\):", re.M)
_FH_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')


def faulthandler_stacks(text: str) -> list[dict]:
    """The Python stacks faulthandler printed after a fatal signal, one per thread, innermost frame first:
    [{"thread", "current", "frames": [{"file", "line", "function"}]}]; [] when there is none."""
    start = text.find("Fatal Python error")
    if start < 0:
        return []
    chunk = text[start:]
    heads = list(_FH_THREAD.finditer(chunk))
    stacks = []
    for i, head in enumerate(heads):
        body = chunk[head.end():heads[i + 1].start() if i + 1 < len(heads) else len(chunk)]
        frames = []
        for line in body.splitlines()[1:]:
            m = _FH_FRAME.match(line)
            if m:
                frames.append({"file": m.group(1), "line": int(m.group(2)), "function": m.group(3)})
            elif line.strip() and not line.strip().startswith("<"):
                break  # the end of this stack ("Extension modules: ..." and the like)
        stacks.append({"thread": head.group(2), "current": head.group(1) == "Current thread", "frames": frames})
    return stacks


def innermost_distributed_call(stacks: list[dict]) -> dict | None:
    """The innermost torch.distributed frame, in the crashing (current) thread if it has one, else in any thread,
    with the course script's own innermost frame beside it."""
    for stack in sorted(stacks, key=lambda s: not s["current"]):
        for i, frame in enumerate(stack["frames"]):
            if "torch/distributed" in frame["file"].replace("\\", "/"):
                own = next((f for f in stack["frames"][i:] if "site-packages" not in f["file"]
                            and "/torch/" not in f["file"]), None)
                return {"call": f"{frame['function']} ({frame['file'].split('site-packages/')[-1]}:{frame['line']})",
                        "thread": "crashing thread" if stack["current"] else f"thread {stack['thread']}",
                        "from": f"{own['function']} ({Path(own['file']).name}:{own['line']})" if own else None}
    return None


SEGV_MODES = ("ddp", "zero1", "sharded", "fsdp2", "fsdp")


@needs(40)
def check_gloo_cuda_segv(runs: int = 3, nproc: int = 2, width: int = 128, depth: int = 4, steps: int = 2):
    """Chapter 07's ZeRO/FSDP script with gloo ranks sharing the GPU and holding CUDA tensors (--cuda-with-gloo),
    faulthandler on: the crashing rank's Python stack names the collective. Up to `runs` runs, until one crashes."""
    figures: dict = {"runs": []}
    diagnosis = None
    for i in range(runs):
        left = seconds_left()
        if i and left is not None and left < 20:
            break
        res = _launch(SCRIPTS / "07_memory.py", nproc=nproc, backend="gloo", name=f"gpucheck-gloo-cuda-segv-{i}",
                      timeout=120, env={"PYTHONFAULTHANDLER": "1"},
                      args=["--cuda-with-gloo", "--modes", *SEGV_MODES, "--width", width, "--depth", depth,
                            "--steps", steps])
        run = {"run": str(res.run_dir), "status": res.status, "error": str(res.error)[:500] if res.error else None,
               "modes_done": [m["mode"] for m in res.metrics.get(0, []) if "mode" in m], "ranks": {}}
        for rank in range(nproc):
            err = res.log(rank, "stderr")
            stacks = faulthandler_stacks(err)
            call = innermost_distributed_call(stacks)
            run["ranks"][rank] = {"fatal": next((ln for ln in err.splitlines() if ln.startswith("Fatal Python error")),
                                                None), "call": call,
                                  "stack": [f"{Path(f['file']).name}:{f['line']} {f['function']}"
                                            for s in stacks if s["current"] for f in s["frames"]][:25],
                                  "other_threads": [[f"{Path(f['file']).name}:{f['line']} {f['function']}"
                                                     for f in s["frames"][:8]] for s in stacks if not s["current"]][:4]}
            if call and diagnosis is None:
                diagnosis = (f"run {i + 1}: rank {rank} died ({run['ranks'][rank]['fatal']}) in {call['call']}"
                             f", called from {call['from']}, in the {call['thread']}; modes finished before it: "
                             f"{', '.join(run['modes_done']) or 'none'}")
        with_devices = job_devices(res.run_dir.parent)
        run["rank_devices"] = next((j["rank_devices"] for j in with_devices if j["name"] == res.run_dir.name), [])
        figures["runs"].append(run)
        print(f"  run {i + 1}: {res.status}, modes done {run['modes_done']}, devices {run['rank_devices']}", flush=True)
        if not res.ok:
            break
    figures["diagnosis"] = diagnosis
    last = figures["runs"][-1] if figures["runs"] else {}
    if diagnosis:
        return True, diagnosis, figures
    if figures["runs"] and all(r["status"] == "ok" for r in figures["runs"]):
        return True, (f"did not crash in {len(figures['runs'])} run(s) of {nproc} gloo ranks with CUDA tensors "
                      f"(devices {last.get('rank_devices')}), modes {', '.join(SEGV_MODES)}"), figures
    return False, f"failed without a faulthandler stack: {last.get('status')} {last.get('error')}", figures


# --- one chapter at its default sizes ---------------------------------------------------------------------
@needs(45)
def check_default_sizes():
    """Chapter 03's DDP training script and chapter 07b's precision script at their default sizes, 1 rank on the
    GPU (what the notebooks launch there): time per step, and torch.cuda.max_memory_allocated per recipe."""
    import statistics

    figures: dict = {}
    res03 = _launch(SCRIPTS / "03_ddp_train.py", nproc=1, name="gpucheck-default-03", timeout=150)
    steps = [m for m in res03.metrics.get(0, []) if "step_ms" in m and m.get("mode") != "comm"]
    head = next((m for m in res03.metrics.get(0, []) if "params" in m), {})
    figures["03_ddp_train"] = {"status": res03.status, "backend": res03.manifest.get("backend"),
                               "params": head.get("params"), "batch": head.get("batch"), "hidden": head.get("hidden"),
                               "layers": head.get("layers"),
                               "median_step_ms": statistics.median(m["step_ms"] for m in steps) if steps else None,
                               "median_forward_ms": statistics.median(m["forward_ms"] for m in steps) if steps else None,
                               "median_backward_ms": statistics.median(m["backward_ms"] for m in steps) if steps else None,
                               "steps": len(steps), "error": _failed_run(res03)}
    res07 = _launch(SCRIPTS / "07b_precision.py", nproc=1, name="gpucheck-default-07", timeout=150)
    rows = [m for m in res07.metrics.get(0, []) if m.get("part") == "recipe"]
    figures["07b_precision"] = {"status": res07.status, "backend": res07.manifest.get("backend"),
                               "error": _failed_run(res07),
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
        res = last = _launch(SCRIPTS / "09_gpt_2d.py", nproc=1, backend="nccl", name=f"gpucheck-dryrun-{mode}",
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
               "run_error": _failed_run(res)}
        if real and predicted:
            fig["predicted_over_real"] = predicted / real[-1]
            texts.append(f"{mode}: predicted {human_bytes(predicted)}, allocator {human_bytes(real[-1])} "
                         f"(last of {len(real)} steps): {fig['predicted_over_real']:.3f}x")
        else:
            texts.append(f"{mode}: FAILED ({fig['run_error'] or parts.get('error', 'no peak logged')})")
        figures[mode] = fig
    ok = all("predicted_over_real" in f for f in figures.values())
    return ok, "; ".join(texts), figures, last


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
        res = last = _launch(SCRIPTS / "05_schedules.py", nproc=nproc, name=f"gpucheck-05-{name}", timeout=120,
                             args=["--schedules", name, "--micro", "4", "--work-ms", "1", "--steps", "1"])
        figures[name] = {"status": res.status, "error": _failed_run(res)}
    failed = [k for k, v in figures.items() if v["status"] != "ok"]
    text = (f"{len(schedules) - len(failed)} of {len(schedules)} schedules ran at {nproc} ranks"
            + (f"; failed: {', '.join(failed)} ({figures[failed[0]]['error'][:300]})" if failed else ""))
    return not failed, text, figures, last


CHECKS = {"notebooks": check_notebooks, "graders": check_graders, "capstone_compiled": check_capstone_compiled,
          "fp8": check_fp8, "gloo_cuda_segv": check_gloo_cuda_segv, "default_sizes": check_default_sizes,
          "nccl_one_rank": check_nccl_one_rank, "gloo_ranks_share_a_gpu": check_gloo_ranks_share_a_gpu,
          "nccl_refused_beyond_gpus": check_nccl_refused_beyond_gpus, "cuda_trace": check_cuda_trace,
          "data_parallel": check_data_parallel, "bf16_autocast_ddp": check_bf16_autocast_ddp,
          "fsdp_memory": check_fsdp_memory, "precision_recipes": check_precision_recipes,
          "capstone_mfu": check_capstone_mfu, "dryrun_memory": check_dryrun_memory,
          "pipeline_schedules": check_pipeline_schedules}


def run_check(name: str, **kwargs) -> Outcome:
    """Run one check; an exception inside it is its failure (with the traceback's last line), never a crash."""
    start = time.monotonic()
    try:
        passed, summary, figures, *rest = CHECKS[name](**kwargs)
    except Exception as err:
        tb = traceback.format_exc().strip().splitlines()
        return Outcome(name, "failed", f"{type(err).__name__}: {err} ({tb[-3].strip() if len(tb) > 2 else ''})",
                       time.monotonic() - start, {"traceback": tb[-40:]})
    run = str(rest[0].run_dir) if rest and hasattr(rest[0], "run_dir") else None
    return Outcome(name, "passed" if passed else "failed", summary, time.monotonic() - start, figures, run)


# --- the report ----------------------------------------------------------------------------------------
def environment() -> dict:
    """What ran it: device, driver, versions (nvidia-smi where it answers)."""
    import platform

    from ...run.hardware import hardware_report

    hw = hardware_report()
    driver = ""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {"gpus": [g["name"] for g in hw.gpus], "gpu_memory_gib": [round(g["memory_gib"], 1) for g in hw.gpus],
            "driver": driver or "unknown", "torch": hw.torch_version, "cuda": hw.cuda_version,
            "nccl": hw.nccl_version, "python": platform.python_version(), "cpus": hw.cpus}


def write_report(outcomes: list[Outcome], env: dict, folder: Path, when: _dt.datetime | None = None) -> Path:
    """docs/gpu-check-YYYY-MM-DD[-N].md (and .json beside it); an existing report is never overwritten."""
    when = when or _dt.datetime.now(_dt.timezone.utc)
    folder.mkdir(parents=True, exist_ok=True)
    stem, n = f"gpu-check-{when:%Y-%m-%d}", 1
    while (folder / f"{stem}.md").exists() or (folder / f"{stem}.json").exists():
        n += 1
        stem = f"gpu-check-{when:%Y-%m-%d}-{n}"
    passed = sum(o.status == "passed" for o in outcomes)
    skipped = sum(o.status == "skipped" for o in outcomes)
    lines = [f"# GPU check, {when:%Y-%m-%d %H:%M} UTC", "",
             f"Written by `gpucourse gpu-check` on {', '.join(env['gpus']) or 'no GPU'} "
             f"({', '.join(f'{m} GiB' for m in env['gpu_memory_gib'])}), driver {env['driver']}, torch {env['torch']}, "
             f"CUDA {env['cuda']}, NCCL {env['nccl']}, Python {env['python']}, {env['cpus']} CPUs. "
             f"{passed} of {len(outcomes)} checks passed"
             + (f" ({skipped} not started: the time budget was spent)" if skipped else "")
             + ". Every figure below was measured in this run.", "",
             "| check | status | what it showed | seconds |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        lines.append(f"| `{o.name}` | {o.status} | {o.summary.replace('|', '/')} | {o.seconds:.0f} |")
    lines += ["", "## Not checked", ""] + [f"- {line}" for line in NOT_CHECKED]
    lines += ["", "## What each check runs", ""]
    lines += [f"- `{name}`: {' '.join(CHECKS[name].__doc__.split()) if name in CHECKS else '(unknown check)'}"
              for name in dict.fromkeys(o.name for o in outcomes)]
    keys: dict[str, int] = {}
    figures = {}
    for o in outcomes:  # a check run twice (notebooks in two parts) keeps both: "notebooks", "notebooks #2"
        keys[o.name] = keys.get(o.name, 0) + 1
        figures[o.name if keys[o.name] == 1 else f"{o.name} #{keys[o.name]}"] = o.figures
    lines += ["", "## Figures", "", "```json", json.dumps(figures, indent=1, default=str), "```", ""]
    (folder / f"{stem}.md").write_text("\n".join(lines))
    (folder / f"{stem}.json").write_text(json.dumps({"when": when.isoformat(), "environment": env,
                                                     "checks": [asdict(o) for o in outcomes]}, indent=1, default=str))
    return folder / f"{stem}.md"


def read_results(path: Path) -> tuple[dict, list[Outcome]]:
    """The environment and the outcomes a results file (--results) holds, in the order they were written;
    a torn last line (a run cut off mid-write) is left out."""
    env, outcomes = {}, []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "environment" in rec:
            env = rec["environment"] or env
        elif "outcome" in rec:
            outcomes.append(Outcome(**rec["outcome"]))
    return env, outcomes


EMPTY_ENV = {"gpus": [], "gpu_memory_gib": [], "driver": "unknown", "torch": "?", "cuda": "?", "nccl": "?",
             "python": "?", "cpus": "?"}


def main(args) -> int:
    global _deadline, _results

    if args.list:
        for name, fn in CHECKS.items():
            print(f"{name:26} ~{fn.needs_s:>3} s  {fn.__doc__.strip().splitlines()[0]}")
        return 0
    if args.report_from:
        if not Path(args.report_from).is_file():
            raise GpuCheckError(f"--report-from {args.report_from}: no such file (a --results file of gpu-check)")
        env, outcomes = read_results(Path(args.report_from))
        report = write_report(outcomes, {**EMPTY_ENV, **env}, Path(args.report_dir))
        print(f"report of {len(outcomes)} outcome(s): {report}")
        return 0 if outcomes and all(o.status == "passed" for o in outcomes) else 1
    import torch

    names = args.only or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise GpuCheckError(f"no check named {', '.join(unknown)}; the checks are: {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        raise GpuCheckError("no CUDA GPU is visible to this PyTorch (torch.cuda.is_available() is False): gpu-check "
                            "validates the course's GPU paths, so run it on a machine with a GPU; nothing was written")
    ends = [t for t in (args.deadline, time.time() + args.budget if args.budget else None) if t]
    _deadline = min(ends) if ends else None
    _results = Path(args.results) if args.results else None
    if _results:
        _results.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    _emit({"environment": env, "pid": os.getpid(), "checks": names})
    print(f"gpu-check on {', '.join(env['gpus'])}: {len(names)} check(s)"
          + (f", {seconds_left():.0f} s of budget" if _deadline else ""), flush=True)
    outcomes = []
    for name in names:
        left, need = seconds_left(), getattr(CHECKS[name], "needs_s", 30)
        if left is not None and left < need:
            outcome = Outcome(name, "skipped", f"not started: {max(left, 0):.0f} s of the time budget left, "
                                               f"it needs about {need} s")
        else:
            print(f"- {name} ...", flush=True)
            kwargs = {}
            if name == "notebooks":
                kwargs = {"smoke": args.notebooks == "smoke", "workers": args.notebook_workers}
                if args.notebook:
                    kwargs["only"] = args.notebook
            outcome = run_check(name, **kwargs)
        print(f"  {outcome.status} in {outcome.seconds:.0f} s: {outcome.summary}", flush=True)
        _emit({"outcome": asdict(outcome)})
        outcomes.append(outcome)
    report = write_report(outcomes, env, Path(args.report_dir))
    print(f"report: {report}")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


def _epoch(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"expected seconds since the epoch (date +%s), got {text!r}") from None


def add_cli(sub) -> None:
    p = sub.add_parser("gpu-check", help="run the course's GPU paths on this machine's GPU and write a dated report")
    p.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks, in this order (see --list)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--notebooks", choices=["smoke", "default"], default="smoke",
                   help="sizes for the notebooks check (default: smoke)")
    p.add_argument("--notebook", nargs="+", metavar="PREFIX",
                   help="only the notebooks whose name starts so, run in this order")
    p.add_argument("--notebook-workers", type=positive_int, default=1,
                   help="notebooks executed at once (default 1)")
    p.add_argument("--budget", type=positive_seconds, metavar="S",
                   help="start no check (nor notebook) once S seconds are spent, or when the check would not fit; "
                        "the report lists the ones not started")
    p.add_argument("--deadline", type=_epoch, metavar="EPOCH",
                   help="the same, as a time (date +%%s): several gpu-check runs can share one budget")
    p.add_argument("--results", metavar="FILE",
                   help="append each check's outcome to this JSONL file as soon as it is known")
    p.add_argument("--report-from", metavar="FILE",
                   help="run nothing: write the report of a --results file (all the outcomes it holds)")
    p.add_argument("--report-dir", default=str(ROOT / "docs"), help="where the dated report goes (default docs/)")
    p.set_defaults(func=main)
