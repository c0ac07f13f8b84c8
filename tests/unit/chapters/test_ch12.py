"""What chapter 12 (at scale, on your laptop) shows, `gpucourse/chapters/ch12.py`: a plan's tables and figure, all
labelled modelled, and a dry run's counts per rank and group."""
import pytest

from gpucourse.chapters import ch12
from gpucourse.models import planner
from gpucourse.viz import plots, tables

GiB = 2 ** 30


def test_plan_tables_and_figure_label_everything_modelled():
    plan = planner.plan_parallelism("llama3-405b", gpus=16384, dp=128, tp=8, pp=16, seq=8192, global_batch=2048)
    df = ch12.plan_memory(plan)
    assert list(df.index) == ["first", "last"] and df.index.name == "stage (modelled)"
    assert df.loc["first", "total (GiB)"] == round(plan["stages"][0]["total"] / GiB, 1)
    terms = ch12.step_terms(plan)
    assert terms["seconds a step"].sum() == pytest.approx(plan["step_s"], abs=0.01)
    fig = plots.plan_plot(plan)
    texts = [ax.get_ylabel() + ax.get_xlabel() + ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text()]
    assert all("modelled" in t or "estimate" in t or t.startswith(("fits", "does NOT")) for t in texts)
    assert "modelled, not run" in fig._suptitle.get_text()


def test_dry_run_tables_show_counts_per_rank_and_group():
    rank = {"rank": 1023, "peak_bytes": 3 * 2**20, "flops": 10,
            "memory": {"params": 2**20, "grads": 0, "optimizer": 0, "activations": 2 * 2**20, "other": 0},
            "comms": [{"op": "all_reduce", "group_size": 4, "group": [1020, 1021, 1022, 1023], "calls": 6,
                       "bytes": 6 * 2**20},
                      {"op": "all_gather_single", "group_size": 256, "group": list(range(3, 1024, 4)), "calls": 3,
                       "bytes": 3 * 2**20}],
            "predicted": {"step_s": 0.01, "mfu": 0.001}}
    mem = tables.dryrun_memory({"ranks": [rank]})
    assert mem.loc[1023, "peak (MB)"] == round(3 * 2**20 / 1e6, 2) and mem.loc[1023, "step, modelled (ms)"] == 10
    assert mem.loc[1023, "grads (bytes)"] == 0 and "peak / 80 GB (%)" in mem  # decimal units, as the device's GB
    comms = tables.dryrun_comms({"ranks": [rank]})
    assert list(comms["group"]) == ["[1020, 1021, 1022, 1023]", "[3, 7, …, 1023]"]
    assert list(comms["bytes (MiB)"]) == [6, 3]
    real = {"rank": 1023, "comms": [dict(rank["comms"][0]), dict(rank["comms"][1], calls=2)]}
    assert list(ch12.dry_vs_real([rank], [real])["equal"]) == [True, False]
