"""Bad input that the older test files do not cover: script arguments that are not strings, unwritable runs
directories, non-UTF-8 output from ranks, broken notebooks, outputs that must not be overwritten.

The rule everywhere: the Python API raises one clear sentence (LaunchConfigError, CourseError...), the CLI prints
it on one line and exits 2, and nothing already on disk is changed.
"""
import re
from pathlib import Path

import nbformat
import pytest

from gpucourse.tools import cli, course
from gpucourse.run.contract import RUNS_ENV
from gpucourse.tools.course import CourseError, execute_notebook
from gpucourse.run.launcher import LaunchConfigError, launch

from tests.conftest import JOBS, run_cli

WORKER = JOBS / "worker.py"
BAD_BYTES = JOBS / "bad_bytes.py"


def snapshot(folder: Path) -> dict:
    """Every path under `folder` with its bytes (None for a folder): proof that nothing was written or lost."""
    return {p: p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def assert_one_line(stderr: str, message: str) -> None:
    assert message in stderr and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr


# --- launch(): refused before anything starts ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"args": [1, None, 2.5]}, "args[1] is None: each script argument must be a string"),
    ({"args": ["--steps", ["3"]]}, "args[1] is ['3']"),
    ({"args": [b"--steps"]}, "args[0] is b'--steps'"),
    ({"args": [object()]}, "args[0] is <object object"),
    ({"args": 3}, "args must be a list of strings, e.g. args=['--steps', '10'], not 3"),
    ({"args": None}, "args must be a list of strings"),
    ({"name": 7}, "name must be a string (the run's name) or None, not 7"),
    ({"env": {"OMP_NUM_THREADS": 1, 2: "x"}}, "env must be a dict like {'NAME': 'value'} or None"),
    ({"env": ["A=1"]}, "env must be a dict"),
    ({"live": "loud"}, "live must be True, False, 'widget', 'text' or 'off', not 'loud'"),
    ({"script": None}, "script must be the path of a Python file, not None"),
    ({"script": JOBS}, "is a directory: give the path of a Python file in it"),
])
def test_bad_launch_requests_start_nothing(runs_dir, kwargs, message):
    kwargs = {"script": WORKER, "live": False, **kwargs}
    with pytest.raises(LaunchConfigError, match=re.escape(message)):
        launch(kwargs.pop("script"), **kwargs)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


@pytest.mark.parametrize("source, message", [
    (b"x = 1\x00\n", "bad.py has a syntax error"),
    (b"print('caf\xe9')\n", "bad.py has a syntax error at line 1"),  # Latin-1 bytes: not a UTF-8 Python file
])
def test_scripts_that_are_not_python_are_refused(tmp_path, runs_dir, source, message):
    (tmp_path / "bad.py").write_bytes(source)
    with pytest.raises(LaunchConfigError, match=re.escape(message)):
        launch(tmp_path / "bad.py", live=False)


def test_numbers_and_paths_in_args_are_passed_as_strings(tmp_path, runs_dir):
    res = launch(JOBS / "echo_args.py", nproc=1, args=[1, 2.5, tmp_path / "a b"], live=False)
    expected = ["1", "2.5", str(tmp_path / "a b")]
    assert res.log(0).strip() == str(expected) and res.manifest["args"] == expected


@pytest.mark.parametrize("where", ["under a file", "sysfs"])
def test_unwritable_runs_dir_is_one_sentence_in_python_and_cli(tmp_path, monkeypatch, where):
    if where == "sysfs":
        if not Path("/sys/kernel").is_dir():
            pytest.skip("no sysfs here")
        runs = Path("/sys/gpucourse-test-runs")  # read-only for every user, root included
    else:
        (tmp_path / "file").write_text("keep me")
        runs = tmp_path / "file" / "runs"
    before = snapshot(tmp_path)
    monkeypatch.setenv(RUNS_ENV, str(runs))  # not the runs_dir fixture: this folder must be unwritable
    with pytest.raises(LaunchConfigError, match="cannot write the runs directory .*Set GPUCOURSE_RUNS_DIR"):
        launch(WORKER, live=False)
    out = run_cli("launch", WORKER)
    assert out.returncode == 2
    assert_one_line(out.stderr, f"gpucourse launch: error: cannot write the runs directory {runs}")
    assert snapshot(tmp_path) == before


# --- rank output that is not UTF-8 ------------------------------------------------------------------------
def test_non_utf8_rank_output_shows_replacement_characters(runs_dir, capsys):
    res = launch(BAD_BYTES, nproc=2, live="text")
    out, err = capsys.readouterr()
    assert res.ok
    assert "[rank 1] rank 1 caf\ufffd \ufffd\ufffd out" in out
    assert "[rank 0] rank 0 \ufffd( err" in err and "[rank 1] no newline \ufffd" in err
    assert res.log(1) == "rank 1 caf\ufffd \ufffd\ufffd out\n"
    assert res.log(0, "stderr") == "rank 0 \ufffd( err\nno newline \ufffd"


@pytest.mark.parametrize("encoding, extra, code, shown", [
    ("utf-8", [], 0, "caf\ufffd \ufffd\ufffd out"),
    ("ascii", ["--", "--fail"], 1, "caf? ?? out"),  # a terminal that cannot show U+FFFD (nor the em dash)
])
def test_cli_streams_non_utf8_output(runs_dir, encoding, extra, code, shown):
    out = run_cli("launch", BAD_BYTES, "-n", "1", *extra, env={"PYTHONIOENCODING": encoding})
    assert out.returncode == code, out.stderr
    assert f"[rank 0] rank 0 {shown}" in out.stdout and "Traceback" not in out.stderr
    if code:
        assert "rank 0 failed (exit code 3)" in out.stderr
    listed = run_cli("runs", env={"PYTHONIOENCODING": encoding})
    assert listed.returncode == 0 and "bad_bytes" in listed.stdout, listed.stderr


# --- gpucourse course and the papermill path ----------------------------------------------------------------
@pytest.fixture
def course_dir(tmp_path, monkeypatch):
    """A course whose notebooks/ holds one valid notebook, 00_good.ipynb."""
    books = tmp_path / "notebooks"
    books.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]), books / "00_good.ipynb")
    monkeypatch.setattr(course, "notebooks_dir", lambda: books)
    return tmp_path


def main(argv: list[str]) -> int:
    """`gpucourse ARGV` in this process (the course's notebooks folder is patched)."""
    try:
        return cli.main(argv)
    except SystemExit as done:  # argparse's own errors
        return done.code


@pytest.mark.parametrize("files, argv, message", [
    ({"notebooks/01_broken.ipynb": b"not json {"}, ["--only", "01"],
     "01_broken.ipynb is not a valid notebook (not JSON): restore it (git checkout --"),
    ({"notebooks/01_broken.ipynb": b"not json {"}, [], "01_broken.ipynb is not a valid notebook"),  # 00 not run
    ({"notebooks/01_odd.ipynb": b'{"cells": 3}'}, ["--only", "01"], "01_odd.ipynb is not a valid notebook"),
    ({"notebooks/01_latin1.ipynb": b'{"cells": "caf\xe9"}'}, ["--only", "01"], "01_latin1.ipynb is not a valid"),
    ({}, ["--output", "{tmp}/notebooks"], "holds the source notebooks: executed copies would overwrite them"),
    ({"mine.txt": b"keep"}, ["--output", "{tmp}/mine.txt"], "mine.txt is a file, not a folder"),
    ({"work/00_good.ipynb": b"my own notes"}, ["--output", "{tmp}/work"],
     "00_good.ipynb exists and is not an executed copy from an earlier run: it is left untouched"),
    ({}, ["--cell-timeout", "-5"], "argument --cell-timeout: must be a positive number of seconds, got '-5'"),
    ({}, ["--smoke", "--refresh-checked"], "--refresh-checked runs the learner defaults; drop --smoke"),
    ({}, ["--only", "99"], "no notebook matches 99; the notebooks are: 00_good"),
])
def test_course_bad_input_is_one_line_and_changes_nothing(course_dir, capsys, files, argv, message):
    for name, data in files.items():
        (course_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (course_dir / name).write_bytes(data)
    before = snapshot(course_dir)
    assert main(["course", *(a.format(tmp=course_dir) for a in argv)]) == 2
    assert_one_line(capsys.readouterr().err, message)
    assert snapshot(course_dir) == before


def test_papermill_path_refuses_broken_notebooks_and_the_sources(course_dir):
    books = course_dir / "notebooks"
    (books / "01_broken.ipynb").write_text("not json")
    before = snapshot(course_dir)
    with pytest.raises(CourseError, match=r"01_broken.ipynb is not a valid notebook \(not JSON\)"):
        execute_notebook(books / "01_broken.ipynb", course_dir / "executed")
    with pytest.raises(CourseError, match="holds the source notebooks"):
        execute_notebook(books / "00_good.ipynb", books)
    with pytest.raises(CourseError, match="cell_timeout must be a positive number of seconds or None, not 0"):
        execute_notebook(books / "00_good.ipynb", course_dir / "executed", cell_timeout=0)
    assert snapshot(course_dir) == before
