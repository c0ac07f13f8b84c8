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

docs/gpu-run.sh runs it on a bare GPU machine: wheels, kernel, every chapter's notebook and the checks it picks.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..argtypes import positive_int, positive_seconds
from . import harness
from .backends import (check_data_parallel, check_gloo_ranks_share_a_gpu, check_nccl_one_rank,
                       check_nccl_refused_beyond_gpus, check_nccl_watchdog)
from .capstone import check_capstone_compiled, check_capstone_mfu, check_dryrun_memory
from .chapter_scripts import (check_bf16_autocast_ddp, check_cuda_trace, check_default_sizes, check_fsdp_memory,
                              check_pipeline_schedules, check_precision_recipes)
from .fp8 import check_fp8
from .gloo_cuda_segv import check_gloo_cuda_segv
from .graders import check_graders
from .harness import ROOT, emit, seconds_left
from .notebooks import check_notebooks


class GpuCheckError(ValueError):
    """The request was wrong (no GPU here, an unknown check): one line, exit code 2."""


# What the report says was not checked, whatever ran (one line each).
NOT_CHECKED = ["Chapter 13's 3-D capstone (scripts/13_gpt_3d.py) on NCCL: its ranks stay on the CPU with gloo "
               "(gloo's send/recv failed on CUDA tensors, docs/gpu-report-2026-11-25.md), so no check runs it on GPUs."]


@dataclass
class Outcome:
    name: str
    status: str  # "passed" | "failed" | "skipped" (not started: the time budget)
    summary: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    run: str | None = None  # run directory of the job it launched, if one


# --- the checks, in the order they run without --only: each returns (passed, summary, figures[, result]) ---------
CHECKS = {"notebooks": check_notebooks, "graders": check_graders, "capstone_compiled": check_capstone_compiled,
          "fp8": check_fp8, "gloo_cuda_segv": check_gloo_cuda_segv, "default_sizes": check_default_sizes,
          "nccl_one_rank": check_nccl_one_rank, "gloo_ranks_share_a_gpu": check_gloo_ranks_share_a_gpu,
          "nccl_refused_beyond_gpus": check_nccl_refused_beyond_gpus, "nccl_watchdog": check_nccl_watchdog,
          "cuda_trace": check_cuda_trace,
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
    harness.start(min(ends) if ends else None, Path(args.results) if args.results else None)
    env = environment()
    emit({"environment": env, "pid": os.getpid(), "checks": names})
    print(f"gpu-check on {', '.join(env['gpus'])}: {len(names)} check(s)"
          + (f", {seconds_left():.0f} s of budget" if seconds_left() is not None else ""), flush=True)
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
                if args.notebook_except:
                    kwargs["skip"] = args.notebook_except
            outcome = run_check(name, **kwargs)
        print(f"  {outcome.status} in {outcome.seconds:.0f} s: {outcome.summary}", flush=True)
        emit({"outcome": asdict(outcome)})
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
    p.add_argument("--notebook-except", nargs="+", metavar="PREFIX",
                   help="every notebook but those whose name starts so")
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
