"""Chapter 11's frontier modes (scripts/11_moe.py: shared and fine-grained experts, the router's precision, the
balancing methods, padding against dropless), read from chapter 11's own smoke run of them. The capacity rules,
checked in-process: tests/unit/tools/test_moe.py."""
import pytest

from gpucourse import exercises

from tests.conftest import ROOT, chapter, chapter_run

CHAPTER = ROOT / "notebooks" / "11_expert_parallel.ipynb"
pytestmark = chapter(CHAPTER.stem)  # one worker: the chapter is run once


# --- the frontier modes, run for real: chapter 11's run 11-frontier (its smoke run, which CI executes anyway:
# `smoke_chapter`), read by the tests below. At the chapter's smoke sizes, on its smoke world size.
SMOKE = {"tokens": 16, "hidden": 8, "ffn": 16, "experts": 8, "top_k": 2}
FINE, SHARED, TOL = 2, 1, 1e-5
# --mode check router balance dropless, with one shared expert and every expert split two ways (16 experts of ffn 8,
# top 4), a skewed router at capacity factor 1.0, the balancing methods at the script's defaults
FRONTIER = ["--mode", "check", "router", "balance", "dropless", "--router", "skewed", "--capacity-factor", "1.0",
            "--shared", str(SHARED), "--fine", str(FINE), "--steps", "40", "--alpha", "0.01", "--lr", "50",
            "--gamma", "0.01"]


@pytest.fixture(scope="module")
def frontier_run(smoke_chapter):
    _, folder = smoke_chapter(CHAPTER)
    result = chapter_run(folder, "11-frontier")
    assert result.ok, result.summary()
    sizes = [a for k, v in SMOKE.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    assert result.manifest["args"] == ["--impl", str(exercises.solution_files()["ex11_expert_parallel"]), *sizes,
                                       *FRONTIER], "chapter 11's frontier run is no longer the one these tests read"
    return result


@pytest.fixture(scope="module")
def frontier(frontier_run):
    """{case: {rank: [records]}} of chapter 11's frontier run."""
    out: dict = {}
    for rank, recs in frontier_run.metrics.items():
        for rec in recs:
            if "case" in rec:
                out.setdefault(rec["case"], {}).setdefault(rank, []).append(rec)
    return out


def test_shared_and_fine_grained_experts_equal_one_process(frontier):
    experts, top_k = SMOKE["experts"] * FINE, SMOKE["top_k"] * FINE
    for rank, (rec,) in frontier["check"].items():
        assert set(rec["diffs"]) >= {"output", "shared grads", "experts' grads", "router.grad"}
        assert max(rec["diffs"].values()) <= TOL, (rank, rec["diffs"])
        assert len(rec["tokens_per_expert"]) == experts and sum(rec["tokens_per_expert"]) == SMOKE["tokens"] * top_k


def test_an_fp32_router_keeps_the_gating_weights_while_bf16s_error_grows_with_the_logits(frontier):
    recs = [rec for recs in frontier["router"].values() for rec in recs]
    scales = sorted({rec["scale"] for rec in recs})
    worst = {(s, d): max(r["weight_rel_err"] for r in recs if r["scale"] == s and r["router_dtype"] == d)
             for s in scales for d in ("bfloat16", "float32")}
    z = [max(r["z_loss"] for r in recs if r["scale"] == s) for s in scales]
    assert all(worst[s, "float32"] < 1e-4 for s in scales)
    assert [worst[s, "bfloat16"] for s in scales] == sorted(worst[s, "bfloat16"] for s in scales)
    assert worst[scales[-1], "bfloat16"] > 100 * worst[scales[-1], "float32"] and z == sorted(z)


def test_both_balancing_methods_spread_a_skewed_router_and_only_the_bias_method_keeps_a_bias(frontier):
    recs = {rec["method"]: rec for rec in frontier["balance"][0]}
    assert all(rec["max_over_mean"] == recs[m]["max_over_mean"] for rank in frontier["balance"].values()
               for rec in rank for m in [rec["method"]])  # the load is the whole batch's: the same on every rank
    late = {m: sum(r["max_over_mean"][-10:]) / 10 for m, r in recs.items()}
    assert late["switch"] < late["none"] and late["bias"] < late["none"], late
    assert max(recs["none"]["select_bias_range"] + recs["switch"]["select_bias_range"]) == 0
    assert recs["bias"]["select_bias_range"][-1] > 0


def test_padding_computes_capacity_rows_and_drops_while_dropless_computes_every_assignment(frontier, frontier_run):
    import math

    from gpucourse import costs

    world = frontier_run.world_size
    h, ffn, experts, top_k = SMOKE["hidden"], SMOKE["ffn"] // FINE, SMOKE["experts"] * FINE, SMOKE["top_k"] * FINE
    tokens = SMOKE["tokens"]
    per_token = costs.moe_flops_per_token(h, ffn, experts, top_k, shared=SHARED, training=False)["active"]
    recs = {layer: {rank: next(r for r in rs if r["layer"] == layer) for rank, rs in frontier["dropless"].items()}
            for layer in ("padded", "dropless")}
    for layer, by_rank in recs.items():
        assert all(max(r["diffs"].values()) <= TOL for r in by_rank.values()), layer
    dropless, padded = recs["dropless"], recs["padded"]
    assert all(r["dropped"] == 0 for r in dropless.values())
    assert sum(r["flops"] for r in dropless.values()) == world * tokens * per_token  # active parameters, exactly
    capacity = padded[0]["capacity"]
    assert capacity == math.ceil(tokens * top_k / experts)
    assert sum(r["dropped"] for r in padded.values()) > 0
    assert all(r["dropped"] == r["dropped_single"] for r in padded.values())
    rows = experts * capacity  # every rank computes world x capacity rows for each of its experts/world
    router_and_shared = 2 * tokens * (h * experts + SHARED * 2 * h * ffn)
    assert all(r["flops"] == rows * 2 * 2 * h * ffn + router_and_shared for r in padded.values())
    sent = (world - 1) * (experts // world) * capacity * h * 4  # equal splits: padding travels too
    assert all([c["bytes"] for c in r["forward_calls"]] == [sent, sent] for r in padded.values())
