"""Chapter 11's capacity rules (scripts/11_moe.py, kept_mask, on ex11's reference kept_assignments): which
assignments an expert over capacity keeps. The frontier modes, read from chapter 11's own run of them:
tests/integration/test_moe_frontier.py."""
import importlib.util

import pytest
import torch

from gpucourse import exercises

from tests.conftest import ROOT, chapter

CHAPTER = ROOT / "notebooks" / "11_expert_parallel.ipynb"
pytestmark = chapter(CHAPTER.stem)  # with chapter 11's other tests, on the worker that runs the chapter

EXPERTS, TOKENS, TOP_K = 8, 64, 2


def load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def moe():
    return load("moe_11", ROOT / "scripts" / "11_moe.py")


@pytest.fixture(scope="module")
def layers(moe):
    """{number of experts: a small MoE layer whose capacity rule is ex11's reference kept_assignments}."""
    ex11 = load("ex11_reference", exercises.solution_files()["ex11_expert_parallel"])
    return {e: moe.MoE(4, 4, e, TOP_K, ex11) for e in (2, EXPERTS)}


def routing(seed: int, skew: float) -> torch.Tensor:
    """(TOKENS, TOP_K) distinct expert ids per token, skewed towards the first experts so that capacity binds."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(TOKENS, EXPERTS, generator=g) + torch.linspace(skew, 0.0, EXPERTS)
    return scores.topk(TOP_K, dim=-1).indices


CASES = [(seed, skew, capacity) for seed in range(6) for skew in (0.0, 2.0) for capacity in (4, 16, 20)]


@pytest.mark.parametrize("seed, skew, capacity", CASES)
def test_choice_priority_never_drops_a_first_choice_while_a_later_choice_is_kept(moe, layers, seed, skew, capacity):
    ids = routing(seed, skew)
    kept = moe.kept_mask(layers[EXPERTS], ids, capacity, "choice")
    for e in range(EXPERTS):
        first_dropped = ((ids[:, 0] == e) & ~kept[:, 0]).any()
        later_kept = ((ids[:, 1:] == e) & kept[:, 1:]).any()
        assert not (first_dropped and later_kept), f"expert {e}: a first choice dropped, another token's later one kept"


@pytest.mark.parametrize("seed, skew, capacity", CASES)
def test_both_rules_keep_the_same_number_per_expert(moe, layers, seed, skew, capacity):
    """The rule changes which assignments are dropped, never how many: min(capacity, demand) per expert."""
    ids = routing(seed, skew)
    demand = torch.bincount(ids.reshape(-1), minlength=EXPERTS)
    for priority in ("token", "choice"):
        kept = moe.kept_mask(layers[EXPERTS], ids, capacity, priority)
        got = torch.bincount(ids[kept], minlength=EXPERTS)
        assert torch.equal(got, demand.clamp(max=capacity)), priority


def test_token_order_lets_a_second_choice_displace_another_tokens_first(moe, layers):
    """Two experts of capacity 1: token 0 picks (0, 1), token 1 picks (1, 0)."""
    ids = torch.tensor([[0, 1], [1, 0]])
    token = moe.kept_mask(layers[2], ids, 1, "token")
    choice = moe.kept_mask(layers[2], ids, 1, "choice")
    assert token.tolist() == [[True, True], [False, False]]  # token 0's second choice took expert 1's place
    assert choice.tolist() == [[True, False], [True, False]]  # every first choice kept, both second choices dropped


def test_rules_agree_with_top_1_and_without_capacity(moe, layers):
    ids = routing(0, 2.0)
    layer = layers[EXPERTS]
    assert torch.equal(moe.kept_mask(layer, ids[:, :1], 4, "token"), moe.kept_mask(layer, ids[:, :1], 4, "choice"))
    assert moe.kept_mask(layer, ids, None, "choice").all()
    with pytest.raises(ValueError, match="priority"):
        moe.kept_mask(layer, ids, 4, "random")
