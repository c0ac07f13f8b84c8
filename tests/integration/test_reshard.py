"""Checkpoints that reshard (scripts/08_reshard.py), read from chapter 08's own runs (its smoke run, which CI
executes anyway: `smoke_chapter`): one run under FSDP at world 4 saves with DCP after step SAVE_AT and trains on,
uninterrupted, to the end; five jobs then resume from its checkpoint side by side: under FSDP 2 x TP 2, HSDP 2 x 2
and plain FSDP at world 2, each for AFTER = 20 steps as at the chapter's default sizes, and the two mistakes: the
loader's state dropped, and a plain torch.save of each rank's shards loaded at world 2."""
import pytest

from gpucourse.chapters import ch08
from gpucourse.tools.course import smoke_parameters

from tests.conftest import ROOT, chapter, chapter_run

CHAPTER = ROOT / "notebooks" / "08_multinode_faults_hangs.ipynb"
SMOKE = smoke_parameters(CHAPTER)
SAVE_AT, AFTER, BATCH = SMOKE["RESHARD_SAVE_AT"], SMOKE["RESHARD_AFTER"], SMOKE["RESHARD_BATCH"]
STEPS = SAVE_AT + 1 + AFTER
RESUMES = {  # name: (ranks, layout, the chapter's run), in the order of the chapter's LAYOUTS, then WORLD_2
    "fsdp-tp": (4, "fsdp-tp", "08-reshard-0"),
    "hsdp": (4, "hsdp", "08-reshard-1"),
    "fsdp-2": (2, "fsdp", "08-reshard-2"),
    "drop-loader-state": (2, "fsdp", "08-reshard-3"),
    "torch-save": (2, "fsdp", "08-reshard-4"),
}
pytestmark = [pytest.mark.timeout(1200), *chapter(CHAPTER.stem)]


@pytest.fixture(scope="module")
def runs(smoke_chapter):
    """{"reference": the uninterrupted world-4 run that saved, **{name: its resumed run}}."""
    _, folder = smoke_chapter(CHAPTER)
    return {name: chapter_run(folder, run)
            for name, run in {"reference": "08-reshard-fsdp-4", **{k: v[2] for k, v in RESUMES.items()}}.items()}


@pytest.mark.parametrize("name", ["fsdp-tp", "hsdp", "fsdp-2"])
def test_resumed_on_another_layout_equals_the_uninterrupted_run(runs, name):
    res, ref = runs[name], runs["reference"]
    assert res.ok, res.summary()
    ranks, layout, _ = RESUMES[name]
    assert f"resumed step {SAVE_AT} under {layout} at world {ranks}" in res.log(0)
    for rank in range(ranks):  # every rank logs the global batch's loss and ids: all must agree
        assert [m["step"] for m in res.metrics[rank] if "loss" in m] == list(range(SAVE_AT + 1, STEPS))
    row = ch08.reshard(ref.metrics[0], {name: res.metrics[0]}, SAVE_AT).loc[name]
    assert row["world"] == ranks and row["layout"] == layout and row["steps after the save"] == AFTER
    assert row["max |loss − uninterrupted|"] <= 1e-10
    assert row["steps with the same sample ids"] == AFTER
    assert (row["samples repeated"], row["samples skipped"]) == (0, 0)


def test_the_uninterrupted_run_sees_each_sample_once_in_a_shuffled_order(runs):
    ids = [i for m in runs["reference"].metrics[0] if "ids" in m for i in m["ids"]]
    assert len(ids) == STEPS * BATCH == len(set(ids)) and ids != sorted(ids)


def test_resuming_without_the_loader_state_repeats_samples(runs):
    res, ref = runs["drop-loader-state"], runs["reference"]
    assert res.ok, res.summary()
    row = ch08.reshard(ref.metrics[0], {"dropped": res.metrics[0]}, SAVE_AT).loc["dropped"]
    # The loader starts again at sample 0: the first SAVE_AT + 1 batches are trained on twice, and as many samples
    # at the end are never reached.
    assert row["samples repeated"] == (SAVE_AT + 1) * BATCH == row["samples skipped"]
    assert row["steps with the same sample ids"] < AFTER
    assert row["max |loss − uninterrupted|"] > 1e-6


def test_torch_save_of_sharded_state_fails_at_another_world_size(runs):
    res = runs["torch-save"]
    assert not res.ok and res.status == "failed"
    # Each rank's file holds DTensors laid out on the 4-rank mesh; copying them into the 2-rank model's fails.
    assert res.error.exception.startswith("RuntimeError") and "different meshes" in res.error.exception, res.error
