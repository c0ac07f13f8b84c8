"""`gpucourse gpu-check` on a machine without a GPU: it refuses clearly, and its pieces behave (no job is launched)."""
import datetime as dt
import json

import pytest
import torch

from gpucourse.tools import gpu_check
from gpucourse.tools.exercises import load_file
from gpucourse.tools.gpu_check import Outcome, run_check, write_report

from tests.conftest import run_cli

ENV = {"gpus": ["NVIDIA H100 80GB HBM3"], "gpu_memory_gib": [79.2], "driver": "580", "torch": "2.13.0",
       "cuda": "13.0", "nccl": "2.28.9", "python": "3.11", "cpus": 16}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check would run")
def test_without_a_gpu_it_refuses_and_writes_nothing(tmp_path):
    proc = run_cli("gpu-check", "--report-dir", tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU is visible" in proc.stderr and "nothing was written" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_check_is_named_with_the_known_ones(tmp_path):
    proc = run_cli("gpu-check", "--only", "nccl_one_rank", "warp_speed", "--report-dir", tmp_path)
    assert proc.returncode == 2
    assert "no check named warp_speed" in proc.stderr and "capstone_mfu" in proc.stderr


def test_nccl_beyond_the_gpus_is_refused_before_anything_starts():
    outcome = run_check("nccl_refused_beyond_gpus")  # the real launcher's validation: no job starts
    assert outcome.status == "passed", outcome.summary
    assert "NCCL needs one GPU per rank" in outcome.summary and outcome.run is None


def test_every_check_is_registered_once_with_the_seconds_it_needs():
    """One registry: CHECKS, each check marked @needs(seconds) where it is defined (the budget reads it); every
    check_ function of the package's modules is in it, and --list, the report and docs/gpu-run.sh read it."""
    import importlib
    import pkgutil

    needs = {name: getattr(fn, "needs_s", None) for name, fn in gpu_check.CHECKS.items()}
    assert all(isinstance(s, (int, float)) and s > 0 for s in needs.values()), needs
    defined = {f"{m.name}.{n}" for m in pkgutil.iter_modules(gpu_check.__path__)
               for n, fn in vars(importlib.import_module(f"{gpu_check.__name__}.{m.name}")).items()
               if n.startswith("check_") and getattr(fn, "__module__", None) == f"{gpu_check.__name__}.{m.name}"}
    registered = {f"{fn.__module__.rpartition('.')[2]}.{fn.__name__}" for fn in gpu_check.CHECKS.values()}
    assert defined == registered and len(registered) == len(gpu_check.CHECKS)
    assert all(fn.__name__ == f"check_{name}" for name, fn in gpu_check.CHECKS.items())


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


# --- the pieces of the checks added for the second GPU run (pure logic; fake inputs) -----------------------
FAULT = '''some output
Fatal Python error: Segmentation fault

Thread 0x00007f0000000002 (most recent call first):
  File "/opt/venv/lib/python3.12/site-packages/torch/utils/data.py", line 10 in wait

Current thread 0x00007f0000000001 (most recent call first):
  File "/opt/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 4321 in reduce_scatter_tensor
  File "/opt/venv/lib/python3.12/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 77 in foreach_reduce
  File "/work/main/scripts/07_memory.py", line 114 in train
  File "/work/main/scripts/07_memory.py", line 160 in main

Extension modules: numpy.core._multiarray_umath, torch._C (total: 2)
'''


def test_faulthandler_stacks_are_read_innermost_first_per_thread():
    stacks = gpu_check.faulthandler_stacks(FAULT)
    assert [s["current"] for s in stacks] == [False, True]
    assert [f["function"] for f in stacks[1]["frames"]] == ["reduce_scatter_tensor", "foreach_reduce", "train", "main"]
    call = gpu_check.innermost_distributed_call(stacks)
    assert call["call"].startswith("reduce_scatter_tensor (torch/distributed/distributed_c10d.py:4321")
    assert call["thread"] == "crashing thread" and call["from"] == "train (07_memory.py:114)"
    assert gpu_check.faulthandler_stacks("Traceback (most recent call last):\n  File \"x.py\", line 1 in f\n") == []


def test_a_crash_in_a_thread_without_python_frames_is_named_from_another_thread():
    text = FAULT.replace('Current thread 0x00007f0000000001 (most recent call first):\n',
                         'Current thread 0x00007f0000000001 (most recent call first):\n  <no Python frame>\n\n'
                         'Thread 0x00007f0000000003 (most recent call first):\n')
    call = gpu_check.innermost_distributed_call(gpu_check.faulthandler_stacks(text))
    assert call["call"].startswith("reduce_scatter_tensor") and call["thread"] == "thread 0x00007f0000000003"


def test_grading_runs_are_attributed_to_their_exercise():
    ex = gpu_check.GRADED
    assert gpu_check.graders._job_exercise("grade-ex02-20261126-010203", ex) == "ex02_ddp"
    assert gpu_check.graders._job_exercise("grade-ex06-w4-20261126-010203", ex) == "ex06_tensor_parallel"
    assert gpu_check.graders._job_exercise("grade-ex07-fsdp-w1-20261126", ex) == "ex07_fsdp"
    assert gpu_check.graders._job_exercise("grade-ex07-sharded-w2-20261126", ex) == "ex07_sharded_optimizer"
    assert gpu_check.graders._job_exercise("grade-ex09-1x2", ex) is None


def test_job_devices_reads_the_manifest_and_each_ranks_setup_record(tmp_path):
    run = tmp_path / "grade-ex02-1"
    (run / "metrics").mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({"name": run.name, "status": "ok", "world_size": 2,
                                                   "backend": "gloo", "device": "cuda"}))
    for r in range(2):
        (run / "metrics" / f"rank{r}.jsonl").write_text(
            json.dumps({"rank": r, "event": "setup", "backend": "gloo", "device": "cuda:0"}) + "\n{torn")
    (tmp_path / "not-a-run").mkdir()
    jobs = gpu_check.job_devices(tmp_path)
    assert jobs == [{"name": run.name, "status": "ok", "world_size": 2, "backend": "gloo", "launcher_device": "cuda",
                     "rank_devices": ["cuda:0"], "rank_backends": ["gloo"]}]


def test_notebooks_run_in_the_order_of_the_prefixes_given_less_those_left_out(tmp_path):
    from pathlib import Path

    books = [Path(f"{n}.ipynb") for n in ("00_a", "02_b", "05_c", "10_d")]
    picked = gpu_check.notebooks._pick_notebooks(books, ["10", "02", "0"])
    assert [p.stem for p in picked] == ["10_d", "02_b", "00_a", "05_c"]
    assert gpu_check.notebooks._pick_notebooks(books, None) == books
    assert [p.stem for p in gpu_check.notebooks._pick_notebooks(books, None, ["05", "1"])] == ["00_a", "02_b"]


def test_compile_seconds_and_the_fp8_model_read_backwards():
    assert gpu_check.compile_seconds([30.0, 2.0, 0.5, 0.5, 0.5, 0.5, 0.6], warmup=4) == pytest.approx(31.0)
    assert gpu_check.compile_seconds([1.0], warmup=4) is None
    # chapter 07's bound: f of the time 2x faster gives 1 / (1 - f/2); read back, the same f
    f = 0.6
    assert gpu_check.implied_gemm_fraction(1 / (1 - f / 2), 2.0) == pytest.approx(f)
    assert gpu_check.implied_gemm_fraction(1.0, 2.0) == 0 and gpu_check.implied_gemm_fraction(1.2, 1.0) is None


def test_fp8_linear_backward_is_the_plain_linears(monkeypatch):
    from torch import nn

    # the FP8 product itself needs a GPU; its autograd wiring (shapes, dtypes, bias) does not
    monkeypatch.setattr(gpu_check.fp8, "fp8_matmul", lambda a, w: (a.float() @ w.float().t()).to(torch.bfloat16))
    torch.manual_seed(0)
    plain, fp8 = nn.Linear(16, 32), nn.Linear(16, 32)
    fp8.load_state_dict(plain.state_dict())
    gpu_check.use_fp8_forward([fp8])
    x = torch.randn(2, 3, 16)
    plain(x).square().sum().backward()
    fp8(x).float().square().sum().backward()
    assert fp8.weight.grad.dtype == torch.float32 and fp8.weight.grad.shape == plain.weight.grad.shape
    assert torch.allclose(fp8.weight.grad, plain.weight.grad, rtol=0.05, atol=0.05)
    assert torch.allclose(fp8.bias.grad, plain.bias.grad, rtol=0.05, atol=0.05)


def test_to_fp8_scales_the_largest_value_to_the_format_maximum():
    t = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    q, inv = gpu_check.fp8._to_fp8(t)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max().item() == gpu_check.E4M3_MAX
    assert torch.allclose(q.float() * inv, t, rtol=0.07)


def test_a_results_file_becomes_one_report_with_the_skipped_checks_and_what_was_not_checked(tmp_path):
    results = tmp_path / "results.jsonl"
    lines = [{"environment": ENV}, {"outcome": {"name": "fp8", "status": "passed", "summary": "1.9x", "seconds": 30.0,
                                               "figures": {"speedup": 1.9}, "run": None}},
             {"progress": "notebooks", "notebook": "02_x", "status": "ok"},
             {"outcome": {"name": "notebooks", "status": "failed", "summary": "5 of 6", "seconds": 200.0,
                          "figures": {"10_y": {"status": "failed"}}, "run": None}},
             {"outcome": {"name": "notebooks", "status": "skipped", "summary": "not started: 3 s of the time budget "
                          "left", "seconds": 0.0, "figures": {}, "run": None}}]
    results.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"outcome": {"name": "to')  # torn last line
    env, outcomes = gpu_check.read_results(results)
    assert env["driver"] == "580" and [o.status for o in outcomes] == ["passed", "failed", "skipped"]
    proc = run_cli("gpu-check", "--report-from", results, "--report-dir", tmp_path / "out")
    assert proc.returncode == 1, proc.stderr  # not every check passed
    text = next((tmp_path / "out").glob("gpu-check-*.md")).read_text()
    assert "1 of 3 checks passed (1 not started: the time budget was spent)" in text
    assert "## Not checked" in text and gpu_check.NOT_CHECKED[0] in text
    assert '"notebooks #2": {}' in text and '"10_y"' in text


def test_pipeline_schedules_launches_every_schedule_chapter_05_knows_and_names_the_failed(monkeypatch):
    from types import SimpleNamespace

    launched = []

    def fake_launch(script, name, args, **kw):
        schedule = args[args.index("--schedules") + 1]
        launched.append(schedule)
        ok = schedule != "DualPipeV"
        return SimpleNamespace(status="ok" if ok else "failed", ok=ok, summary=lambda: "failed: rank 0 exited 1",
                               error=SimpleNamespace(summary="Pair is not connected"))

    monkeypatch.setattr(gpu_check.chapter_scripts, "launch", fake_launch)
    passed, text, figures, _ = gpu_check.check_pipeline_schedules()
    chapter = load_file(gpu_check.SCRIPTS / "05_schedules.py", "schedules_05")
    assert launched == chapter.SCHEDULES and len(launched) >= 6
    assert not passed and figures["DualPipeV"]["status"] == "failed" and figures["GPipe"]["error"] is None
    assert f"{len(launched) - 1} of {len(launched)} schedules ran" in text and "DualPipeV" in text
    assert "Pair is not connected" in text


class _Ended:
    """A launch result: failed (the watchdog's abort) or not, with what rank 0 printed."""

    def __init__(self, ok, log):
        self.ok, self.status, self.error, self._log = ok, "ok" if ok else "failed", None, log

    def log(self, rank):
        return self._log

    def summary(self):
        return self.status


@pytest.mark.parametrize("ok, said, state, passes", [
    (False, "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE", "scheduled", True),
    (True, "Watchdog caught collective operation timeout\nsurvived: the watchdog did not end the process", "scheduled",
     False),  # the process outlived the timeout
    (False, "RuntimeError: CUDA error", "scheduled", False),  # died of something else
    (False, "Watchdog caught collective operation timeout", "completed", False),  # the dump shows nothing stuck
])
def test_the_watchdog_check_needs_the_timeout_line_a_stuck_dump_and_an_early_end(monkeypatch, ok, said, state,
                                                                                  passes):
    """nccl_watchdog's verdict, its launch faked: the job must end early, having logged NCCL's watchdog line, with
    a Flight Recorder dump (pickled, torch's format: entries with profiling_name and state) holding a stuck all-reduce."""
    import pickle
    from pathlib import Path

    from gpucourse.tools.gpu_check import backends

    def fake_launch(script, env, **kw):
        entries = [{"profiling_name": "nccl:all_reduce", "state": "completed"},
                   {"profiling_name": "nccl:all_reduce", "state": state}]
        Path(env["TORCH_FR_DUMP_TEMP_FILE"] + "0").write_bytes(pickle.dumps({"entries": entries}))
        return _Ended(ok, said)

    monkeypatch.setattr(backends, "launch", fake_launch)
    passed, summary, figures, _ = backends.check_nccl_watchdog()
    assert passed is passes, summary
    assert figures["entries"] == 2
