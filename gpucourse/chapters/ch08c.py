"""Chapter 08c, checkpoints that do not stop training and the slow rank: what it shows from its one run.

`notebooks/08c_async_checkpoints_and_slow_ranks.ipynb` imports it by its short name:

    from gpucourse.chapters import ch08c
    ch08c.saves(run.metrics)                # blocking vs asynchronous saves: what the loop waited, per save
    ch08c.slow_rank(run)                    # the rank that makes everyone wait, from the Flight Recorder

The run is scripts/08c_saves_and_stragglers.py's: step records with a `phase`, save records, one resume record per
rank, and each rank's Flight Recorder dump taken after its slow phase.
"""
from __future__ import annotations

from statistics import median

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..models import training
from ..run import forensics
from ..viz import plots
from ..viz.tables import as_table

MODES = ("blocking", "async")


def steps(metrics: dict, phase: str) -> dict[int, list[dict]]:
    """{rank: its step records of `phase`} (healthy, slow, blocking, async)."""
    return {rank: [r for r in records if r.get("phase") == phase] for rank, records in sorted(metrics.items())}


def save_costs(metrics: dict) -> dict[str, dict]:
    """{mode: {"saves", "blocked_s" (median over ranks and saves: how long the loop stood still), "written_s" (median
    seconds from the save's start until its files were complete), "lost_s" (what the phase took beyond as many
    healthy steps, per save, rank 0: the blocked time and the steps the writer slowed; for asynchronous saves, with
    the wait for the last write after the phase, which would otherwise have slowed steps after it), "step_s" (median
    step of the phase)}} for blocking and asynchronous saves, and "healthy_step_s"."""
    healthy = median(r["step_s"] for r in steps(metrics, "healthy")[0])
    out = {}
    for mode in MODES:
        saves = [r for records in metrics.values() for r in records if r.get("save") == mode]
        written = [r for records in metrics.values() for r in records
                   if r.get("save") == ("async-done" if mode == "async" else mode)]
        phase = steps(metrics, mode)[0]
        per_rank0 = sum(1 for r in metrics[0] if r.get("save") == mode)
        drain = sum(r["wait_s"] for r in metrics[0] if r.get("save") == f"{mode}-drain")
        if not saves or not per_rank0:
            raise ValueError(f"no {mode} save in the run's records: did the run end early?")
        out[mode] = {"saves": per_rank0, "blocked_s": median(r["blocked_s"] for r in saves),
                     "written_s": median(r["upload_s"] for r in written),
                     "lost_s": max(0.0, sum(r["step_s"] for r in phase) + drain - healthy * len(phase)) / per_rank0,
                     "step_s": median(r["step_s"] for r in phase)}
    return {**out, "healthy_step_s": healthy}


@as_table
def saves(metrics: dict) -> pd.DataFrame:
    """One row per way of saving: saves made, what the loop waited per save, when the files were complete, the
    median step of its phase against the healthy one, and the time the phase lost per save (save_costs)."""
    costs = save_costs(metrics)
    rows = [{"save": mode, "saves (rank 0)": c["saves"], "loop blocked per save (ms)": c["blocked_s"] * 1e3,
             "files complete after (ms)": c["written_s"] * 1e3, "median step (ms)": c["step_s"] * 1e3,
             "healthy median step (ms)": costs["healthy_step_s"] * 1e3,
             "time lost per save (ms)": c["lost_s"] * 1e3}
            for mode, c in costs.items() if mode in MODES]
    return pd.DataFrame(rows).set_index("save").round(1)


def step_times_plot(metrics: dict, label: str) -> Figure:
    """Rank 0's step times through the blocking and the asynchronous phases, the steps that saved marked, and the
    healthy median: what a save does to the steps around it."""
    fig = Figure(figsize=(9, 3.2))
    ax = fig.add_subplot()
    healthy = median(r["step_s"] for r in steps(metrics, "healthy")[0])
    for mode, colour in zip(MODES, ("tab:red", "tab:blue")):
        recs = steps(metrics, mode)[0]
        xs, ys = [r["step"] for r in recs], [r["step_s"] * 1e3 for r in recs]
        ax.bar(xs, ys, color=colour, alpha=0.6, label=f"{mode} phase")
        saved = [(x, y) for x, y, r in zip(xs, ys, recs) if r.get("saved") is not None]
        ax.plot(*zip(*saved), "v", color="black", ms=7, label=None if mode == "async" else "step that saved")
    ax.axhline(healthy * 1e3, color="grey", ls="--", label=f"healthy median {healthy * 1e3:.0f} ms")
    ax.set(xlabel="step", ylabel="step time (ms)", title=f"Step times around the saves, rank 0 ({label})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.legend(fontsize=8)
    return plots.finished(fig)


def goodput_plot(costs: dict, mtbf_s: float, label: str, restart_s: float = 0.0) -> Figure:
    """Goodput (training.goodput) against the checkpoint interval for the measured blocking and asynchronous saves
    (save_costs: the loop loses lost_s a save; an asynchronous checkpoint is complete written_s later), each with
    its Young/Daly interval sqrt(2 * lost * MTBF) marked (an asynchronous save cannot come more often than it
    takes to write)."""
    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot()
    taus = np.logspace(-1, np.log10(mtbf_s), 400)
    for mode, colour in zip(MODES, ("tab:red", "tab:blue")):
        c = costs[mode]
        lag = c["written_s"] if mode == "async" else 0.0
        ax.plot(taus, [100 * training.goodput(t, c["lost_s"], mtbf_s, restart_s, lag) for t in taus], color=colour,
                label=f"{mode}: loses {c['lost_s'] * 1e3:.0f} ms a save")
        best = best_interval(c, mode, mtbf_s)
        ax.plot(best, 100 * training.goodput(best, c["lost_s"], mtbf_s, restart_s, lag), "o", color=colour,
                label=f"{mode}: Young/Daly {best:,.0f} s")
    ax.set_xscale("log")
    ax.set(xlabel="checkpoint interval (s of training)", ylabel="goodput (%)", ylim=(90, 100.2),
           title=f"Goodput, MTBF {mtbf_s / 3600:,.1f} h (measured costs: {label})")
    ax.legend(fontsize=8)
    return plots.finished(fig)


def best_interval(cost: dict, mode: str, mtbf_s: float) -> float:
    """Young/Daly's interval for one way of saving (save_costs' row): sqrt(2 * lost * MTBF), and for an
    asynchronous save at least the time its write takes (the next save would wait for it)."""
    tau = training.young_daly_interval(cost["lost_s"], mtbf_s)
    return max(tau, cost["written_s"]) if mode == "async" else tau


@as_table
def resumed(metrics: dict) -> pd.DataFrame:
    """One row per rank: the asynchronous checkpoint it resumed from, the steps replayed after it, and whether the
    parameters and AdamW's state then equal, bit for bit, those of the run that never stopped."""
    rows = [{"rank": rank, **{k: rec[k] for k in ("resumed_from", "replayed", "bitwise_equal", "max_abs_diff")}}
            for rank, records in sorted(metrics.items()) for rec in records if "bitwise_equal" in rec]
    return pd.DataFrame(rows).set_index("rank")


def rank_rows(result, phase: str) -> list[dict]:
    """training.rank_steps of one phase of the run: every rank's step time, wait in collectives (from its Flight
    Recorder dump: forensics.arrivals) and own work."""
    return training.rank_steps(steps(result.metrics, phase), forensics.arrivals(result.run_dir, result.world_size))


@as_table
def per_rank(result) -> pd.DataFrame:
    """One row per (phase, rank), healthy and slow: the median step time, wait in collectives and own work."""
    rows = []
    for phase in ("healthy", "slow"):
        found = rank_rows(result, phase)
        for rank in sorted({r["rank"] for r in found}):
            mine = [r for r in found if r["rank"] == rank]
            rows.append({"phase": phase, "rank": rank, **{f"{k[:-2]} (ms)": 1e3 * median(r[k] for r in mine)
                                                         for k in ("step_s", "wait_s", "busy_s")}})
    return pd.DataFrame(rows).set_index(["phase", "rank"]).round(1)


def slow_rank(result, phase: str = "slow") -> dict:
    """training.straggler of one phase: the rank whose own work is longest, its slowdown and extra seconds a step."""
    return training.straggler(rank_rows(result, phase))


def slow_step(result, slow_rank: int, slow_s: float) -> dict:
    """The slow phase's step predicted from the healthy phase (training.synchronous_step_time: each rank's healthy
    own work, `slow_s` more on `slow_rank`, plus the sync the healthy step spent beyond its slowest rank's work)
    and measured (the slow phase's median step, rank 0). {"healthy_s", "predicted_s", "measured_s"}."""
    healthy = rank_rows(result, "healthy")
    ranks = sorted({r["rank"] for r in healthy})
    busy = {k: median(r["busy_s"] for r in healthy if r["rank"] == k) for k in ranks}
    step = median(r["step_s"] for r in healthy if r["rank"] == 0)
    sync = max(0.0, step - max(busy.values()))
    predicted = training.synchronous_step_time([busy[k] + (slow_s if k == slow_rank else 0.0) for k in ranks], sync)
    measured = median(r["step_s"] for r in steps(result.metrics, "slow")[0])
    return {"healthy_s": step, "predicted_s": predicted, "measured_s": measured}
