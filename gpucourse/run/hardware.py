"""Both sides: what this machine can run: CPUs, GPUs, interconnect, backends, and where we are (Colab, Kaggle, Slurm).

`gpu_count()` is cheap (no torch import) because the launcher calls it before every run;
`placement()` is the one rule for a rank's backend and device (the launcher's plan, each rank's runtime and
the hardware report all call it); `hardware_report()` imports torch and asks it everything.
"""
from __future__ import annotations

import html
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from .contract import DEVICE_ENV


def gpu_count() -> int:
    """NVIDIA GPUs this process may use. Uses torch if it is already imported, else the driver's /proc."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    proc = Path("/proc/driver/nvidia/gpus")
    present = len(list(proc.iterdir())) if proc.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    ids = [v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")]
    return min(present, len(ids))


def mpi_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_mpi_available()


class Placement(NamedTuple):
    backend: str  # 'nccl', 'gloo' or 'mpi'
    device: str  # 'cuda:<i>' or 'cpu'


def placement(backend: str = "auto", ranks_per_node: int = 1, local_rank: int = 0, *, gpus: int | None = None,
              cpu_only: bool | None = None, cuda_with_gloo: bool = True) -> Placement:
    """How a rank talks and where it computes: the one rule, read by the launcher, each rank and the report.

    backend: 'auto' is NCCL when each of a node's `ranks_per_node` ranks gets a GPU of its own, else gloo;
    an explicit backend is kept (the launcher checks it first). device: under NCCL local rank i uses GPU i;
    under gloo or MPI the GPUs are dealt round-robin (ranks may share one), unless `cpu_only` or the script
    asked `cuda_with_gloo=False` (runtime.setup): then the CPU. gpus: GPUs this process may use (default
    gpu_count()); cpu_only: default $GPUCOURSE_DEVICE == 'cpu'.
    """
    gpus = gpu_count() if gpus is None else gpus
    cpu_only = os.environ.get(DEVICE_ENV) == "cpu" if cpu_only is None else cpu_only
    if backend == "auto":
        backend = "nccl" if not cpu_only and 0 < ranks_per_node <= gpus else "gloo"
    if backend == "nccl":
        return Placement(backend, f"cuda:{local_rank}")
    if cpu_only or not cuda_with_gloo or gpus == 0:
        return Placement(backend, "cpu")
    return Placement(backend, f"cuda:{local_rank % gpus}")


def default_nproc() -> int:
    """What a chapter should launch by default: one rank per GPU, else 2 CPU ranks (4 with ≥4 cores)."""
    gpus = gpu_count()
    return gpus if gpus else (4 if (os.cpu_count() or 1) >= 4 else 2)


def platform_name() -> str:
    if "COLAB_RELEASE_TAG" in os.environ or "COLAB_GPU" in os.environ:
        return "Google Colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
        return "Kaggle"
    if "SLURM_JOB_ID" in os.environ:
        return f"Slurm job {os.environ['SLURM_JOB_ID']} ({os.environ.get('SLURM_JOB_NUM_NODES', '?')} node(s))"
    return "local machine"


# The torch releases the course has run on: the lowest on a lent GPU machine (docs/gpu-report-*.md says what did
# not run there), the highest in CI. pyproject.toml admits every torch from the lowest, so that Colab's or
# Kaggle's preinstalled torch is kept; constraints.txt pins CI's.
TESTED_TORCH = ("2.11", "2.13.0")


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the torch imported here): '2.11.0+cu130' -> (2, 11)."""
    if version is None:
        import torch

        version = torch.__version__
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def torch_note(version: str) -> str:
    """'' for a tested torch, else what to expect (a development build counts as its release)."""
    low, high = TESTED_TORCH
    if torch_release(low) <= torch_release(version) <= torch_release(high):
        return ""
    return f" — untested: the course is tested on torch {low} to {high}; expect a chapter here or there to differ"


@dataclass
class HardwareReport:
    cpus: int
    cpu_model: str
    memory_gib: float
    gpus: list[dict] = field(default_factory=list)
    topology: str | None = None
    backends: dict[str, bool] = field(default_factory=dict)
    platform: str = "local machine"
    torch_version: str = ""
    cuda_version: str | None = None
    nccl_version: str | None = None

    @property
    def chosen_backend(self) -> str:
        gpus = len(self.gpus) if self.backends.get("nccl") else 0  # GPUs that NCCL can use
        return placement("auto", self.chosen_nproc, gpus=gpus, cpu_only=False).backend

    @property
    def chosen_nproc(self) -> int:
        return len(self.gpus) if self.gpus else (4 if self.cpus >= 4 else 2)

    def rows(self) -> list[tuple[str, str]]:
        gpus = "; ".join(f"{g['index']}: {g['name']} ({g['memory_gib']:.0f} GiB, sm_{g['capability']})"
                         for g in self.gpus) or "none (CPU only: multi-rank runs use gloo on CPU processes)"
        backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in self.backends.items())
        return [("platform", self.platform), ("CPUs", f"{self.cpus} × {self.cpu_model}"),
                ("memory", f"{self.memory_gib:.1f} GiB"), ("GPUs", gpus),
                ("torch", f"{self.torch_version} (CUDA {self.cuda_version or '—'}, NCCL {self.nccl_version or '—'})"
                          + torch_note(self.torch_version)),
                ("backends", backends),
                ("launcher default", f"backend={self.chosen_backend}, nproc={self.chosen_nproc}")]

    def __str__(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        text = "\n".join(f"{k:<{width}}  {v}" for k, v in self.rows())
        return text + (f"\n\nGPU topology (nvidia-smi topo -m):\n{self.topology}" if self.topology else "")

    __repr__ = __str__

    def _repr_html_(self) -> str:
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
                       f"{html.escape(v)}</td></tr>" for k, v in self.rows())
        topo = f"<pre>{html.escape(self.topology)}</pre>" if self.topology else ""
        return f"<table>{body}</table>{topo}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def _topology() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def hardware_report() -> HardwareReport:
    import psutil
    import torch
    import torch.distributed as dist

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_gib": p.total_memory / 2**30,
                         "capability": f"{p.major}{p.minor}"})
    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return HardwareReport(
        cpus=os.cpu_count() or 1, cpu_model=_cpu_model(), memory_gib=psutil.virtual_memory().total / 2**30,
        gpus=gpus, topology=_topology() if gpus else None,
        backends={"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available() and bool(gpus),
                  "mpi": dist.is_mpi_available()},
        platform=platform_name(), torch_version=torch.__version__, cuda_version=torch.version.cuda,
        nccl_version=nccl)
