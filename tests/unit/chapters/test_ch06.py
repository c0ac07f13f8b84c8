"""What chapter 06 (tensor parallelism) shows, `gpucourse/chapters/ch06.py`, built from hand-made records."""
import pytest

from gpucourse.chapters import ch06


# --- chapter 06 ---------------------------------------------------------------------------------------
def tp_metrics():
    def rec(diffs, calls):
        return {"case": "row", "shapes": {"W": [8, 4]}, "diffs": diffs, "calls": calls}
    call = {"phase": "forward", "op": "all_reduce", "bytes": 2048}
    return {1: {0: [{"case": "impl"}, rec({"Y": 0.0, "partial": 0.0}, [])]},
            2: {0: [rec({"Y": 1e-7, "partial": 0.5}, [call])], 1: [rec({"Y": 3e-5, "partial": 0.4}, [call])]}}


def test_tp_check_takes_the_worst_rank_and_names_what_differs():
    df = ch06.tp_check(tp_metrics(), "row", tol=1e-5, skip=("partial",))
    assert list(df.columns) == ["shapes", "Y", "partial", "verdict", "collectives (rank 0)"]
    assert df.loc[2, "Y"] == 3e-5 and df.loc[2, "partial"] == 0.5  # rank 1's Y, rank 0's partial
    assert df.loc[2, "verdict"] == "DIFFERENT from dense: Y" and df.loc[1, "verdict"] == "all within 1e-05 of dense"
    assert df.loc[2, "collectives (rank 0)"] == "forward: all_reduce 2 KiB" and df.loc[1, "collectives (rank 0)"] == "none"


def test_tp_block_traffic_checks_one_all_reduce_each_way_of_the_formulas_size():
    size = 2 * 4 * 8 * 4
    ok = [{"phase": "forward", "op": "all_reduce", "bytes": size}, {"phase": "backward", "op": "all_reduce", "bytes": size}]
    records = {1: {"mlp": {"calls": []}, "attention": {"calls": []}},
               2: {"mlp": {"calls": ok}, "attention": {"calls": ok + [{"phase": "forward", "op": "all_gather", "bytes": 8}]}}}
    df = ch06.tp_block_traffic(records, batch=2, seq=4, hidden=8)
    assert list(df.columns) == ["forward all-reduces", "backward all-reduces", "bytes each (run)",
                                "b·s·h·4 (bytes, formula)", "sent per rank per all-reduce", "Megatron's count"]
    assert df.loc[(1, "mlp"), "Megatron's count"] == "matches" and df.loc[(2, "mlp"), "Megatron's count"] == "matches"
    assert df.loc[(2, "attention"), "Megatron's count"] == "DIFFERS"
    assert df.loc[(2, "mlp"), "bytes each (run)"] == str(size) and df.loc[(2, "mlp"), "b·s·h·4 (bytes, formula)"] == size
    assert df.loc[(2, "mlp"), "sent per rank per all-reduce"] == "256 B"  # 2(N-1)/N × 256 B on 2 ranks


def test_comm_counts_list_each_phases_collectives():
    df = ch06.comm_counts({"DTensor": {"diffs": {"Y": 1e-7}, "comms": {"forward": {"all_reduce": 1}, "backward": {}}},
                             "yours": {"diffs": {}, "comms": {}}})
    assert list(df.columns) == ["Y", "forward collectives", "backward collectives"]
    assert df.loc["DTensor", "forward collectives"] == "all_reduce ×1" and df.loc["DTensor", "backward collectives"] == "none"
    assert df.loc["yours", "forward collectives"] == "none"


def test_tp_cost_gives_ms_and_the_ratio_per_degree_and_link():
    df = ch06.tp_cost({(2, "NVLink 4 (H100 SXM)"): (0.004, 0.001), (2, "100 GbE"): (0.004, 0.02)})
    assert list(df.columns) == ["compute (ms)", "link (GB/s, nominal)", "4 all-reduces (ms)", "comm / compute"]
    assert df.loc[(2, "100 GbE"), "comm / compute"] == 5.0 and df.loc[(2, "NVLink 4 (H100 SXM)"), "compute (ms)"] == 4.0
    assert df.loc[(2, "100 GbE"), "link (GB/s, nominal)"] == 12  # 100 Gbit/s


def texts(ax):
    return [t.get_text() for t in ax.texts]


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_tp_split_diagram_colours_each_ranks_block():
    fig = ch06.tp_split_diagram(4)
    top, bottom = fig.axes
    assert "column-parallel linear on 4 ranks" in top.get_title() and "row-parallel" in bottom.get_title()
    for block in ("A1", "A4", "Y1", "Y4"):
        assert block in texts(top)
    # row-parallel: X in 4 column blocks, A in 4 row blocks, 4 partial products of the full shape
    assert len(bottom.patches) == 4 + 4 + 4 and len(top.patches) == 1 + 4 + 4
    with pytest.raises(ValueError, match="between 1 and 10"):
        ch06.tp_split_diagram(11)


def test_tp_cost_plot_groups_compute_and_one_bar_per_link_per_degree():
    model = {(tp, link): (1e-3 / tp, t * tp) for tp in (2, 4, 8) for link, t in (("NVLink", 1e-5), ("IB", 1e-4))}
    fig = ch06.tp_cost_plot(model, title="modelled (nominal link rates)")
    ax, = fig.axes
    assert ax.get_yscale() == "log" and "modelled" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["TP = 2", "TP = 4", "TP = 8"]
    assert legend_texts(ax) == ["compute (assumed throughput)", "communication, NVLink", "communication, IB"]
    heights = [p.get_height() for p in ax.patches]
    assert heights == pytest.approx([0.5, 0.02, 0.2, 0.25, 0.04, 0.4, 0.125, 0.08, 0.8])  # ms, by degree
    fig.canvas.draw()  # tick labels are plain numbers, never 3×10⁻¹-style
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert labels and not any("10^" in t or "times" in t or "×" in t for t in labels), labels
