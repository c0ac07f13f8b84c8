"""What chapter 11 (expert parallelism) shows, `gpucourse/chapters/ch11.py`, built from hand-made records."""
import matplotlib
import pytest

from gpucourse.chapters import ch11


# --- chapter 11: expert parallelism -------------------------------------------------------------------
def test_moe_per_rank_shows_the_named_values_and_each_difference_from_one_process():
    recs = {1: {"dropped": 3, "ep_ranks": [0, 1], "diffs": {"output": 2e-7, "router.grad": 1e-8}},
            0: {"dropped": 0, "ep_ranks": [0, 1], "diffs": {"output": 1e-7, "router.grad": 0.5}}}
    df = ch11.moe_per_rank(recs, {"dropped": "dropped", "ep group": "ep_ranks"})
    assert list(df.index) == [0, 1] and list(df.columns) == ["dropped", "ep group", "|Δ| output", "|Δ| router.grad"]
    assert df.loc[0, "|Δ| router.grad"] == 0.5 and df.loc[1, "dropped"] == 3 and df.loc[1, "ep group"] == [0, 1]
    assert list(ch11.moe_per_rank(recs, {"dropped": "dropped"}, diffs=False).columns) == ["dropped"]
    with pytest.raises(ValueError, match="rank: record"):
        ch11.moe_per_rank({})


LABEL = "cpu · gloo · 4 ranks"


# --- chapter 11 ---------------------------------------------------------------------------------------
def test_moe_tokens_per_expert_colours_the_experts_over_capacity_and_names_every_colour():
    panels = {"learned": ([10, 30, 12, 12], 1.1), "skewed": ([40, 20, 4, 0], 2.3)}
    fig = ch11.moe_tokens_per_expert(panels, capacity_total=20, uniform=16, label=LABEL, title="Tokens per expert")
    assert len(fig.axes) == 2 and LABEL in fig._suptitle.get_text()
    for ax, (counts, aux) in zip(fig.axes, panels.values()):
        bars = [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]
        red = [matplotlib.colors.same_color(b.get_facecolor(), "tab:red") for b in bars]
        assert red == [c > 20 for c in counts] and f"{aux:.2f}" in ax.get_title()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(legend) == 4 and any("capacity" in t and "20" in t for t in legend)
    colours = {h.get_facecolor()[:3] for h in fig.legends[0].legend_handles if hasattr(h, "get_facecolor")}
    assert {matplotlib.colors.to_rgb("tab:red"), matplotlib.colors.to_rgb("tab:blue")} <= colours


def test_moe_load_balance_draws_one_line_per_method_and_the_even_load():
    fig = ch11.moe_load_balance({"none": [4.0, 4.0, 3.9], "bias": [4.0, 2.5, 1.5]}, label=LABEL)
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.lines] == ["none", "bias", "even load (1.0)"]
    assert list(ax.lines[1].get_xdata()) == [1, 2, 3] and LABEL in ax.get_title()
    with pytest.raises(ValueError, match="non-empty"):
        ch11.moe_load_balance({"none": []})
