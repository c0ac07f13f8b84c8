"""What chapter 10 (context parallelism) shows, `gpucourse/chapters/ch10.py`, built from hand-made records."""
import pytest

from gpucourse.chapters import ch10


LABEL = "cpu · gloo · 4 ranks"


def test_saved_memory_plot_ticks_at_the_measured_lengths_only():
    seqs = [64, 128, 256]
    fig = ch10.saved_memory_plot(seqs, {"plain": [4e3, 16e3, 64e3], "fused": [1e3, 2e3, 4e3]}, LABEL)
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == seqs and [t.get_text() for t in ax.get_xticklabels()] == ["64", "128", "256"]
    assert ax.get_xscale() == ax.get_yscale() == "log" and LABEL in ax.get_title()
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert {"1 KiB", "4 KiB", "16 KiB"} <= set(labels) and not ax.get_yticklabels(minor=True)  # powers of two
    with pytest.raises(ValueError, match="one byte count for each"):
        ch10.saved_memory_plot(seqs, {"plain": [1, 2]})


def test_causal_balance_plot_has_two_panels_with_different_titles():
    balance = {"contiguous": [{"pairs": 3, "seconds": 0.1}, {"pairs": 7, "seconds": 0.3}],
               "zigzag": [{"pairs": 5, "seconds": 0.2}, {"pairs": 5, "seconds": 0.2}]}
    fig = ch10.causal_balance_plot(balance, LABEL)
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 2 and titles[0] != titles[1] and "exact" in titles[0] and "measured" in titles[1]
    assert [p.get_height() for p in fig.axes[0].patches] == [3, 7, 5, 5]
    assert [p.get_height() for p in fig.axes[1].patches] == pytest.approx([1e5, 3e5, 2e5, 2e5])  # µs
    assert fig.axes[1].get_ylabel() == "µs"
    assert LABEL in fig._suptitle.get_text()
    with pytest.raises(ValueError, match="per rank"):
        ch10.causal_balance_plot({})


def test_replica_drift_plot_draws_one_line_per_run():
    recs = [{"sync": True, "rank_spread": [0.0, 0.0]}, {"sync": False, "rank_spread": [0.1, 0.2]}]
    ax = ch10.replica_drift_plot(recs, LABEL).axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0.0, 0.0], [0.1, 0.2]]
    assert "all-reduced" in ax.get_legend().get_texts()[0].get_text() and LABEL in ax.get_title()
    with pytest.raises(ValueError, match="cp_training"):
        ch10.replica_drift_plot([])
