"""The course's one table rule and the tables several chapters show (gpucourse/viz/tables.py), built from
hand-made records: values and headers. One chapter's tables: tests/unit/chapters/."""
import math

import pandas as pd
import pytest

from gpucourse.viz import tables


def test_frame_shows_each_bytes_column_in_one_unit_named_in_its_header():
    df = tables.frame([{"way": "ring", "sent": 3 * 2**20, "kept": 512}, {"way": "all_gather", "sent": 2**19,
                                                                         "kept": 100}],
                      index="way", bytes_columns=("sent", "kept"))
    assert list(df.columns) == ["sent (MiB)", "kept (bytes)"]
    assert df.loc["ring", "sent (MiB)"] == 3.0 and df.loc["all_gather", "sent (MiB)"] == 0.5
    assert df.loc["ring", "kept (bytes)"] == 512


def test_cell_texts_is_one_rule_for_numbers_and_empty_cells():
    assert tables.cell_texts([1314816, 12845056, 3]) == ["1,314,816", "12,845,056", "3"]
    assert tables.cell_texts([448.0, 57344.0]) == ["448", "57,344"]  # never 4.480000e+02
    assert tables.cell_texts([1.0, 1.27, 0.5]) == ["1.00", "1.27", "0.50"]  # a column aligned
    assert tables.cell_texts([0.3916, 12.5]) == ["0.3916", "12.500"]
    assert tables.cell_texts([6.103515625e-05, 3.3895313892515355e38, 0.0]) == ["6.10e-05", "3.39e+38", "0"]
    assert tables.cell_texts([None, float("nan"), pd.NA, "text", True]) == ["—", "—", "—", "text", "True"]


def test_every_table_shows_by_the_rule_and_keeps_its_numbers():
    @tables.as_table
    def trade(rows: list[dict]) -> pd.DataFrame:
        """A chapter's table: rows in, a DataFrame out."""
        return pd.DataFrame(rows).set_index(["s", "mode"])

    df = trade([{"s": 8, "mode": "none", "kept (× none)": 1.0, "median step (ms)": 10.0},
                {"s": 8, "mode": "control", "kept (× none)": None, "median step (ms)": 20.0}])
    assert trade.__name__ == "trade" and trade.__doc__.startswith("A chapter's table")
    assert isinstance(df, tables.Table) and math.isnan(df.loc[(8, "control"), "kept (× none)"])  # numbers kept
    html = df._repr_html_()
    assert "NaN" not in html and "None" not in html and "<td>—</td>" in html
    assert "kept (×\u00a0none)" in html and "median step\u00a0(ms)" not in html  # no break inside a unit
    assert "<table" in html and isinstance(df.round(1), tables.Table)
    assert isinstance(tables.frame([{"x": 1}]), tables.Table)


def test_a_bytes_column_never_reads_zero_for_a_few_bytes():
    df = tables.frame([{"op": "all_reduce", "sent": 4}, {"op": "all_gather", "sent": 12845056}], index="op",
                      bytes_columns=["sent"])
    assert list(df.columns) == ["sent (bytes)"] and df.loc["all_reduce", "sent (bytes)"] == 4
    assert "12,845,056" in df._repr_html_()
    big = tables.frame([{"x": 3 * 10**9}, {"x": 10**8}], bytes_columns=["x"], decimal=True)
    assert list(big["x (GB)"]) == [3.0, 0.1]


# --- chapters 03, 09, 10 ------------------------------------------------------------------------------
def fake_analysis(rows):
    return type("A", (), {"table": lambda self: rows, "label": lambda self: "t", "problems": []})()


def trace_row(rank, overlap, comm=4.0, exposed=1.0):
    return {"rank": rank, "steps": 3, "step_ms": 20.0, "compute_ms": 15.0, "comm_ms": comm, "exposed_comm_ms": exposed,
            "other_ms": 4.0, "overlap": overlap}


def test_trace_breakdown_has_a_row_per_rank_and_blank_overlap_without_comm():
    df = tables.trace_breakdown(fake_analysis([trace_row(0, 0.75), trace_row(1, math.nan, 0.0, 0.0)]))
    assert df.loc[0, "hidden (%)"] == 75.0 and math.isnan(df.loc[1, "hidden (%)"])
    assert list(df.columns)[:2] == ["steps", "step (ms)"]
    with pytest.raises(ValueError, match="no rank"):
        tables.trace_breakdown(fake_analysis([]))


def test_trace_breakdowns_stack_the_runs():
    df = tables.trace_breakdowns({"a": fake_analysis([trace_row(0, 0.5)]), "b": fake_analysis([trace_row(0, 0.25),
                                                                                             trace_row(1, 0.75)])})
    assert df.loc[("b", 1), "hidden (%)"] == 75.0 and len(df) == 3
    with pytest.raises(ValueError, match="no runs"):
        tables.trace_breakdowns({})


