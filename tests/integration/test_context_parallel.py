"""Chapter 10's script (scripts/10_context_parallel.py): the frontier parts (grouped-query all-gather, Ulysses ×
ring, a model trained under CP, a ring step timed) of chapter 10's own 2-rank run (its smoke run, which CI executes
anyway: `smoke_chapter`), and the USP layout in this process."""
import pytest
import torch

from gpucourse import costs, exercises
from gpucourse.tools.course import smoke_parameters

from tests.conftest import ROOT, chapter, chapter_run

CHAPTER = ROOT / "notebooks" / "10_context_parallel.ipynb"
pytestmark = chapter(CHAPTER.stem)  # one worker: the chapter is run once

SCRIPT = ROOT / "scripts" / "10_context_parallel.py"
# The chapter's run at its smoke sizes; HEADS and KV_HEADS are its parameters cell's (KV_HEADS < HEADS: GQA)
HEADS, KV_HEADS, SEQ, HEAD_DIM = 4, 2, smoke_parameters(CHAPTER)["SEQ"], smoke_parameters(CHAPTER)["HEAD_DIM"]


@pytest.fixture(scope="module")
def run(smoke_chapter):
    _, folder = smoke_chapter(CHAPTER)
    result = chapter_run(folder, "10-context-parallel-2")
    assert result.ok, result.summary()
    args = result.manifest["args"]
    given = {flag: int(args[args.index(flag) + 1]) for flag in ("--heads", "--kv-heads", "--seq", "--head-dim")}
    assert given == {"--heads": HEADS, "--kv-heads": KV_HEADS, "--seq": SEQ, "--head-dim": HEAD_DIM}, given
    return result


def records(run, case, rank=0):
    return [r for r in run.metrics[rank] if r.get("case") == case]


@pytest.fixture(scope="module")
def script():
    return exercises.load_file(SCRIPT, "cp_10")


def test_weight_gradients_summed_over_cp_equal_one_process_and_unsummed_replicas_drift(run):
    for rank in (0, 1):
        synced, unsynced = (next(r for r in records(run, "cp_training", rank) if r["sync"] is s) for s in (True, False))
        assert synced["rank_spread"] == [0.0] * synced["steps"] and synced["vs_reference"] <= 1e-10
        assert synced["losses"] == pytest.approx(synced["ref_losses"], abs=1e-10)
        assert unsynced["losses"][0] == pytest.approx(unsynced["ref_losses"][0], abs=1e-12)  # before any update
        assert all(b > a > 1e-6 for a, b in zip(unsynced["rank_spread"], unsynced["rank_spread"][1:]))  # drifting
        assert unsynced["vs_reference"] > 1e-3


def test_zigzag_labels_give_the_whole_sequences_loss_and_labels_shifted_after_sharding_do_not(run):
    for rank in (0, 1):
        (rec,) = records(run, "labels", rank)
        assert rec["label_positions"] == [p + 1 for p in rec["positions"]]
        assert rec["loss"] == pytest.approx(rec["ref_loss"], abs=1e-12)
        assert rec["wrong_labels_here"] > 0 and abs(rec["loss_labels_shifted_after_sharding"] - rec["loss"]) > 1e-9
    assert sorted(records(run, "labels", 0)[0]["positions"] + records(run, "labels", 1)[0]["positions"]) == \
        list(range(SEQ))


def test_grouped_query_all_gather_sends_kv_heads_over_heads_of_the_bytes(run):
    (rec,) = records(run, "all_gather_gqa")
    shard = costs.attention_shard_bytes(1, SEQ, HEADS, HEAD_DIM, 2, 4)
    kv = costs.attention_shard_bytes(1, SEQ, KV_HEADS, HEAD_DIM, 2, 4)
    assert (rec["shard_bytes"], rec["kv_shard_bytes"]) == (shard, kv)
    for phase, backward in (("forward_bytes", False), ("backward_bytes", True)):
        assert rec[phase] == costs.context_parallel_bytes("all_gather", shard, 2, backward=backward, kv_shard_bytes=kv)
        assert rec[phase] * HEADS == KV_HEADS * costs.context_parallel_bytes("all_gather", shard, 2, backward=backward)
    assert max(rec["errors"].values()) <= 1e-4


def test_ulysses_times_ring_bytes_are_the_hybrid_formula(run):
    found = {(r["case"], r["causal"]): r for r in run.metrics[0] if r["case"].startswith("usp_")}
    assert set(found) == {(f"usp_{u}x{2 // u}", c) for u in (1, 2) for c in (False, True)}
    for (case, _), rec in found.items():
        u, r = map(int, case[4:].split("x"))
        for phase, backward in (("forward_bytes", False), ("backward_bytes", True)):
            assert rec[phase] == costs.hybrid_context_parallel_bytes(rec["shard_bytes"], u, r, backward=backward)
        assert max(rec["errors"].values()) <= 1e-4


def test_ring_step_record_counts_what_the_cost_model_counts(run):
    (rec,) = records(run, "ring_step")
    flops_per_s, bandwidth = rec["flops"] / rec["compute_s"], rec["kv_bytes"] / rec["transfer_s"]
    modelled = costs.ring_step_times(rec["block_tokens"], rec["heads"], rec["head_dim"], flops_per_s, bandwidth,
                                     kv_heads=rec["kv_heads"], bytes_per_value=rec["bytes_per_value"])
    assert modelled == pytest.approx((rec["compute_s"], rec["transfer_s"]))
    assert rec["block_tokens"] == SEQ // 2


@pytest.mark.parametrize("ring, ulysses", [(1, 2), (2, 2), (2, 1), (3, 2), (1, 4)])
def test_usp_layout_gives_each_ring_member_its_two_zigzag_chunks_after_the_all_to_all(script, ring, ulysses):
    n, seq = ring * ulysses, 4 * ring * ulysses
    layout = script.usp_layout(n, ulysses, seq)
    assert sorted(torch.cat(list(layout.values())).tolist()) == list(range(seq))
    chunks = torch.arange(seq).chunk(2 * ring)
    for j in range(ring):  # the all-to-all concatenates the group's shards in group order
        assembled = torch.cat([layout[j * ulysses + i] for i in range(ulysses)])
        ordered = assembled[script.usp_ring_order(ulysses, seq // n)]
        assert torch.equal(ordered, torch.cat([chunks[j], chunks[2 * ring - 1 - j]]))
