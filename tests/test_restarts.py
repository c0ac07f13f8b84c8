"""Kill-and-resume through gpucourse.launch: a rank dies by SIGKILL, torchrun restarts the job once, the job
resumes from its last torch.distributed.checkpoint and ends with the parameters of an uninterrupted run.

Restarts under gloo used to fail often when workers shared the agent's rendezvous store (pytorch#135712;
the launcher sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): hence several repetitions, with different ranks
dying at different steps (before the first checkpoint, right after one, between two).
"""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gpucourse import launch

from .conftest import ROOT, run_processes

SCRIPT = ROOT / "scripts" / "08_resume.py"
STEPS, CKPT_EVERY = 8, 2
# (rank that dies, step at which it dies): before any checkpoint, just after one, between two, near the end
KILLS = [(1, 1), (0, 2), (1, 3), (0, 5), (1, 7)]
PARALLEL = 2  # jobs side by side: start-up (importing torch) dominates, and overlaps
TIMEOUT_S = 240  # per job; ~25 s on a quiet 2-core machine, several times that when it is shared
pytestmark = pytest.mark.timeout(900)


def run(kill) -> object:
    args = ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY)]
    if kill:
        args += ["--kill-rank", str(kill[0]), "--kill-at", str(kill[1])]
    return launch(SCRIPT, nproc=2, args=args, max_restarts=1 if kill else 0, timeout=TIMEOUT_S, check=False,
                  live=False, name="test-restart-" + ("none" if not kill else f"{kill[0]}-{kill[1]}"),
                  env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request) -> dict:
    """{None: the uninterrupted run, (rank, step): a run in which `rank` died at `step`}, all side by side."""
    mp = pytest.MonkeyPatch()
    mp.setenv("GPUCOURSE_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))
    request.addfinalizer(mp.undo)
    jobs = [None, *KILLS]
    with ThreadPoolExecutor(PARALLEL) as pool:
        return dict(zip(jobs, pool.map(run, jobs)))


def final_params(res) -> dict:
    path = Path(res.run_dir) / "final_params.pt"
    assert path.exists(), f"{res.name}: rank 0 wrote no final_params.pt ({res.status}: {res.error})"
    return torch.load(path)


def test_uninterrupted_run_never_restarts(runs):
    ref = runs[None]
    assert ref.ok, ref.summary()
    assert [p.name for p in (ref.run_dir / "logs").iterdir()] == ["attempt0"]
    assert [r["step"] for r in ref.metrics[0]] == list(range(STEPS))


@pytest.mark.parametrize("kill", KILLS, ids=lambda k: f"rank{k[0]}-dies-at-step{k[1]}")
def test_killed_rank_restarts_once_and_resumes_exactly(runs, kill):
    res, (rank, step) = runs[kill], kill
    assert res.ok, res.summary()
    attempts = sorted(p.name for p in (res.run_dir / "logs").iterdir())
    assert attempts == ["attempt0", "attempt1"], f"expected exactly one restart, got log folders {attempts}"
    assert f"SIGKILL at step {step}" in res.log(rank, attempt=0)
    # The second attempt starts after the last checkpoint before the kill: steps are redone, none skipped.
    resumed_at = (step // CKPT_EVERY) * CKPT_EVERY
    for r in range(2):
        steps = {a: [m["step"] for m in res.metrics[r] if m["attempt"] == a] for a in (0, 1)}
        assert steps[1] == list(range(resumed_at, STEPS)), f"rank {r}, attempt 1 ran steps {steps[1]}"
        assert steps[0] == list(range(step)), f"rank {r}, attempt 0 ran steps {steps[0]} (killed at {step})"
    ref, got = final_params(runs[None]), final_params(res)
    assert ref.keys() == got.keys()
    diff = max((ref[k] - got[k]).abs().max().item() for k in ref)
    assert diff == 0.0, f"resumed parameters differ from the uninterrupted run's by {diff:.3g}"
    # Resumed losses are the uninterrupted run's, step for step.
    ref_loss = {m["step"]: m["loss"] for m in runs[None].metrics[0]}
    assert all(m["loss"] == ref_loss[m["step"]] for m in res.metrics[0]), "a resumed step's loss differs"


def test_no_process_left_behind(runs):
    for res in runs.values():
        assert run_processes(res.run_dir) == [], f"{res.name} left processes behind"
