"""Chapter 08d's runs, read from its smoke run (`smoke_chapter`, which CI executes anyway): a rank of a replica group
SIGKILLed mid-step, its whole group restarted while the other trains on alone, healed live from its peer (each rank
its shards), and bit-identical to it, shard by shard, from then on; DiLoCo's all-reduces counted against DDP's on the
same data."""
import json

import pytest

from gpucourse.chapters import ch08d
from gpucourse.run.contract import attempts

from tests.conftest import ROOT, chapter, chapter_run

CHAPTER = ROOT / "notebooks" / "08d_training_through_failures.ipynb"
pytestmark = [pytest.mark.timeout(900), *chapter(CHAPTER.stem)]


@pytest.fixture(scope="module")
def runs(smoke_chapter):
    result, folder = smoke_chapter(CHAPTER)
    assert result.status == "ok", f"chapter 08d failed in cell {result.failing_cell}: {result.error}"
    return folder


def replicas(folder):
    found = {r: chapter_run(folder, f"08d-replica{r}") for r in range(2)}
    assert all(res.ok for res in found.values()), {r: res.status for r, res in found.items()}
    return found


def test_the_survivor_never_restarted_and_the_killed_replica_came_back_once(runs):
    found = replicas(runs)
    killed = int(dict(zip(*[iter(found[0].manifest["args"])] * 2))["--kill-replica"])
    assert [len(attempts(res.run_dir)) for r, res in sorted(found.items())] == [2 if r == killed else 1
                                                                               for r in sorted(found)]
    assert len({res.world_size for res in found.values()}) == 1, "the groups have different numbers of ranks"
    assert all(len(ch08d.steps(res.metrics[rank])) > 0 for res in found.values() for rank in range(res.world_size))
    survivor = ch08d.steps(found[1 - killed].metrics[0])
    assert any(r["replicas"] == 1 and r["committed"] for r in survivor), "the survivor never stepped alone"
    assert sum(not r["committed"] for r in survivor) >= 1, "the step the replica died in was not dropped"
    assert ch08d.absence(found[killed].metrics[0])["steps missed"] > 0


def test_after_the_return_the_replicas_are_bit_identical(runs):
    found = replicas(runs)
    same = ch08d.compared(found)
    assert same["steps bit-identical"] == same["steps all logged"] and same["first common step after a return"]
    assert same["ranks compared"] == found[0].world_size
    assert all(r["same"] for res in found.values() for recs in res.metrics.values() for r in ch08d.steps(recs)
               if r["replicas"] > 1)


def test_diloco_sends_one_model_every_sync_every_steps(runs):
    lowcomm = {f"{m}{r}": chapter_run(runs, f"08d-{m}{r}") for m in ("ddp", "diloco") for r in range(2)}
    args = dict(zip(*[iter(lowcomm["diloco0"].manifest["args"])] * 2))
    assert ch08d.trade(lowcomm)["bytes ratio"] == int(args["--sync-every"])
    assert ch08d.communication(lowcomm)["replicas identical"].all()
    assert json.loads((lowcomm["ddp0"].run_dir / "manifest.json").read_text())["backend"] == "gloo"
