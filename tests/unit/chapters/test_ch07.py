"""What chapter 07 (ZeRO and FSDP) shows, `gpucourse/chapters/ch07.py`, built from hand-made records."""
from gpucourse.chapters import ch07


# --- chapter 07: ZeRO and FSDP ------------------------------------------------------------------------
def test_zero_stages_reproduce_the_zero_papers_figure_1():
    df = ch07.zero_stages(7.5e9, 64)
    assert df["per device (GB)"].tolist() == [120.0, 31.4, 16.6, 1.9]
    assert df.loc[3, "communication per step (GB)"] == 1.5 * df.loc[0, "communication per step (GB)"]


def test_model_sizes_say_what_fits_and_when_zero1_never_does():
    df = ch07.model_sizes((1e9, 70e9), 80e9)
    assert df.loc["1B", "fits under DDP"] and not df.loc["70B", "fits under DDP"]
    assert df.loc["70B", "fewest devices, ZeRO-1"] == "never" and df.loc["70B", "fewest devices, ZeRO-3"] == 16


def _state_row(n, mode, measured, total_model, diff=None):
    return {"N": n, "mode": mode, "numel": 10, "measured": measured, "total": sum(measured.values()),
            "model": {"total": total_model}, "diff": diff, "impl": None}


def test_memory_per_rank_and_share_of_ddp():
    rows = [_state_row(2, "ddp", {"params": 4e6, "grads": 4e6, "optimizer": 8e6}, 16e6),
            _state_row(2, "fsdp2", {"params": 2e6, "grads": 2e6, "optimizer": 4.4e6}, 8e6, diff=1e-7)]
    df = ch07.memory_per_rank(rows)
    assert df.loc[(2, "fsdp2"), "total (MB)"] == 8.4 and df.loc[(2, "fsdp2"), "measured / formula"] == 1.05
    assert df.loc[(2, "fsdp2"), "|θ − θ_DDP|"] == 1e-7
    share = ch07.share_of_ddp(rows)
    assert share.loc[(2, "fsdp2"), "parameters"] == 0.5 and share.loc[(2, "fsdp2"), "optimizer states"] == 0.55


class _Step:
    def __init__(self, us):
        self.duration_us = us


class _Rank:
    def __init__(self, per_step):
        self.per_step = per_step

    def collective(self, name):
        return self.per_step


class _Analysis:
    kind = "cpu-gloo"

    def __init__(self, per_step, step_us):
        self.ranks = {0: _Rank(per_step)}
        self.steps = [_Step(us) for us in step_us]


def test_prefetch_table_from_traces_and_counts():
    analyses = {"defaults": _Analysis([(4000.0, 4000.0), (6000.0, 6000.0)], [20000, 22000]),
                "prefetch": _Analysis([(6000.0, 1500.0), (6000.0, 1500.0)], [18000, 18000])}
    rec = {"all_gathers": 6, "all_gather_bytes": [1.5e6], "async_all_gathers": 0}
    df = ch07.prefetch(analyses, {"defaults": rec, "prefetch": rec | {"async_all_gathers": 6}})
    assert df.loc["defaults", "hidden (%)"] == 0 and df.loc["prefetch", "hidden (%)"] == 75
    assert df.loc["defaults", "all-gather (ms)"] == 5.0 and df.loc["defaults", "max (ms)"] == 6.0
    assert df.loc["prefetch", "exposed (ms)"] == 1.5 and df.loc["defaults", "step (ms)"] == 21.0
    assert df.loc["prefetch", "async"] == 6


def test_unsharded_hsdp_and_accumulation_tables():
    rec = {"all_gathers": 1, "all_gather_bytes": [4e6], "reduce_scatters": 1, "peak_unsharded_bytes": 4e6,
           "model_bytes": 4e6}
    assert ch07.unsharded({"root only": rec}).loc["root only", "unsharded at most (MB)"] == 4.0
    row = {"variant": "hsdp", "mesh": "2x2", "measured": {"params": 1, "grads": 1, "optimizer": 2},
           "model": {"params": 1, "grads": 1, "optimizer": 3}, "loss diff": 0.0, "param diff": 1e-8}
    assert not ch07.hsdp_states([row]).loc["hsdp", "= formula"]
    comm = {"hsdp": {"all_reduce": {"group": "replicate", "ranks_list": [0, 2], "counted": 2e6, "calls_bytes": 2e6,
                                    "sent": 1e6}}}
    assert ch07.hsdp_comm(comm).loc[("hsdp", "all_reduce"), "ranks"] == "[0, 2]"
    calls = [{"op": "all_gather", "bytes": 1e6}] * 8 + [{"op": "reduce_scatter", "bytes": 1e6}]
    df = ch07.accumulation_calls({"no-sync": {"calls": calls, "max_param_diff": 1e-9}})
    assert df.loc["no-sync", "all_gather calls"] == 8 and df.loc["no-sync", "reduce_scatter (MB)"] == 1.0


# --- chapter 07 -----------------------------------------------------------------------------------------------
def test_model_states_per_rank_draws_a_panel_per_world_size_titled_with_its_backend():
    row = lambda n, mode, mb: {"N": n, "mode": mode, "measured": {"params": mb, "grads": mb, "optimizer": 2 * mb},
                               "model": {"total": 4 * mb}}
    fig = ch07.model_states_per_rank([row(2, "ddp", 4e6), row(2, "fsdp2", 2e6), row(4, "ddp", 4e6)],
                                      {2: "CPU, gloo", 4: "CPU, gloo"}, title="t")
    assert [ax.get_title() for ax in fig.axes] == ["2 ranks (CPU, gloo)", "4 ranks (CPU, gloo)"]
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    assert heights[-1] == 8.0  # ddp's optimizer part, MB


def test_hsdp_figure_marks_the_bytes_that_cross_nodes():
    rows = [{"variant": v, "mesh": m, "measured": {"params": 1e6, "grads": 1e6, "optimizer": 2e6}}
            for v, m in (("ddp", "4x1"), ("hsdp", "2x2"))]
    comm = {"ddp": {"all_reduce": {"sent": 3e6}}, "hsdp": {"all_gather": {"sent": 1e6}, "all_reduce": {"sent": 5e5}}}
    fig = ch07.hsdp_figure(rows, comm, {"ddp": 3e6, "hsdp": 5e5}, ranks_per_node=2, title="x")
    crosses = fig.axes[1].lines[0]
    assert list(crosses.get_ydata()) == [3.0, 0.5] and "nodes of 2" in crosses.get_label()
