"""Root-cause attribution: the rank that failed by itself is named, never a rank torchrun stopped because of it.

torchrun timestamps failures to the second and SIGTERMs the survivors as soon as one rank fails, so an
innocent rank 0 (-15, SIGTERM) ties with the rank that aborted or crashed. Each job here runs 3 ranks
with the failing rank > 0, so naming rank 0 is the wrong answer.
"""
import time

import psutil
import pytest

from gpucourse.run.contract import RUN_DIR_ENV, root_rank
from gpucourse.run.launcher import launch

from tests.conftest import JOBS, ROOT

FAIL_MODES = JOBS / "fail_modes.py"
NPROC = 3


def _survivors(runs_dir) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(RUN_DIR_ENV, "").startswith(f"{runs_dir}/") and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def no_survivors(runs_dir):
    """After the test, pass or fail: no process of its runs is left (any found are killed, then the test fails)."""
    yield runs_dir
    deadline = time.monotonic() + 10
    while _survivors(runs_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _survivors(runs_dir)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert left == [], f"processes outlived their run: {left}"


def _launch(mode: str, rank: int, others: str):
    return launch(FAIL_MODES, nproc=NPROC, args=["--mode", mode, "--rank", str(rank), "--others", others],
                  live=False, check=False, timeout=120, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("mode, rank, others, exitcode, signal, text", [
    ("raise", 2, "collective", 1, "", "rank 2 failed (exit code 1): ValueError: deliberate failure on rank 2"),
    ("abort", 1, "sleep", -6, "SIGABRT", "rank 1 failed (exit code -6): killed by SIGABRT"),
    ("exit", 1, "collective", 3, "", "rank 1 failed (exit code 3): no traceback was written"),
    ("segv", 2, "sleep", -11, "SIGSEGV", "rank 2 failed (exit code -11): killed by SIGSEGV"),
])
def test_the_rank_that_failed_by_itself_is_named(no_survivors, mode, rank, others, exitcode, signal, text):
    res = _launch(mode, rank, others)
    assert res.status == "failed", res.summary()
    assert (res.error.rank, res.error.exitcode, res.error.signal) == (rank, exitcode, signal), res.summary()
    assert res.error.summary.startswith(text), res.error.summary
    assert not res.error.after_work_finished
    assert res.returncodes[rank] == exitcode
    # The innocent ranks failed too (stopped by torchrun, or reporting the lost peer): the choice was real.
    assert all(res.returncodes[r] not in (0, None) for r in range(NPROC)), res.returncodes


def test_a_rank_stopped_while_writing_its_error_file_does_not_hide_the_root_cause(no_survivors):
    # The innocent ranks' error files are empty when torchrun SIGTERMs them; torchrun reads them for its
    # records and, unguarded, crashes with JSONDecodeError ("torchrun could not run the job").
    res = _launch("exit", 1, "torn")
    assert res.status == "failed", res.summary()
    assert (res.error.rank, res.error.exitcode) == (1, 3), res.summary()
    assert res.returncodes[0] == -15 and res.returncodes[2] == -15, res.returncodes


def test_an_abort_at_exit_after_all_work_is_reported_as_such(no_survivors):
    res = _launch("abort-at-exit", 1, "sleep")
    assert res.status == "failed"
    assert res.returncodes[0] == -15 and res.returncodes[2] == -15  # the innocent ranks torchrun SIGTERMed
    err = res.error
    assert (err.rank, err.exitcode, err.signal, err.after_work_finished) == (1, -6, "SIGABRT", True), err
    assert err.summary == ("rank 1 aborted at interpreter exit (SIGABRT: terminate called without an active "
                           "exception) after every rank had finished its work; the results on disk are complete")
    assert "failed at exit, after every rank had finished its work" in res.summary().splitlines()[0]
    assert "The results on disk are complete" in res._repr_html_()
    assert all(rec.get("event") is None for recs in res.metrics.values() for rec in recs)  # teardown records hidden


def _failure(rank, exitcode, signal="<N/A>", message="", timestamp=100):
    return {"rank": rank, "local_rank": rank, "exitcode": exitcode, "pid": 1000 + rank, "signal": signal,
            "timestamp": timestamp, "message": message}


def test_root_rank_order_without_processes():
    """The exit record of the failure first seen in the wild, and its neighbours, ordered without a job."""
    sigterm, sigkill = (-15, "SIGTERM"), (-9, "SIGKILL")
    abort = _failure(1, -6, "SIGABRT")
    assert root_rank([_failure(0, *sigterm), abort, _failure(2, *sigterm), _failure(3, *sigterm)]) == 1
    # Stopped after torchrun's grace period (SIGKILL, 30 s after the stop began), or reporting the peer: still not
    # the root cause. A SIGKILL sooner than the grace period is the rank's own end (contract.stopped).
    peer = {"message": "RuntimeError: Connection closed by peer [127.0.0.1]:1234", "traceback": "..."}
    assert root_rank([_failure(0, 1, message=peer, timestamp=99), _failure(1, *sigkill, timestamp=130),
                      _failure(2, 3)]) == 2
    assert root_rank([_failure(0, 1, message=peer, timestamp=99), _failure(1, *sigkill), _failure(2, 3)]) == 1
    # A crash beats an earlier-stopped rank; among failures of the same kind the earliest wins.
    assert root_rank([_failure(0, *sigterm, timestamp=90), _failure(2, -11, "SIGSEGV")]) == 2
    assert root_rank([_failure(0, -11, "SIGSEGV", timestamp=101), _failure(2, -6, "SIGABRT")]) == 2
    # Only stopped ranks (someone killed the job's rank from outside): the earliest, then the lowest.
    assert root_rank([_failure(0, *sigterm), _failure(2, *sigkill, timestamp=99)]) == 2


def _failed_run(tmp_path, failures, nproc=2):
    """A run directory as the launcher leaves a failed 1-node job (manifest + the agent's exit file), no processes."""
    import json

    from gpucourse.run.contract import exit_file, manifest_file

    manifest = {"name": "x", "script": str(ROOT / "scripts" / "00_failure.py"), "args": ["--failing-rank", "1"],
                "backend": "gloo", "nproc_per_node": nproc, "nnodes": 1, "world_size": nproc, "max_restarts": 0,
                "status": "failed", "start": 100.0, "duration": 5.0}
    tmp_path.mkdir(parents=True)
    manifest_file(tmp_path).write_text(json.dumps(manifest))
    exit_file(tmp_path, "").write_text(json.dumps({"status": "failed", "root_rank": root_rank(failures),
                                                   "failures": failures}))
    from gpucourse.run.result import load_run

    return load_run(tmp_path)


GLOO_PEER = {"message": "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:48299. This is typically caused by a remote worker crashing.",
             "traceback": "..."}
OWN_ERROR = {"message": "RuntimeError: size mismatch, got input (3), mat (3x4), vec (3)", "traceback": "..."}


def test_chapter_00s_failure_story_is_read_from_the_run(tmp_path):
    """Chapter 00 taught that exit code 1 marks the culprit and -15 the bystanders, under a run whose two
    ranks both exited 1 (gloo: the survivor raises 'Connection closed by peer'). The story is told from the run."""
    from gpucourse.viz.reports import failure_story

    gloo = _failed_run(tmp_path / "gloo", [_failure(0, 1, message=GLOO_PEER, timestamp=101),
                                           _failure(1, 1, message=OWN_ERROR, timestamp=100)])
    assert [(e.rank, e.exitcode, e.second, e.kind, e.root_cause) for e in gloo.failures] == [
        (0, 1, 1, "reported a peer's failure", False), (1, 1, 0, "failed on its own", True)]
    story = failure_story(gloo).replace("\n", " ")
    assert "Rank 0 ended exactly as rank 1 did (exit code 1): the exit codes alone cannot name the culprit" in story
    assert "Rank 0 did not wait to be stopped" in story and "pair.cc" not in story
    assert "names rank 1: it failed on its own, and it was the first to fail (+0 s)" in story
    assert gloo.command == "torchrun --standalone --nproc-per-node 2 scripts/00_failure.py --failing-rank 1"

    # NCCL's usual way: the survivors wait in the collective until torchrun stops them, in the same second.
    nccl = _failed_run(tmp_path / "nccl", [_failure(0, -15, "SIGTERM"), _failure(1, 1, message=OWN_ERROR),
                                           _failure(2, -15, "SIGTERM")], nproc=3)
    story = failure_story(nccl).replace("\n", " ")
    assert "the exit codes differ" in story and "cannot name" not in story and "did not wait" not in story
    assert "Ranks 0 and 2 were stopped by torchrun: bystanders." in story
    assert "in the same second as ranks 0 and 2, so the clock alone could not order them" in story
