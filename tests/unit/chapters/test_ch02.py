"""What chapter 02 (data parallelism) shows, `gpucourse/chapters/ch02.py`, built from hand-made records."""
import math

import pytest

from gpucourse.chapters import ch02


# --- chapter 02 ---------------------------------------------------------------------------------------
def test_equivalence_has_a_row_per_variant_and_a_column_per_step():
    df = ch02.equivalence({"mean": [1e-8, 2e-8], "sum": [0.5, 0.7]})
    assert list(df.columns) == ["step 1", "step 2"] and df.columns.name == "max |Δθ| after"
    assert df.loc["sum", "step 2"] == 0.7 and df.loc["mean", "step 1"] == 1e-8
    with pytest.raises(ValueError, match="variant"):
        ch02.equivalence({})


def test_sampler_shards_name_the_padding_and_the_dropped():
    shards = {("with set_epoch", 0): {0: [4, 1, 0], 1: [2, 3, 4]}, ("drop_last", 0): {0: [3, 1], 1: [0, 2]}}
    df = ch02.sampler_shards(shards, items=5)
    assert list(df.columns) == ["rank 0", "rank 1", "read twice", "read by none"]
    assert df.loc[("with set_epoch", 0), "read twice"] == [4] and df.loc[("with set_epoch", 0), "read by none"] == []
    assert df.loc[("drop_last", 0), "read by none"] == [4] and df.loc[("drop_last", 0), "rank 1"] == [0, 2]


def test_accumulation_reads_the_last_profiled_step_and_the_worst_difference():
    records = [{"mode": "big", "max_diff": 0.0}, {"mode": "every", "max_diff": 2e-7},
               {"mode": "every", "max_diff": 1e-7}, {"step": 3}]
    comm = {"big": [(2, 4096), (2, 4096)], "every": [(8, 16384), (8, 16384)]}
    df = ch02.accumulation(records, comm)
    assert list(df.columns) == ["all_reduces / step", "KiB / step", "max |Δθ| vs big",
                                "profiled steps (calls, bytes)"]
    assert df.loc["every", "all_reduces / step"] == 8 and df.loc["every", "KiB / step"] == 16.0
    assert df.loc["every", "max |Δθ| vs big"] == 2e-7 and df.loc["big", "max |Δθ| vs big"] == 0.0


def test_precision_merges_a_modes_records_and_keeps_what_did_not_run():
    rec = {"output_dtype": "torch.float32", "param_dtype": "torch.float32", "grad_dtype": "torch.float32",
           "scaler": False}
    records = [{"mode": "fp32", "max_diff": 0.0, **rec}, {"mode": "fp16_hook", "max_diff": 1e-4, **rec},
               {"mode": "fp16_hook", "max_diff": 3e-4, **rec}, {"mode": "fp16", "error": "RuntimeError: no"}]
    df = ch02.precision(records, {"fp32": (2, 2048), "fp16_hook": (2, 1024)})
    assert list(df.index) == ["fp32", "fp16_hook", "fp16"]
    assert df.loc["fp16_hook", "KiB / step"] == 1.0 and df.loc["fp32", "KiB / step"] == 2.0
    assert df.loc["fp16_hook", "max |Δθ| vs fp32"] == 3e-4 and df.loc["fp16", "not run"] == "RuntimeError: no"
    assert not df.loc["fp32", "GradScaler"] and df.loc["fp32", "params"] == "torch.float32"
    assert str(df["all_reduces / step"].dtype) == "Int64" and df.loc["fp32", "all_reduces / step"] == 2


def test_ddp_compare_skips_the_first_step_in_the_median():
    rows = [{"loss": {"torch DDP": 2.0, "yours": 2.0}, "seconds": {"torch DDP": 9.0, "yours": 9.0},
             "max_diff": {"yours": 1e-7}}]
    rows += [{"loss": {"torch DDP": 1.0 - s / 10, "yours": 1.0 - s / 10}, "seconds": {"torch DDP": s / 1e3,
             "yours": 2 * s / 1e3}, "max_diff": {"yours": 3e-7}} for s in (1, 2, 3)]
    df = ch02.ddp_compare(rows)
    assert list(df.columns) == ["final loss", "median step (ms)", "max |Δθ| vs torch DDP"]
    assert math.isclose(df.loc["torch DDP", "median step (ms)"], 2.0)
    assert math.isclose(df.loc["yours", "median step (ms)"], 4.0)
    assert df.loc["yours", "max |Δθ| vs torch DDP"] == 3e-7 and df.loc["torch DDP", "max |Δθ| vs torch DDP"] == 0
    assert math.isclose(df.loc["yours", "final loss"], 0.7)
    with pytest.raises(ValueError, match="two steps"):
        ch02.ddp_compare(rows[:1])


LABEL = "cpu · gloo · 4 ranks"


def texts(ax):
    return [t.get_text() for t in ax.texts]


def named_lines(ax):
    return [line for line in ax.lines if not line.get_label().startswith("_")]


def legend_texts(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_equivalence_plot_one_log_line_per_variant_zeros_kept_on_the_axis():
    diffs = {"mean": [0.0, 3e-8, 6e-8], "sum": [1e-3, 2e-3, 4e-3]}
    fig = ch02.equivalence_plot(diffs, label=LABEL)
    ax, = fig.axes
    assert ax.get_yscale() == "log" and LABEL in ax.get_title()
    lines = named_lines(ax)
    assert [line.get_label() for line in lines] == ["mean", "sum"] == legend_texts(ax)
    assert list(lines[0].get_xdata()) == [1, 2, 3]  # steps counted from 1
    assert list(lines[0].get_ydata()) == [1e-10, 3e-8, 6e-8]  # a zero difference drawn at the floor
    assert ax.get_ylabel() == "max |θ_DDP − θ_single|" and "float32 rounding" in texts(ax)
    with pytest.raises(ValueError, match="variant"):
        ch02.equivalence_plot({})
