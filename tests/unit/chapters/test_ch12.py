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


TINY = {"layers": 2, "d_model": 32, "ffn": 64, "heads": 4, "kv_heads": 2, "vocab": 128, "mlp_matrices": 3}


def test_llama_job_is_the_published_layout_in_the_scripts_terms_and_the_planners():
    job = ch12.llama_job("llama3-405b", **ch12.LLAMA3_405B)
    args = dict(zip(job["args"][::2], job["args"][1::2]))
    assert job["world"] == 16384 and args["--pp"] == "16" and args["--batch"] == "2048" and args["--micro"] == "16"
    assert [st["layers"] for st in job["plan"]["stages"]] == [7, 7]  # Llama 3's split: 7, 8 x 14, 7
    assert job["plan"]["micro_batches"] == 16 and job["tokens"] == 16 * 8192
    assert planner.llama3_stage_layers(126, 16) == [7] + [8] * 14 + [7]
    with pytest.raises(ValueError, match="divide the layers"):
        planner.llama3_stage_layers(126, 5)


def plan_as_counted(job):
    """A dry-run report that counts exactly what `job`'s plans say, rank by rank (ranks 0 and world - 1)."""
    tp, dp, pp = (job["layout"][k] for k in ("tp", "dp", "pp"))
    stride = {"tp": 1, "dp": tp, "pp": tp * dp}
    ranks = []
    for index, rank in enumerate((0, job["world"] - 1)):
        stage, states = job["plan"]["stages"][index], job["states"]["stages"][index]["states"]
        comms = [{"op": c["op"], "group_size": 2, "group": [rank - stride[c["group"]], rank] if index else
                  [rank, rank + stride[c["group"]]], "calls": c["calls"], "bytes": c["bytes"]}
                 for c in stage["collectives"]]
        ranks.append({"rank": rank, "memory": {k: stage["memory"].get(k, 0) for k in ch12.MEMORY_PARTS},
                      "peak_bytes": stage["total"], "model_states": dict(states), "comms": comms,
                      "flops": ch12.modelled_flops(job, index)[1]})
    return {"world": job["world"], "ranks": ranks}


def test_a_dry_run_that_counts_the_plan_agrees_everywhere_and_a_difference_shows_in_its_row():
    job = ch12.llama_job(TINY, tp=2, pp=2, dp=2, seq=16, global_batch=4, micro=2)
    dry = plan_as_counted(job)
    agree = ch12.agreement(dry, job)
    assert list(agree) == [0, 7]
    assert all(r == pytest.approx(1) for ratios in agree.values() for r in ratios.values())
    names = ch12.counted_groups(dry["ranks"][0], job["layout"])
    assert {g for g, _ in names} == {"tp", "dp", "pp"}  # all three groups have 2 ranks: told apart by stride
    dry["ranks"][1]["model_states"]["grads"] *= 0.5
    dry["ranks"][0]["memory"]["activations"] *= 2
    agree = ch12.agreement(dry, job)
    assert agree[7]["model states"] == pytest.approx(0.5) and agree[0]["activations"] == pytest.approx(2)
    memory = ch12.counted_memory(dry, job)
    assert memory.loc[(7, "grads between steps"), "dry run / modelled"] == 0.5
    comms = ch12.counted_comms(dry, job)
    assert (comms["bytes: dry run / modelled"] == 1).all()


def test_a_fused_send_and_receive_counts_as_one_of_each_at_the_stages_message_size():
    layout = {"tp": 1, "dp": 1, "pp": 2}
    rank = {"comms": [{"op": "isend", "group_size": 2, "group": [0, 1], "calls": 2, "bytes": 200},
                      {"op": "batch_isend_irecv", "group_size": 2, "group": [0, 1], "calls": 3, "bytes": 0}]}
    got = ch12.counted_groups(rank, layout)
    assert got[("pp", "send")]["calls"] == 5 and got[("pp", "send")]["bytes"] == 500
    assert got[("pp", "recv")] == {"calls": 3, "bytes": 300, "ranks": [0, 1]}
