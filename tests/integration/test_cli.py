"""The `gpucourse` command: same launcher, shell exit codes, one-line errors (never a traceback)."""
import pytest

from tests.conftest import JOBS, RUNS_ENV, run_cli, run_processes

WORKER = str(JOBS / "worker.py")
LAUNCHES = pytest.mark.xdist_group("cli-launches")  # the tests that read `launches`: one worker launches them once


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """A job that succeeds, then one whose rank 1 fails, launched with `gpucourse launch` into a runs folder of
    their own: (the successful command's output, the failed one's, the folder)."""
    env = {RUNS_ENV: str(tmp_path_factory.mktemp("cli-runs"))}
    ok = run_cli("launch", WORKER, "-n", "2", "--", "--steps", "2", env=env)
    failed = run_cli("launch", WORKER, "-n", "2", "-q", "--", "--fail-rank", "1", "--steps", "4", "--step-time", "0.2",
                     env=env)
    return ok, failed, env


@LAUNCHES
def test_launch_success_streams_ranks_and_exits_zero(launches):
    out = launches[0]
    assert out.returncode == 0, out.stderr
    assert "[rank 1] rank 1 step 1 sum 3" in out.stdout
    assert "finished" in out.stdout


@LAUNCHES
def test_launch_failure_exits_one_with_root_cause(launches):
    out = launches[1]
    assert out.returncode == 1
    assert "rank 1 failed (exit code 1): ValueError: deliberate failure on rank 1" in out.stderr


def test_launch_timeout_exits_124_and_leaves_nothing(runs_dir):
    out = run_cli("launch", WORKER, "-n", "2", "-q", "--timeout", "6", "--", "--hang")
    assert out.returncode == 124
    assert "timed out after 6 s" in out.stderr
    for run_dir in runs_dir.iterdir():
        assert run_processes(run_dir) == []


@pytest.mark.parametrize("args, message", [
    (["launch", "missing.py"], "script not found: missing.py"),
    (["launch", WORKER, "-n", "0"], "nproc=0 is out of range"),
    (["launch", WORKER, "-n", "-3"], "nproc=-3 is out of range"),
    (["launch", WORKER, "--backend", "carrier-pigeon"], "unknown backend 'carrier-pigeon'"),
    (["launch", WORKER, "--timeout", "-1"], "must be a positive number of seconds"),
    (["launch", WORKER, "--timeout", "later"], "expected a number of seconds"),
    (["launch", str(JOBS)], "is a directory: give the path of a Python file in it"),
    (["launch", WORKER, "-n", "two"], "argument -n/--nproc: invalid int value: 'two' (see gpucourse launch --help)"),
    (["launch", WORKER, "--max-restarts", "-1"], "max_restarts=-1 is out of range"),
    (["launch", WORKER, "--nnodes", "2", "--node-rank", "5"], "node_rank=5 is out of range: use 0 to 1"),
    (["launch"], "gpucourse launch: error: the following arguments are required: script"),
    ([], "gpucourse: error: the following arguments are required: command"),
    (["teleport"], "argument command: invalid choice: 'teleport'"),
    (["runs", "--last", "0"], "argument --last: must be at least 1, got '0'"),
    (["runs", "--dir", "/no/such/runs"], "--dir /no/such/runs is not a folder"),
    (["doctor", "-n", "0"], "nproc=0 is out of range"),
])
def test_bad_input_one_line_exit_two(runs_dir, args, message):
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert not runs_dir.exists() or not any(runs_dir.iterdir())  # nothing was started


def test_nccl_without_gpus_is_refused(runs_dir):
    from gpucourse.run.hardware import gpu_count

    if gpu_count() >= 2:
        pytest.skip("this machine has GPUs")
    out = run_cli("launch", WORKER, "--backend", "nccl")
    assert out.returncode == 2 and "NCCL needs one GPU per rank" in out.stderr and "gloo" in out.stderr


@LAUNCHES
def test_runs_lists_status_and_root_cause(launches):
    out = run_cli("runs", env=launches[2])
    assert out.returncode == 0
    lines = out.stdout.splitlines()[1:]
    assert len(lines) == 2
    assert " ok " in lines[0] and " failed " in lines[1]
    assert "rank 1 failed" in lines[1]


def test_doctor_reports_hardware_and_runs_smoke_job(runs_dir):
    out = run_cli("doctor")
    assert out.returncode == 0, out.stderr
    assert "CPUs" in out.stdout and "launcher default" in out.stdout
    assert "doctor: OK — all-reduce over 2 rank(s)" in out.stdout


def test_course_refuses_unknown_notebook_names():
    out = run_cli("course", "--only", "99_nope")
    assert out.returncode == 2
    assert "no notebook matches 99_nope" in out.stderr and "00_setup_and_first_launch" in out.stderr


def test_course_runs_notebooks_without_ipykernels_tcp_warning(tmp_path):
    """`gpucourse course` printed ipykernel's "Kernel is running over TCP without encryption" once per
    notebook. Its kernels talk over Unix sockets (tools/course.py, local_kernel_manager): no warning, same run."""
    import subprocess
    import sys

    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "99_probe.ipynb")
    code = ("import sys; from pathlib import Path; from gpucourse.tools.course import execute_notebook; "
            "r = execute_notebook(Path(sys.argv[1]), Path(sys.argv[2])); print(r.status)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "99_probe.ipynb"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    assert "without encryption" not in out.stderr + out.stdout
    assert nbformat.read(tmp_path / "out" / "99_probe.ipynb", 4).cells[0].outputs[0]["text"] == "42\n"
