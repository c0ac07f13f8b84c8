"""Every chapter notebook executed in CI: papermill at smoke sizes, nbval over the checked cells at the learner's
sizes. (Read without running: tests/unit/test_notebook_files.py.)"""
import subprocess
import sys

import nbformat
import pytest

from gpucourse.tools.course import CHECK_MARK, find_notebooks, with_expected_outputs, with_parameters

from tests.conftest import ROOT, chapter, run_processes

NOTEBOOKS = find_notebooks()


def _cells(path):
    return nbformat.read(path, as_version=4).cells


CHECKED = [p for p in NOTEBOOKS if any(CHECK_MARK in c.source for c in _cells(p))]


# chapters whose smoke runs other tests read (test_reshard, test_restarts: 08; test_forensics: 08b;
# test_async_checkpoints: 08c; test_training_through_failures: 08d; test_capstone: 09; test_context_parallel: 10;
# test_moe_frontier: 11; test_dryrun: 12; test_capstone_3d: 13)
SHARED = {"08_multinode_faults_hangs", "08b_hangs_and_desyncs", "08c_async_checkpoints_and_slow_ranks",
          "08d_training_through_failures",
          "09_capstone_2d_parallel", "10_context_parallel", "11_expert_parallel", "12_at_scale_on_your_laptop",
          "13_3d_parallel_and_silent_bugs"}


@pytest.mark.notebook
@pytest.mark.timeout(1200)  # a whole notebook of real launches: minutes on a busy 2-core machine; speed is not the test
@pytest.mark.parametrize("path", [pytest.param(p, marks=chapter(p.stem) if p.stem in SHARED else ())
                                  for p in NOTEBOOKS if p not in CHECKED], ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(path, smoke_chapter):
    """Run from a learner's copy (see smoke_chapter). The chapters with checked cells are left to
    test_checked_cells_match_with_nbval, which runs every one of their cells at the learner's own sizes: running
    them again at smoke sizes cost a minute of CI and proved nothing more."""
    result, runs = smoke_chapter(path)
    assert result.status == "ok", f"{path.name} failed in cell {result.failing_cell}: {result.error}"
    # The 3-minute budget per notebook is measured by benchmarks/course_smoke.py, not asserted here.
    for run_dir in runs.glob("*"):
        assert run_processes(run_dir) == [], f"{run_dir.name} left processes behind"


@pytest.mark.notebook
@pytest.mark.parametrize("path", CHECKED, ids=lambda p: p.stem)
def test_checked_cells_match_with_nbval(path, tmp_path, runs_dir):
    """nbval (lax) re-runs the notebook with learner defaults and compares the marked cells with the stored
    reference. The copy sits beside the original so the notebook's relative paths (../scripts) still hold.
    Sizes the checked cells do not show may be smaller (the notebook's metadata `gpucourse.nbval`)."""
    copy = with_expected_outputs(path, path.with_name(f".nbval-{path.name}"))
    smaller = nbformat.read(path, as_version=4).metadata.get("gpucourse", {}).get("nbval")
    if smaller:
        with_parameters(copy, copy, smaller)
    env = {**__import__("os").environ, "GPUCOURSE_LIVE": "text"}  # and runs_dir's $GPUCOURSE_RUNS_DIR
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-kernel-name", "python3",
                              "--nbval-sanitize-with", str(ROOT / "tests" / "nbval_sanitize.cfg"),
                              "--nbval-cell-timeout", "300", str(copy)],
                             capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    finally:
        copy.unlink()
    assert out.returncode == 0, out.stdout[-4000:]
    for run_dir in runs_dir.glob("*"):
        assert run_processes(run_dir) == [], f"{run_dir.name} left processes behind"
