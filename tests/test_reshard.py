"""Checkpoints that reshard (scripts/08_reshard.py): one run under FSDP at world 4 saves with DCP after step SAVE_AT
and trains on, uninterrupted, to the end; five jobs then resume from its checkpoint side by side (launch_all): under
FSDP 2 x TP 2, HSDP 2 x 2 and plain FSDP at world 2, each for the full AFTER = 20 steps the chapter uses, and the two
mistakes: the loader's state dropped, and a plain torch.save of each rank's shards loaded at world 2."""
import pytest

from gpucourse.run.contract import RUNS_ENV
from gpucourse.run.launcher import launch_all
from gpucourse.viz import tables

from .conftest import ROOT, run_processes

SCRIPT = ROOT / "scripts" / "08_reshard.py"
SAVE_AT, AFTER = 3, 20
STEPS = SAVE_AT + 1 + AFTER
RESUMES = {  # name: (ranks, layout, extra arguments)
    "fsdp-tp": (4, "fsdp-tp", []),
    "hsdp": (4, "hsdp", []),
    "fsdp-2": (2, "fsdp", []),
    "drop-loader-state": (2, "fsdp", ["--drop-loader-state"]),
    "torch-save": (2, "fsdp", ["--torch-save"]),
}
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("reshard")]  # one worker: launched once


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"reference": the uninterrupted world-4 run that saved, **{name: its resumed run}}."""
    ckpt = tmp_path_factory.mktemp("reshard") / "checkpoint"
    common = {"script": SCRIPT, "check": False, "timeout": 300, "env": {"OMP_NUM_THREADS": "1"}}
    base = ["--steps", str(STEPS), "--batch", "8", "--samples", "256"]  # one epoch: every id at most once
    with pytest.MonkeyPatch.context() as env:
        env.setenv(RUNS_ENV, str(tmp_path_factory.mktemp("reshard-runs")))
        [reference] = launch_all([{**common, "nproc": 4, "name": "reshard-reference", "args": base + [
            "--layout", "fsdp", "--save-at", str(SAVE_AT), "--ckpt-dir", str(ckpt), "--torch-save"]}])
        assert reference.ok, reference.summary()
        resumed = launch_all([{**common, "nproc": n, "name": f"reshard-{name}",
                               "args": base + ["--layout", layout, "--resume-from", str(ckpt), *extra]}
                              for name, (n, layout, extra) in RESUMES.items()])
    out = {"reference": reference, **dict(zip(RESUMES, resumed))}
    for res in out.values():
        assert run_processes(res.run_dir) == [], f"{res.name} left processes behind"
    return out


@pytest.mark.parametrize("name", ["fsdp-tp", "hsdp", "fsdp-2"])
def test_resumed_on_another_layout_equals_the_uninterrupted_run(runs, name):
    res, ref = runs[name], runs["reference"]
    assert res.ok, res.summary()
    ranks, layout, _ = RESUMES[name]
    assert f"resumed step {SAVE_AT} under {layout} at world {ranks}" in res.log(0)
    for rank in range(ranks):  # every rank logs the global batch's loss and ids: all must agree
        assert [m["step"] for m in res.metrics[rank] if "loss" in m] == list(range(SAVE_AT + 1, STEPS))
    row = tables.reshard(ref.metrics[0], {name: res.metrics[0]}, SAVE_AT).loc[name]
    assert row["world"] == ranks and row["layout"] == layout and row["steps after the save"] == AFTER
    assert row["max |loss − uninterrupted|"] <= 1e-10
    assert row["steps with the same sample ids"] == AFTER
    assert (row["samples repeated"], row["samples skipped"]) == (0, 0)


def test_the_uninterrupted_run_sees_each_sample_once_in_a_shuffled_order(runs):
    ids = [i for m in runs["reference"].metrics[0] if "ids" in m for i in m["ids"]]
    assert len(ids) == STEPS * 8 == len(set(ids)) and ids != sorted(ids)


def test_resuming_without_the_loader_state_repeats_samples(runs):
    res, ref = runs["drop-loader-state"], runs["reference"]
    assert res.ok, res.summary()
    row = tables.reshard(ref.metrics[0], {"dropped": res.metrics[0]}, SAVE_AT).loc["dropped"]
    # The loader starts again at sample 0: the first SAVE_AT + 1 batches are trained on twice, and as many samples
    # at the end are never reached.
    assert row["samples repeated"] == (SAVE_AT + 1) * 8 == row["samples skipped"]
    assert row["steps with the same sample ids"] < AFTER
    assert row["max |loss − uninterrupted|"] > 1e-6


def test_torch_save_of_sharded_state_fails_at_another_world_size(runs):
    res = runs["torch-save"]
    assert not res.ok and res.status == "failed"
    # Each rank's file holds DTensors laid out on the 4-rank mesh; copying them into the 2-rank model's fails.
    assert res.error.exception.startswith("RuntimeError") and "different meshes" in res.error.exception, res.error
