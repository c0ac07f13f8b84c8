"""`gpucourse gpu-check`: run every GPU path the course has on this machine's GPU(s), and write it up.

The course is built and tested on CPUs (gloo); the same code takes NCCL and CUDA tensors on GPUs. This
command is how a GPU claim gets made: each check below launches what a learner would launch (the doctor job,
the chapters' scripts, the notebooks) on the GPU, checks what came back, and the report (`docs/`, dated)
records the device, the versions, what passed and every figure measured. Nothing in it is typed in.

    gpucourse gpu-check                       every check, notebooks at smoke sizes
    gpucourse gpu-check --only capstone_mfu   one check (names: gpucourse gpu-check --list)
"""
from __future__ import annotations

import datetime as _dt
import json
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .paths import project_root

ROOT = project_root() or Path.cwd()
SCRIPTS = ROOT / "scripts"
DOCTOR_JOB = Path(__file__).with_name("doctor_job.py")


class GpuCheckError(ValueError):
    """The request was wrong (no GPU here, an unknown check): one line, exit code 2."""


@dataclass
class Outcome:
    name: str
    status: str  # "passed" | "failed"
    summary: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    run: str | None = None  # run directory of the job it launched, if one


def _launch(script, **kw):
    from .launcher import launch

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
def check_nccl_one_rank():
    """The doctor job (an all-reduce with a known answer) at 1 rank on NCCL."""
    res = _launch(DOCTOR_JOB, nproc=1, backend="nccl", name="gpucheck-nccl")
    setup = _doctor_record(res)
    ok = res.ok and setup.get("backend") == "nccl" and str(setup.get("device", "")).startswith("cuda")
    return ok, _failed_run(res) or f"1 rank, backend {setup.get('backend')}, device {setup.get('device')}", \
        {"backend": setup.get("backend"), "device": setup.get("device")}, res


def check_gloo_ranks_share_a_gpu(nproc: int = 4):
    """More ranks than GPUs: gloo, each rank's tensors on the (shared) GPU, the all-reduce still exact."""
    res = _launch(DOCTOR_JOB, nproc=nproc, backend="gloo", name="gpucheck-gloo-cuda")
    devices = {r: _doctor_record(res, r).get("device") for r in range(nproc)}
    ok = res.ok and all(str(d).startswith("cuda") for d in devices.values())
    return ok, _failed_run(res) or f"{nproc} ranks on gloo, devices {sorted(set(map(str, devices.values())))}", \
        {"devices": devices}, res


def check_nccl_refused_beyond_gpus():
    """Asking NCCL for more ranks than GPUs is refused before anything starts, with a message that says why."""
    from .hardware import gpu_count
    from .launcher import LaunchConfigError

    n = gpu_count() + 1
    try:
        res = _launch(DOCTOR_JOB, nproc=n, backend="nccl", name="gpucheck-nccl-too-many")
    except LaunchConfigError as err:
        return True, f"{n} ranks on NCCL refused: {err}", {"message": str(err)}
    return False, f"{n} ranks on NCCL were started ({res.status}) instead of refused", {}, res


def check_cuda_trace():
    """A profiled DDP step on the GPU: CUDA kernels, NCCL kernels and streams read back by gpucourse.traces."""
    from .timeline import timeline_plot
    from .traces import analyze_run, load_trace

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


def check_bf16_autocast_ddp():
    """Chapter 02's precision script on the GPU: fp32, bf16 autocast and the bf16/fp16 compression hooks."""
    res = _launch(SCRIPTS / "02_precision.py", nproc=1, backend="nccl", name="gpucheck-precision")
    rows = [m for m in res.metrics.get(0, []) if "mode" in m]
    figures = {"modes": {m["mode"]: {k: v for k, v in m.items() if k not in ("rank", "time", "mode")} for m in rows}}
    ok = res.ok and {"fp32", "autocast"} <= set(figures["modes"])
    return ok, _failed_run(res) or f"modes run: {', '.join(figures['modes'])}", figures, res


def check_fsdp_memory(width: int = 2048, depth: int = 8):
    """Chapter 07's memory script on the GPU: the allocator's peak per mode beside the counted state bytes."""
    res = _launch(SCRIPTS / "07_memory.py", nproc=1, backend="nccl", name="gpucheck-memory",
                  args=["--modes", "ddp", "zero1", "fsdp2", "--width", str(width), "--depth", str(depth)])
    rows = [m for m in res.metrics.get(0, []) if "mode" in m]
    figures = {m["mode"]: {"state_bytes": m["params"] + m["grads"] + m["optimizer"], "cuda_peak": m.get("cuda_peak"),
                           "peak_over_state": (m["cuda_peak"] / (m["params"] + m["grads"] + m["optimizer"])
                                               if m.get("cuda_peak") else None)} for m in rows}
    ok = res.ok and rows and all(v["cuda_peak"] for v in figures.values())
    text = "; ".join(f"{k}: state {v['state_bytes'] / 2**20:.0f} MiB, CUDA peak {v['cuda_peak'] / 2**20:.0f} MiB"
                     for k, v in figures.items() if v["cuda_peak"])
    return ok, _failed_run(res) or text, figures, res


def check_precision_recipes(width: int = 2048, depth: int = 8):
    """Chapter 07's mixed-precision script on the GPU: each recipe's counted bytes (checked against the formula in
    the run) beside torch.cuda.max_memory_allocated; fp16 autocast with GradScaler("cuda") skipping and halving."""
    res = _launch(SCRIPTS / "07_precision.py", nproc=1, backend="nccl", name="gpucheck-precision-recipes",
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


def check_capstone_mfu(d_model: int = 2048, layers: int = 8, heads: int = 16, context: int = 1024,
                       batch: int = 32, steps: int = 12):
    """The capstone GPT on one GPU in bf16: tokens/s, and MFU from gpucourse.costs (model FLOPs, dense peak)."""
    import torch

    from . import costs

    res = _launch(SCRIPTS / "09_gpt_2d.py", nproc=1, backend="nccl", name="gpucheck-mfu", timeout=540,
                  args=["--dp-mode", "allreduce", "--d-model", d_model, "--layers", layers, "--heads", heads,
                        "--context", context, "--batch", batch, "--steps", steps, "--warmup-steps", 4,
                        "--dtype", "bfloat16", "--eval-batches", 0, "--sample", 0, "--profile", 2])
    if not res.ok:
        return False, _failed_run(res), {}, res
    header = next(m for m in res.metrics[0] if m.get("header"))
    summary = next(m for m in res.metrics[0] if m.get("summary"))
    achieved = summary["tokens_per_s"] * header["flops_per_token"]
    device = torch.cuda.get_device_name(0)
    figures = {"device": device, "params": header["params"], "flops_per_token": header["flops_per_token"],
               "tokens_per_s": summary["tokens_per_s"], "achieved_tflops": achieved / 1e12,
               "sizes": dict(d_model=d_model, layers=layers, heads=heads, context=context, batch=batch)}
    figures.update(_kernel_time(res))
    try:
        figures["peak_tflops"] = costs.peak_flops(device, "bf16") / 1e12
        figures["mfu"] = costs.mfu(achieved, device, "bf16")
    except ValueError as err:  # a device the peak table does not know: the figure is left out, not guessed
        figures["mfu_error"] = str(err)
    text = (f"{header['params'] / 1e6:.0f} M params, {summary['tokens_per_s']:,.0f} tokens/s, "
            f"{achieved / 1e12:.0f} TFLOP/s of model FLOPs")
    if "mfu" in figures:
        text += f" = {figures['mfu']:.1%} MFU of {figures['peak_tflops']:.0f} TFLOP/s dense bf16"
    if figures.get("kernel_time_share"):
        text += (f"; GPU busy {figures['gpu_busy_fraction']:.0%} of the profiled steps, kernel time: " +
                 ", ".join(f"{k} {v:.0%}" for k, v in figures["kernel_time_share"].items()))
    return True, text, figures, res


KERNEL_KINDS = (("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas")), ("attention", ("flash", "fmha", "attention")),
                ("optimizer", ("adam", "multi_tensor", "foreach")))


def _kernel_time(res) -> dict:
    """Where the GPU's time went in the profiled steps: share of kernel time by kind, and how busy the GPU was."""
    from .traces import analyze_run, load_trace

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


def check_notebooks(smoke: bool = True, only: list[str] | None = None, output: Path | None = None):
    """Every chapter notebook executed with papermill on this machine (the launcher picks NCCL or gloo+CUDA)."""
    from .course import execute_notebook, find_notebooks

    output = output or ROOT / "executed" / "gpu-check"
    rows = {}
    for path in find_notebooks():
        if only and not any(path.stem.startswith(o) for o in only):
            continue
        run = execute_notebook(path, output, smoke=smoke)
        rows[path.stem] = {"status": run.status, "seconds": round(run.duration, 1), "failing_cell": run.failing_cell,
                           "error": run.error}
        print(f"  {path.stem}: {run.status} in {run.duration:.0f} s {run.error}", flush=True)
    passed = sum(r["status"] == "ok" for r in rows.values())
    return passed == len(rows) > 0, f"{passed} of {len(rows)} notebooks ran to the end ({'smoke' if smoke else 'default'} sizes)", rows


CHECKS = {"nccl_one_rank": check_nccl_one_rank, "gloo_ranks_share_a_gpu": check_gloo_ranks_share_a_gpu,
          "nccl_refused_beyond_gpus": check_nccl_refused_beyond_gpus, "cuda_trace": check_cuda_trace,
          "data_parallel": check_data_parallel, "bf16_autocast_ddp": check_bf16_autocast_ddp,
          "fsdp_memory": check_fsdp_memory, "precision_recipes": check_precision_recipes,
          "capstone_mfu": check_capstone_mfu, "notebooks": check_notebooks}


def run_check(name: str, **kwargs) -> Outcome:
    """Run one check; an exception inside it is its failure (with the traceback's last line), never a crash."""
    start = time.monotonic()
    try:
        passed, summary, figures, *rest = CHECKS[name](**kwargs)
    except Exception as err:
        tb = traceback.format_exc().strip().splitlines()
        return Outcome(name, "failed", f"{type(err).__name__}: {err} ({tb[-3].strip() if len(tb) > 2 else ''})",
                       time.monotonic() - start)
    run = str(rest[0].run_dir) if rest and hasattr(rest[0], "run_dir") else None
    return Outcome(name, "passed" if passed else "failed", summary, time.monotonic() - start, figures, run)


# --- the report ----------------------------------------------------------------------------------------
def environment() -> dict:
    """What ran it: device, driver, versions (nvidia-smi where it answers)."""
    import platform

    from .hardware import hardware_report

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
    lines = [f"# GPU check, {when:%Y-%m-%d %H:%M} UTC", "",
             f"Written by `gpucourse gpu-check` on {', '.join(env['gpus']) or 'no GPU'} "
             f"({', '.join(f'{m} GiB' for m in env['gpu_memory_gib'])}), driver {env['driver']}, torch {env['torch']}, "
             f"CUDA {env['cuda']}, NCCL {env['nccl']}, Python {env['python']}, {env['cpus']} CPUs. "
             f"{passed} of {len(outcomes)} checks passed. Every figure below was measured in this run.", "",
             "| check | status | what it showed | seconds |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        lines.append(f"| `{o.name}` | {o.status} | {o.summary.replace('|', '/')} | {o.seconds:.0f} |")
    lines += ["", "## What each check runs", ""]
    lines += [f"- `{o.name}`: {CHECKS[o.name].__doc__.strip()}" for o in outcomes]
    lines += ["", "## Figures", "", "```json", json.dumps({o.name: o.figures for o in outcomes}, indent=1,
                                                            default=str), "```", ""]
    (folder / f"{stem}.md").write_text("\n".join(lines))
    (folder / f"{stem}.json").write_text(json.dumps({"when": when.isoformat(), "environment": env,
                                                     "checks": [asdict(o) for o in outcomes]}, indent=1, default=str))
    return folder / f"{stem}.md"


def main(args) -> int:
    import torch

    if args.list:
        for name, fn in CHECKS.items():
            print(f"{name:26} {fn.__doc__.strip().splitlines()[0]}")
        return 0
    names = args.only or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise GpuCheckError(f"no check named {', '.join(unknown)}; the checks are: {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        raise GpuCheckError("no CUDA GPU is visible to this PyTorch (torch.cuda.is_available() is False): gpu-check "
                            "validates the course's GPU paths, so run it on a machine with a GPU; nothing was written")
    env = environment()
    print(f"gpu-check on {', '.join(env['gpus'])}: {len(names)} check(s)", flush=True)
    outcomes = []
    for name in names:
        print(f"- {name} ...", flush=True)
        kwargs = {"smoke": args.notebooks == "smoke"} if name == "notebooks" else {}
        if name == "notebooks" and args.notebook:
            kwargs["only"] = args.notebook
        outcome = run_check(name, **kwargs)
        print(f"  {outcome.status} in {outcome.seconds:.0f} s: {outcome.summary}", flush=True)
        outcomes.append(outcome)
    report = write_report(outcomes, env, Path(args.report_dir))
    print(f"report: {report}")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


def add_cli(sub) -> None:
    p = sub.add_parser("gpu-check", help="run the course's GPU paths on this machine's GPU and write a dated report")
    p.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (see --list)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--notebooks", choices=["smoke", "default"], default="smoke",
                   help="sizes for the notebooks check (default: smoke)")
    p.add_argument("--notebook", nargs="+", metavar="PREFIX", help="only the notebooks whose name starts so")
    p.add_argument("--report-dir", default=str(ROOT / "docs"), help="where the dated report goes (default docs/)")
    p.set_defaults(func=main)
