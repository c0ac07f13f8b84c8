"""The backends on the GPU: the doctor job on NCCL, gloo ranks sharing the GPU, NCCL refused beyond the GPUs, NCCL's
watchdog catching an overdue collective, and nn.DataParallel against the plain module."""
from __future__ import annotations

import pickle
import time
from pathlib import Path

from ...run.contract import FR_PREFIX
from .harness import DOCTOR_JOB, failed_run, launch, needs

WATCHDOG_JOB = DOCTOR_JOB.with_name("watchdog_job.py")


def _doctor_record(res, rank=0) -> dict:
    """What the doctor job logged on `rank`: the all-reduce's sum, backend and device."""
    return next((m for m in res.metrics.get(rank, []) if "device" in m), {})


@needs(10)
def check_nccl_one_rank():
    """The doctor job (an all-reduce with a known answer) at 1 rank on NCCL."""
    res = launch(DOCTOR_JOB, nproc=1, backend="nccl", name="gpucheck-nccl")
    setup = _doctor_record(res)
    ok = res.ok and setup.get("backend") == "nccl" and str(setup.get("device", "")).startswith("cuda")
    return ok, failed_run(res) or f"1 rank, backend {setup.get('backend')}, device {setup.get('device')}", \
        {"backend": setup.get("backend"), "device": setup.get("device")}, res


@needs(12)
def check_gloo_ranks_share_a_gpu(nproc: int = 4):
    """More ranks than GPUs: gloo, each rank's tensors on the (shared) GPU, the all-reduce still exact."""
    res = launch(DOCTOR_JOB, nproc=nproc, backend="gloo", name="gpucheck-gloo-cuda")
    devices = {r: _doctor_record(res, r).get("device") for r in range(nproc)}
    ok = res.ok and all(str(d).startswith("cuda") for d in devices.values())
    return ok, failed_run(res) or f"{nproc} ranks on gloo, devices {sorted(set(map(str, devices.values())))}", \
        {"devices": devices}, res


@needs(1)
def check_nccl_refused_beyond_gpus():
    """Asking NCCL for more ranks than GPUs is refused before anything starts, with a message that says why."""
    from ...run.hardware import gpu_count
    from ...run.launcher import LaunchConfigError

    n = gpu_count() + 1
    try:
        res = launch(DOCTOR_JOB, nproc=n, backend="nccl", name="gpucheck-nccl-too-many")
    except LaunchConfigError as err:
        return True, f"{n} ranks on NCCL refused: {err}", {"message": str(err)}
    return False, f"{n} ranks on NCCL were started ({res.status}) instead of refused", {}, res


@needs(60)
def check_nccl_watchdog(timeout_s: float = 10.0, sleep_s: float = 120.0):
    """NCCL's watchdog on one GPU (chapter 08b's environment variables): an all-reduce queued behind a long GPU sleep
    is caught after the group's timeout, its Flight Recorder dumped (TORCH_NCCL_DUMP_ON_TIMEOUT=1) with the stuck
    all-reduce not completed, and the rank torn down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3) long before the sleep ends."""
    import tempfile

    dumps = Path(tempfile.mkdtemp(prefix="gpucheck-fr-"))
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           "TORCH_FR_DUMP_TEMP_FILE": str(dumps / FR_PREFIX), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(dumps / FR_PREFIX)}
    began = time.monotonic()
    res = launch(WATCHDOG_JOB, nproc=1, backend="nccl", name="gpucheck-nccl-watchdog", env=env,
                 args=["--timeout", str(timeout_s), "--sleep", str(sleep_s)], timeout=sleep_s + 60, max_restarts=0)
    took = time.monotonic() - began
    log = res.log(0)
    caught = "Watchdog caught collective operation timeout" in log
    entries = [e for f in dumps.glob(f"{FR_PREFIX}*") for e in pickle.loads(f.read_bytes()).get("entries", [])]
    stuck = [e for e in entries if "all_reduce" in str(e.get("profiling_name")) and e.get("state") != "completed"]
    ok = not res.ok and caught and "survived" not in log and bool(stuck) and took < sleep_s
    return ok, (f"timeout {timeout_s:g} s: the job ended after {took:.0f} s ({res.status}); watchdog's line "
                f"{'logged' if caught else 'MISSING'}; Flight Recorder dump {len(entries)} entries, "
                f"{len(stuck)} all-reduce(s) not completed"), \
        {"seconds": took, "caught": caught, "entries": len(entries), "stuck": len(stuck)}, res


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
