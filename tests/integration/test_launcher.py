"""The launcher, end to end: real torchrun jobs on gloo/CPU, and proof that nothing survives any of them."""
import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import gpucourse
from gpucourse.run.contract import RUNS_ENV
from gpucourse.run.launcher import LaunchConfigError, LaunchError, launch

from tests.conftest import JOBS, listening_ports, run_processes

WORKER = JOBS / "worker.py"


def assert_nothing_left(result_or_dir, seen_pids=()):
    run_dir = getattr(result_or_dir, "run_dir", result_or_dir)
    deadline = time.monotonic() + 10
    while run_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run_processes(run_dir) == []
    assert listening_ports(seen_pids) == []


def test_success_collects_logs_metrics_manifest(runs_dir):
    res = launch(WORKER, nproc=2, args=["--steps", "3"], live=False)
    assert res.ok and res.returncodes == {0: 0, 1: 0}
    assert res.run_dir.is_absolute() and res.run_dir.parent == runs_dir
    # rank r at step s contributes r + s: the all-reduced sum over 2 ranks is 1 + 2s
    assert res.metric("sum", rank=1) == [1.0, 3.0, 5.0]
    assert "rank 1 step 2 sum 5" in res.log(1)
    manifest = json.loads((res.run_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["backend"] == "gloo" and manifest["status"] == "ok"
    assert manifest["versions"]["torch"].startswith("2.")
    assert manifest["end"] >= manifest["start"]
    assert manifest["devices"] == {"0": "cpu", "1": "cpu"} and manifest["device"] == "cpu"  # as the ranks reported
    assert gpucourse.load_run(res.run_dir).metrics == res.metrics
    assert_nothing_left(res)


def test_failure_names_the_root_cause_rank(runs_dir):
    with pytest.raises(LaunchError) as info:
        launch(WORKER, nproc=3, args=["--steps", "5", "--fail-rank", "2", "--step-time", "0.2"], live=False)
    res = info.value.result
    assert res.status == "failed" and res.error.rank == 2
    assert res.returncodes[2] == 1
    assert str(info.value).startswith("rank 2 failed (exit code 1): ValueError: deliberate failure on rank 2")
    assert 'raise ValueError(f"deliberate failure' in res.error.traceback
    assert "torch.distributed.elastic" not in str(info.value).splitlines()[0]
    assert_nothing_left(res)


def test_failure_without_traceback_reports_exit_code(runs_dir):
    res = launch(WORKER, nproc=2, args=["--steps", "5", "--exit-rank", "0", "--step-time", "0.2"],
                 live=False, check=False)
    assert not res.ok and res.error.rank == 0 and res.returncodes[0] == 3
    assert "exit code 3" in res.error.summary


def test_timeout_names_running_ranks_and_their_last_line(runs_dir):
    start = time.monotonic()
    res = launch(WORKER, nproc=2, args=["--steps", "2", "--hang"], timeout=12, live=False, check=False)
    assert time.monotonic() - start < 12 + 90  # the job hangs forever: only the timeout ended it
    assert res.status == "timeout"
    assert "timed out after 12 s" in res.error.summary and "[0, 1]" in res.error.summary
    # How far each rank got depends on the machine's load; the report must match what the rank's logs show.
    for rank in (0, 1):
        printed = [ln.strip() for stream in ("stdout", "stderr") for ln in res.log(rank, stream).splitlines()
                   if ln.strip()]
        said = f"rank {rank} was still running; its last line: "
        line = next(ln for ln in res.error.traceback.splitlines() if ln.startswith(said))[len(said):]
        assert line in printed if printed else line == "(nothing)", (line, printed)
    assert_nothing_left(res)


def test_a_worker_seen_before_its_exec_is_still_known_by_its_rank(tmp_path):
    """torchrun's worker, caught between fork and exec, has no RANK yet: the launcher must ask again later."""
    from gpucourse.run.launcher import _Job

    go = tmp_path / "go"
    shell = f"while [ ! -e {go} ]; do sleep 0.05; done; exec env RANK=5 sleep 60"
    agent = subprocess.Popen([sys.executable, "-c", f"import subprocess; subprocess.run(['sh', '-c', {shell!r}])"])
    job = _Job([agent])
    try:
        deadline = time.monotonic() + 60
        while not job.seen and time.monotonic() < deadline:
            job.track()
            time.sleep(0.05)
        assert job.seen and job.running_ranks() == []  # the worker is there, its RANK not yet
        go.touch()
        while job.running_ranks() != [5] and time.monotonic() < deadline:
            job.track()
            time.sleep(0.05)
        assert job.running_ranks() == [5]
    finally:
        job.stop()
    assert agent.poll() is not None and job.running_ranks() == []


def test_stall_detection_stops_a_silent_job(runs_dir):
    res = launch(WORKER, nproc=2, args=["--steps", "1", "--hang"], stall_timeout=3, live=False, check=False)
    assert res.status == "stalled" and "no rank printed or logged for 3 s" in res.error.summary
    assert_nothing_left(res)


def test_workers_that_ignore_sigterm_and_their_children_are_killed(runs_dir):
    res = launch(WORKER, nproc=2, args=["--steps", "1", "--hang", "--ignore-sigterm", "--grandchild"],
                 timeout=8, live=False, check=False)
    assert res.status == "timeout"
    assert_nothing_left(res)


def test_flooding_rank_keeps_whole_lines(runs_dir, capsys):
    res = launch(WORKER, nproc=2, args=["--flood", "20000", "--steps", "1"], live="text")
    out = capsys.readouterr().out.splitlines()
    flood = [ln for ln in out if "flood line" in ln]
    assert len(flood) == 40000
    # every printed line is one whole line of one rank: prefix and rank inside the text agree
    assert all(ln.startswith(f"[rank {ln.split('from rank ')[1][0]}] flood line") for ln in flood)
    assert res.ok


HANG = {"script": str(WORKER), "nproc": 2, "args": ["--steps", "1", "--hang"]}


def _launch_in_child(tmp_path, runs_dir, jobs=1):
    """A separate Python process (standing in for a Jupyter kernel) that launches a long job, or `jobs` of them
    side by side (launch_all); (process, run dir, pids) once every job's ranks have logged a step.

    Like a kernel it installs Python's own SIGINT handler: started from a background job of a non-interactive
    shell (some CI runners) it would inherit SIGINT ignored, and the interrupt test would interrupt nothing."""
    start = (f"gpucourse.launch(**{HANG!r}, live='text')" if jobs == 1 else
             f"gpucourse.launch_all([{HANG!r}] * {jobs})")
    code = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import gpucourse
        try:
            {start}
        except KeyboardInterrupt:
            print("CAUGHT KeyboardInterrupt", flush=True)
            raise
    """)
    with open(tmp_path / "kernel.out", "w") as out:
        # the child inherits $GPUCOURSE_RUNS_DIR = runs_dir (the fixture sets it in this process's environment)
        kernel = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        runs = list(runs_dir.glob("*/metrics/rank1.jsonl"))
        if len(runs) == jobs and all((r.parent / "rank0.jsonl").exists() and "step" in r.read_text() for r in runs):
            run_dirs = [r.parent.parent for r in runs]
            pids = [p.pid for run_dir in run_dirs for p in run_processes(run_dir)]
            assert len(pids) >= 3 * jobs  # an agent and two workers each
            return kernel, (run_dirs[0] if jobs == 1 else run_dirs), pids
        time.sleep(0.2)
    kernel.kill()
    raise AssertionError("the job never started: " + (tmp_path / "kernel.out").read_text())


def test_kernel_killed_with_sigkill_leaves_nothing(tmp_path, runs_dir):
    kernel, run_dir, pids = _launch_in_child(tmp_path, runs_dir)
    kernel.send_signal(signal.SIGKILL)
    kernel.wait()
    assert_nothing_left(run_dir, pids)


def test_interrupt_stops_job_and_records_it(tmp_path, runs_dir):
    kernel, run_dir, pids = _launch_in_child(tmp_path, runs_dir)
    kernel.send_signal(signal.SIGINT)  # what Jupyter's stop button does to a kernel
    kernel.wait(timeout=30)
    assert "CAUGHT KeyboardInterrupt" in (tmp_path / "kernel.out").read_text()
    assert gpucourse.load_run(run_dir).status == "interrupted"
    assert_nothing_left(run_dir, pids)


def test_interrupting_launch_all_stops_every_job(tmp_path, runs_dir):
    kernel, run_dirs, pids = _launch_in_child(tmp_path, runs_dir, jobs=2)
    kernel.send_signal(signal.SIGINT)
    kernel.wait(timeout=60)
    assert "CAUGHT KeyboardInterrupt" in (tmp_path / "kernel.out").read_text()
    assert [gpucourse.load_run(d).status for d in run_dirs] == ["interrupted", "interrupted"]
    for run_dir in run_dirs:
        assert_nothing_left(run_dir, pids)


def test_launch_all_runs_side_by_side_and_raises_after_all_have_ended(runs_dir, capsys):
    fine, failing = {"script": WORKER, "nproc": 1}, {"script": WORKER, "nproc": 2, "args": ["--fail-rank", "1"]}
    ok, failed = gpucourse.launch_all([fine, {**failing, "check": False}])
    assert (ok.status, failed.status) == ("ok", "failed") and ok.run_dir != failed.run_dir
    assert failed.error.rank == 1
    lines = capsys.readouterr().out.splitlines()  # outside a notebook: one summary line per job, in order
    assert [line.split(":")[0] for line in lines] == [ok.name, failed.name], lines
    with pytest.raises(gpucourse.LaunchError, match="rank 1") as raised:
        gpucourse.launch_all([failing, fine])
    assert raised.value.result.status == "failed"
    assert {r.status for r in map(gpucourse.load_run, runs_dir.iterdir()) if r.status != "ok"} == {"failed"}
    with pytest.raises(LaunchConfigError, match="job 1 must be a dict"):
        gpucourse.launch_all([fine, {"nproc": 2}])


def test_runtime_script_also_runs_as_plain_python(tmp_path, runs_dir):
    out = subprocess.run([sys.executable, str(WORKER), "--steps", "2"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "rank 0 step 1 sum 1" in out.stdout
    assert list(runs_dir.glob("worker-torchrun-*/metrics/rank0.jsonl"))


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc": 0}, "nproc=0 is out of range"),
    ({"nproc": -2}, "nproc=-2 is out of range"),
    ({"nproc": 10**6}, "out of range"),
    ({"nproc": 2.5}, "nproc must be a whole number"),
    ({"backend": "smoke-signals"}, "unknown backend 'smoke-signals'"),
    ({"backend": "nccl"}, "NCCL needs one GPU per rank"),
    ({"timeout": 0}, "timeout must be a positive number"),
    ({"timeout": -1}, "timeout must be a positive number"),
    ({"timeout": "soon"}, "timeout must be a positive number"),
    ({"stall_timeout": float("nan")}, "stall_timeout must be a positive number"),
    ({"args": "--steps 3"}, "args must be a list of strings"),
])
def test_bad_input_is_refused_before_anything_starts(runs_dir, kwargs, message):
    if kwargs.get("backend") == "nccl" and gpucourse.run.hardware.gpu_count() >= 2:
        pytest.skip("this machine has GPUs for NCCL")
    with pytest.raises(LaunchConfigError, match=message.replace("(", r"\(")):
        launch(WORKER, **{"live": False, **kwargs})
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_bad_scripts_are_refused(tmp_path, runs_dir):
    with pytest.raises(LaunchConfigError, match="script not found: .*missing.py"):
        launch(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    pass\n")
    with pytest.raises(LaunchConfigError, match="broken.py has a syntax error at line 1"):
        launch(broken)


def test_unwritable_runs_dir_is_refused(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(RUNS_ENV, str(blocker / "runs"))  # not the runs_dir fixture: this one must be unwritable
    with pytest.raises(LaunchConfigError, match="cannot write the runs directory .*GPUCOURSE_RUNS_DIR"):
        launch(WORKER, live=False)


def test_widget_view_fills_one_pane_per_rank(runs_dir, monkeypatch):
    pytest.importorskip("ipywidgets")
    from gpucourse import live

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    res = launch(WORKER, nproc=2, args=["--steps", "4"], live="widget")
    view_box = shown[0]
    status, progress_row, tabs, _style = view_box.children
    bar = progress_row.children[0]
    assert bar.value == bar.max == 4 and bar.bar_style == "success"
    panes = tabs.children
    assert len(panes) == 3
    assert "rank 1 step 3 sum 7" in panes[2].outputs[0]["text"]
    assert "rank 0 step 3" not in panes[2].outputs[0]["text"]
    assert "[rank 0] rank 0 step 3 sum 7" in panes[0].outputs[0]["text"]
    assert "finished" in status.value and res.ok
    assert live.WidgetView.MAX_LINES >= 100


def _widget_launch(monkeypatch, *args, **kwargs):
    """launch() in the widget view, as JupyterLab would show it: returns the result and the view's panes."""
    pytest.importorskip("ipywidgets")
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    res = launch(WORKER, *args, live="widget", check=False, **kwargs)
    tabs = next(child for child in shown[0].children if hasattr(child, "selected_index"))
    return res, [pane.outputs[0]["text"] if pane.outputs else "" for pane in tabs.children]


def test_widget_view_leaves_profiler_noise_to_the_log_files(runs_dir, monkeypatch):
    res, panes = _widget_launch(monkeypatch, nproc=2, args=["--steps", "4", "--profile"])
    assert res.ok and "rank 1 step 3 sum 7" in panes[2]
    on_disk = res.log(1, "stdout") + res.log(1, "stderr")  # Kineto's stream has changed across versions
    assert "profiler_start" in on_disk and "USDT" not in "".join(panes)


def test_widget_view_shows_torch_rank_prefix_once(runs_dir, monkeypatch):
    res, panes = _widget_launch(monkeypatch, nproc=2, args=["--steps", "3", "--fail-rank", "1"])
    assert res.error.rank == 1
    assert "\n[rank 1] ValueError: deliberate failure on rank 1\n" in "\n" + panes[0]  # one kind of prefix
    assert "[rank1]:" not in panes[0] and "[rank1]: ValueError" in panes[2]  # rank 1's pane: as written


def test_papermill_cell_timeout_leaves_nothing(tmp_path, runs_dir):
    """papermill interrupts, then shuts the kernel down (SIGINT → SIGTERM → SIGKILL within seconds)."""
    nbformat = pytest.importorskip("nbformat")
    papermill = pytest.importorskip("papermill")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import gpucourse"),
        nbformat.v4.new_code_cell(f"gpucourse.launch({str(WORKER)!r}, nproc=2, args=['--steps', '1', '--hang'])"),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "hang.ipynb")
    with pytest.raises(Exception):
        papermill.execute_notebook(str(tmp_path / "hang.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                                   execution_timeout=15, progress_bar=False)
    run_dirs = list(runs_dir.glob("worker-*"))
    assert len(run_dirs) == 1
    assert_nothing_left(run_dirs[0])


def test_profile_writes_one_trace_per_rank_with_step_markers(runs_dir):
    res = launch(WORKER, nproc=2, args=["--steps", "6", "--profile"], live=False)
    assert sorted(res.traces) == [0, 1]
    trace = json.loads(res.traces[1].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("ProfilerStep#") for n in names)
    assert any("allreduce" in n for n in names)


def test_simulated_nodes_have_distinct_node_ranks(runs_dir):
    res = launch(WORKER, nproc=1, nnodes=2, args=["--steps", "2"], live=False)
    assert res.ok and res.world_size == 2
    assert res.metric("sum", rank=1) == [1.0, 3.0]
    assert sorted(p.name for p in res.run_dir.glob("exit*.json")) == ["exit-node0.json", "exit-node1.json"]


def test_runtime_script_runs_under_plain_torchrun(tmp_path, runs_dir):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(WORKER), "--steps", "2"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    metrics = sorted(runs_dir.glob("worker-torchrun-*/metrics/rank*.jsonl"))
    assert [m.name for m in metrics] == ["rank0.jsonl", "rank1.jsonl"]  # both ranks chose the same folder


def test_script_arguments_that_look_like_torchrun_options_reach_the_script(runs_dir):
    res = launch(JOBS / "echo_args.py", nproc=1, args=["--nproc", "7", "--standalone", "x y", "--", "z"], live=False)
    assert res.log(0).strip() == "['--nproc', '7', '--standalone', 'x y', '--', 'z']"
    assert res.manifest["torchrun"][-6:] == ["--nproc", "7", "--standalone", "x y", "--", "z"]


def test_run_commands_returns_each_exit_and_output_and_kills_what_outlives_its_wait():
    import os

    from gpucourse.run.procs import free_port, last_words, run_commands

    env = dict(os.environ)
    code = "import os, sys; print('rank', os.environ['R']); sys.exit(int(os.environ['R']))"
    out = run_commands([([sys.executable, "-c", code], {**env, "R": "0"}),
                        ([sys.executable, "-c", code], {**env, "R": "3"}),
                        ([sys.executable, "-c", "import time; time.sleep(600)"], env)], wait_s=1, grace_s=1)
    assert [c for c, _ in out] == [0, 3, -9] and out[1][1].strip() == "rank 3"  # the sleeper was SIGKILLed
    assert 0 < free_port() < 65536
    text = "warning: slow\nTraceback (most recent call last):\n  x\ntorch.distributed.DistStoreError: timed out\n[W] bye"
    assert last_words(text) == "torch.distributed.DistStoreError: timed out"
    assert last_words("") == "(nothing)" and last_words("a\nb\n") == "b"
    with pytest.raises(ValueError, match="at least one"):
        run_commands([], wait_s=1)
