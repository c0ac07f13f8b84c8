"""Asynchronous checkpoints and the slow rank (scripts/08c_saves_and_stragglers.py), read from chapter 08c's own run
(its smoke run, which CI executes anyway: `smoke_chapter`). Structural only: which rank is named, what was saved
and resumed; no timing is asserted (the injected delay is many healthy steps, so noise cannot swap the ranks)."""
import pytest

from gpucourse.chapters import ch08c
from gpucourse.run import forensics
from gpucourse.tools.course import smoke_parameters

from tests.conftest import ROOT, chapter, chapter_run

CHAPTER = ROOT / "notebooks" / "08c_async_checkpoints_and_slow_ranks.ipynb"
SMOKE = smoke_parameters(CHAPTER)
pytestmark = [pytest.mark.timeout(1200), *chapter(CHAPTER.stem)]


@pytest.fixture(scope="module")
def run(smoke_chapter):
    _, folder = smoke_chapter(CHAPTER)
    res = chapter_run(folder, "08c-saves-and-stragglers")
    assert res.ok, res.summary()
    return res


def test_every_rank_saved_both_ways_and_resumed_bit_for_bit(run):
    saves = SMOKE["STEPS"] // SMOKE["SAVE_EVERY"]
    for rank, records in run.metrics.items():
        kinds = [r["save"] for r in records if "save" in r]
        assert kinds.count("blocking") == kinds.count("async") == kinds.count("async-done") == saves, (rank, kinds)
    resumed = ch08c.resumed(run.metrics)
    assert list(resumed.index) == list(range(run.world_size))
    assert resumed["bitwise_equal"].all() and (resumed["replayed"] > 0).all() and (resumed["max_abs_diff"] == 0).all()
    assert not (run.run_dir / "checkpoints").exists()  # removed at the end: they are large at default sizes


def test_the_slow_rank_named_from_the_dumps_is_the_one_slowed(run):
    dumps = forensics.read_dumps(run.run_dir, run.world_size)
    assert all(dumps.values()), "every rank dumps its Flight Recorder after the slow phase"
    slow_rank = 1  # the chapter's SLOW_RANK (the smoke run keeps its default)
    assert "SLOW_RANK" not in SMOKE
    found = ch08c.slow_rank(run)
    assert found["rank"] == slow_rank, found
    assert found["wait_s"][slow_rank] == min(found["wait_s"].values())  # it is the one nobody else waits for
