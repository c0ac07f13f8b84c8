"""`gpucourse gpu-check` on a machine without a GPU: it refuses clearly, and its pieces behave (no job is launched)."""
import datetime as dt
import json
import subprocess
import sys

import pytest
import torch

from gpucourse import gpu_check
from gpucourse.gpu_check import Outcome, run_check, write_report

ENV = {"gpus": ["NVIDIA H100 80GB HBM3"], "gpu_memory_gib": [79.2], "driver": "580", "torch": "2.13.0",
       "cuda": "13.0", "nccl": "2.28.9", "python": "3.11", "cpus": 16}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check would run")
def test_without_a_gpu_it_refuses_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpucourse.cli", "gpu-check", "--report-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU is visible" in proc.stderr and "nothing was written" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_check_is_named_with_the_known_ones(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gpucourse.cli", "gpu-check", "--only", "nccl_one_rank", "warp_speed",
                           "--report-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no check named warp_speed" in proc.stderr and "capstone_mfu" in proc.stderr


def test_nccl_beyond_the_gpus_is_refused_before_anything_starts():
    outcome = run_check("nccl_refused_beyond_gpus")  # the real launcher's validation: no job starts
    assert outcome.status == "passed", outcome.summary
    assert "NCCL needs one GPU per rank" in outcome.summary and outcome.run is None


def test_an_exception_inside_a_check_is_its_failure_not_a_crash(monkeypatch):
    def broken():
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setitem(gpu_check.CHECKS, "broken", broken)
    outcome = run_check("broken")
    assert outcome.status == "failed" and "device-side assert" in outcome.summary


def test_the_report_lists_every_check_and_never_overwrites_an_earlier_one(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.CHECKS, "demo", lambda: None)
    gpu_check.CHECKS["demo"].__doc__ = "A demonstration check."
    outcomes = [Outcome("demo", "passed", "3 ranks | all on cuda:0", 1.5, {"tokens_per_s": 12.5}),
                Outcome("nccl_one_rank", "failed", "rank 0 failed", 2.0)]
    when = dt.datetime(2026, 11, 25, 1, 2, tzinfo=dt.timezone.utc)
    first = write_report(outcomes, ENV, tmp_path, when)
    second = write_report(outcomes, ENV, tmp_path, when)
    assert first.name == "gpu-check-2026-11-25.md" and second.name == "gpu-check-2026-11-25-2.md"
    text = first.read_text()
    assert "1 of 2 checks passed" in text and "NVIDIA H100 80GB HBM3" in text and "NCCL 2.28.9" in text
    assert "| `demo` | passed | 3 ranks / all on cuda:0 |" in text  # a '|' would break the table
    assert "A demonstration check." in text
    data = json.loads(first.with_suffix(".json").read_text())
    assert data["checks"][0]["figures"] == {"tokens_per_s": 12.5} and data["environment"]["driver"] == "580"
