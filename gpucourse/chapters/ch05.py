"""Chapter 05, pipeline parallelism: the tables and figures it shows from its runs.

`notebooks/05_pipeline_parallel.ipynb` imports it by its short name:

    from gpucourse.chapters import ch05
    ch05.pipeline_bubbles(rows)          # bubbles measured against (p-1)/(m+p-1)

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
A figure is a matplotlib Figure that says where its numbers came from (the rules of `viz/plots.py`).
"""
from __future__ import annotations

import pandas as pd
from matplotlib import ticker
from matplotlib.figure import Figure

from ..models import costs, traces
from ..viz.tables import as_table


def _pct(x):
    return None if x is None else round(100 * x, 1)


@as_table
def pipeline_orders(schedule, kinds, p: int, m: int) -> pd.DataFrame:
    """One row per (schedule, stage): its actions in order, e.g. "F0 F1 B0 B1". schedule(kind, stage, p, m):
    [(action, micro-batch)], as 05_pipeline.py's `schedule`."""
    rows = [{"schedule": kind, "stage": s, "actions, in order": " ".join(f"{a}{i}" for a, i in schedule(kind, s, p, m))}
            for kind in kinds for s in range(p)]
    return pd.DataFrame(rows).set_index(["schedule", "stage"])


@as_table
def pipeline_bubbles(rows: list[dict]) -> pd.DataFrame:
    """One row per (p, schedule, m) of pipeline.bubble_rows: the bubble measured and by (p-1)/(m+p-1) (%),
    the step measured and the ideal step (ms)."""
    out = [{"p": r["p"], "schedule": r["kind"], "m": r["m"], "bubble measured (%)": _pct(r["measured"]),
            "(p-1)/(m+p-1) (%)": _pct(r["formula"]), "step (ms)": round(r["step_ms"]),
            "(m+p-1)·3·work (ms)": round(r["ideal_ms"])} for r in rows]
    return pd.DataFrame(out).set_index(["p", "schedule", "m"])


@as_table
def pipeline_real_compute(timelines: dict, p: int) -> pd.DataFrame:
    """One row per m of a real-compute GPipe run ({m: timeline}): the bubble measured and by the formula (%),
    the step (ms) and each stage's forward + backward time per micro-batch (ms)."""
    rows = []
    for m, timeline in timelines.items():
        step, measured, _ = traces.idle(timeline)
        rows.append({"m": m, "bubble measured (%)": _pct(measured),
                     "(p-1)/(m+p-1) (%)": _pct(costs.pipeline_bubble_fraction(p, m)), "step (ms)": round(step, 1),
                     **{f"F+B per micro-batch, stage {s} (ms)": round(sum(e - b for _, b, e in spans) / m, 1)
                        for s, spans in timeline.items()}})
    return pd.DataFrame(rows).set_index("m")


@as_table
def stage_activations(rows: list[dict]) -> pd.DataFrame:
    """One row per (p, schedule, m) of pipeline.stage_activation_rows: micro-batches held at the peak and their
    saved bytes (KiB) by stage, the rule's count, and whether every stage matched it."""
    out = [{"p": r["p"], "schedule": r["schedule"], "m": r["m"],
            "held at peak (micro-batches, by stage)": r["held"],
            "saved (KiB, by stage)": [round(b / 1024) for b in r["bytes"]], "rule": r["rule"],
            "matches the rule": "✓" if r["matches"] else "✗"} for r in rows]
    return pd.DataFrame(out).set_index(["p", "schedule", "m"])


@as_table
def gpipe_check(metrics: dict) -> pd.DataFrame:
    """One row per (stage, pipeline) of 05_gpipe_check.py: the largest gradient difference from the unsplit
    model, the loss and the unsplit model's (last stage only), or the error that stopped it."""
    rows = [{"stage": rank, "pipeline": rec["pipeline"],
             "max |grad − unsplit|": None if rec["error"] else rec["max_grad_diff"],
             "loss": None if rec["error"] else rec["loss"],
             "unsplit loss": None if rec["error"] or rec["loss"] is None else rec["ref_loss"],
             "error": rec["error"].splitlines()[0][:100] if rec["error"] else ""}
            for rank in sorted(metrics) for rec in metrics[rank] if "pipeline" in rec]
    return pd.DataFrame(rows).set_index(["stage", "pipeline"])


@as_table
def schedule_runs(runs: dict) -> pd.DataFrame:
    """One row per (schedule, m) of 05_schedules.py (pipeline.schedule_records): the stages each rank held, the
    largest gradient difference from the unsplit model (float64), the loss against the unsplit model's (12
    decimals), or what refused it."""
    rows = []
    for (name, m), by_rank in runs.items():
        first = by_rank[min(by_rank)]
        row = {"schedule": name, "m": m, "stages by rank": None, "max |grad − unsplit|": None, "loss": None,
               "unsplit loss": None, "refused": first["error"] or ""}
        if not first["error"]:
            loss = next(r for r in by_rank.values() if r["loss"] is not None)
            row |= {"stages by rank": [by_rank[r]["stages"] for r in sorted(by_rank)],
                    "max |grad − unsplit|": max(r["max_grad_diff"] for r in by_rank.values()),
                    "loss": f"{loss['loss']:.12f}", "unsplit loss": f"{loss['ref_loss']:.12f}"}
        rows.append(row)
    return pd.DataFrame(rows).set_index(["schedule", "m"])


@as_table
def schedule_bubbles(table: dict, refused: dict | None = None) -> pd.DataFrame:
    """One row per (schedule, m) of pipeline.schedule_bubbles: v, step and mean busy time per rank (ms); idle
    over the step, measured and by (p-1)/(v·m+p-1) (%); idle over the work, measured, replayed with the measured
    durations (free messages), replayed with the nominal ones, and by (p-1)/(v·m) (%). refused: {(schedule, m):
    error} for the runs a constructor refused (a row saying so)."""
    rows = [{"schedule": name, "m": m, "v": r["v"], "step (ms)": round(r["step"]), "busy (ms)": round(r["busy"]),
             "idle/step measured (%)": _pct(r["share"]), "idle/step formula (%)": _pct(r.get("f_share")),
             "idle/work measured (%)": _pct(r["ratio"]), "replay, measured durations (%)": _pct(r["free"]),
             "replay, nominal (%)": _pct(r["nominal"]), "idle/work formula (%)": _pct(r.get("f_ratio")),
             "refused": ""} for (name, m), r in table.items()]
    rows += [{"schedule": name, "m": m, "refused": error.split(":")[0]} for (name, m), error in (refused or {}).items()]
    order = list(dict.fromkeys(r["schedule"] for r in rows))  # as run, each schedule's m in order
    rows.sort(key=lambda r: (order.index(r["schedule"]), r["m"]))
    df = pd.DataFrame(rows).set_index(["schedule", "m"])
    df["v"] = df["v"].astype("Int64")
    return df


@as_table
def versus_1f1b(table: dict, m: int,
                names=("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")) -> pd.DataFrame:
    """Each of `names` at m micro-batches against 1F1B (pipeline.schedule_bubbles' table): idle over work,
    measured and modelled (%), its verdict (within half a point: "about the same") and both steps (ms)."""
    base = table.get(("1F1B", m))
    rows = []
    for name in names:
        row = table.get((name, m))
        if not (base and row):
            continue
        verdict = ("about the same" if abs(row["ratio"] - base["ratio"]) < 0.005 else
                   "smaller" if row["ratio"] < base["ratio"] else "larger")
        rows.append({"schedule": name, "idle/work measured (%)": _pct(row["ratio"]),
                     "1F1B measured (%)": _pct(base["ratio"]), "measured vs 1F1B": verdict,
                     "modelled (%)": _pct(row["nominal"]), "1F1B modelled (%)": _pct(base["nominal"]),
                     "step (ms)": round(row["step"]), "1F1B step (ms)": round(base["step"])})
    return pd.DataFrame(rows, columns=["schedule", "idle/work measured (%)", "1F1B measured (%)", "measured vs 1F1B",
                                       "modelled (%)", "1F1B modelled (%)", "step (ms)", "1F1B step (ms)"]
                        ).set_index("schedule")


@as_table
def action_overheads(overheads: dict) -> pd.DataFrame:
    """One row per schedule of pipeline.action_overheads: per kind of action, its mean measured time minus its
    nominal sleep (ms, 1 decimal) and the number of such actions."""
    rows = [{"schedule": name, **{col: v for k, (mean, n) in kinds.items()
                                  for col, v in ((f"{k}: extra (ms)", round(mean, 1)), (f"{k}: actions", n))}}
            for name, kinds in overheads.items()]
    df = pd.DataFrame(rows).set_index("schedule")
    for col in [c for c in df.columns if c.endswith("actions")]:
        df[col] = df[col].astype("Int64")  # whole counts, blank where a schedule has no such action
    return df


@as_table
def few_micro(runs: dict, table: dict, p: int) -> pd.DataFrame:
    """One row per (m < p, schedule): what PyTorch did with fewer micro-batches than ranks: refused (the
    constructor's error), or ran, with its idle share of the step and idle over work, measured and modelled (%),
    and, for the schedules the formula describes, (p-1)/(v·m) and (p-1)/m (%)."""
    rows = []
    for (name, m), by_rank in runs.items():
        if m >= p:
            continue
        error = by_rank[min(by_rank)]["error"]
        row = {"m": m, "schedule": name, "what happened": f"refused: {error}" if error else "ran"}
        if not error:
            r = table[(name, m)]
            row |= {"idle/step measured (%)": _pct(r["share"]), "idle/work measured (%)": _pct(r["ratio"]),
                    "idle/work modelled (%)": _pct(r["nominal"]), "(p-1)/(v·m) (%)": _pct(r.get("f_ratio")),
                    "(p-1)/m (%)": _pct(costs.pipeline_bubble_ratio(p, m)) if "f_ratio" in r else None}
        rows.append(row)
    return pd.DataFrame(rows).set_index(["m", "schedule"]) if rows else pd.DataFrame()


@as_table
def dualpipev_plan(runs: dict) -> pd.DataFrame:
    """One row per (m, rank) of the DualPipeV runs ({m: {rank: record}}): the rank's stages, the largest gradient
    difference from the unsplit model and its plan in torch's order, or the constructor's refusal."""
    rows = []
    for m, by_rank in runs.items():
        for rank, rec in sorted(by_rank.items()):
            error = by_rank[min(by_rank)]["error"]
            rows.append({"m": m, "rank": rank, "stages": None if error else rec["stages"],
                         "max |grad − unsplit|": None if error else rec["max_grad_diff"],
                         "plan": f"refused: {error}" if error else " ".join(rec["order"])})
    return pd.DataFrame(rows).set_index(["m", "rank"])


@as_table
def timeline_idle(idle: dict) -> pd.DataFrame:
    """One row per timeline of pipeline.timeline_idle ({title: (step ms, {rank: idle ms})}): the step and each
    rank's idle time (ms, 1 decimal)."""
    rows = [{"timeline": title, "step (ms)": round(step, 1), **{f"idle, rank {r} (ms)": round(ms, 1)
                                                                for r, ms in by_rank.items()}}
            for title, (step, by_rank) in idle.items()]
    return pd.DataFrame(rows).set_index("timeline")


@as_table
def chunk_activations(rows: list[dict]) -> pd.DataFrame:
    """One row per (schedule, m, rank) of pipeline.chunk_activation_rows: chunks held at the peak and the
    formula's count ("—" where it has none), micro-batches (chunks / v), bytes (KiB) and whether both matched."""
    out = [{"schedule": r["schedule"], "m": r["m"], "rank": r["rank"], "chunks held": r["chunks"],
            "formula": "—" if r["formula"] is None else r["formula"], "micro-batches": r["micro-batches"],
            "held (KiB)": round(r["bytes"] / 1024), "matches": "✓" if r["matches"] else "✗"} for r in rows]
    return pd.DataFrame(out).set_index(["schedule", "m", "rank"])


@as_table
def stage_costs(counted: list[dict], modelled: list[dict]) -> pd.DataFrame:
    """One row per stage: weights and training FLOPs per token counted (FlopCounterMode) beside
    costs.pipeline_stage_costs' (counted: [{"stage", "params", "flops_per_token"}], modelled: the same keys)."""
    if len(counted) != len(modelled):
        raise ValueError(f"{len(counted)} counted stages but {len(modelled)} modelled")
    rows = [{"stage": c["stage"], "weights counted": c["params"], "weights modelled": m["params"],
             "FLOPs/token counted": c["flops_per_token"], "FLOPs/token modelled": m["flops_per_token"]}
            for c, m in zip(counted, modelled)]
    return pd.DataFrame(rows).set_index("stage")


@as_table
def stage_cuts(cuts: dict, d_model: int, vocab: int, seq_len: int) -> pd.DataFrame:
    """One row per cut ({name: blocks per stage}) of a GPT (costs.pipeline_stage_costs): training GFLOPs per token
    and parameters (M) by stage, and the pace vs a balanced pipeline (%): mean over slowest stage, every stage
    waiting for the slowest."""
    rows = []
    for cut, layers in cuts.items():
        stages = costs.pipeline_stage_costs(layers, d_model, vocab, seq_len)
        flops = [st["flops_per_token"] for st in stages]
        rows.append({"cut": cut, "blocks by stage": layers,
                     "GFLOPs/token by stage": [round(f / 1e9, 2) for f in flops],
                     "params by stage (M)": [round(st["params"] / 1e6, 1) for st in stages],
                     "pace vs balanced (%)": round(100 * sum(flops) / len(flops) / max(flops))})
    return pd.DataFrame(rows).set_index("cut")


def bubble_plot(rows: list[dict], labels: dict):
    """A pipeline's measured bubble against the number of micro-batches m, one panel per depth p: each schedule's
    measured points beside (p-1)/(m+p-1). rows: [{"p", "kind", "m", "measured"}]; labels: {p: the run's label}."""
    depths = sorted({r["p"] for r in rows})
    fig = Figure(figsize=(5.2 * len(depths), 3.6), layout="constrained")
    for ax, p in zip(fig.subplots(1, len(depths), squeeze=False)[0], depths):
        ms = sorted({r["m"] for r in rows if r["p"] == p})
        ax.plot(ms, [costs.pipeline_bubble_fraction(p, m) for m in ms], "k--", label="(p-1)/(m+p-1)")
        for kind, marker in zip(dict.fromkeys(r["kind"] for r in rows), "osD^"):
            mine = sorted((r["m"], r["measured"]) for r in rows if r["p"] == p and r["kind"] == kind)
            ax.plot([m for m, _ in mine], [b for _, b in mine], marker, ms=7, label=f"{kind} measured", alpha=0.8)
        ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble (idle fraction)", ylim=(0, 1),
               title=f"p = {p} stages — {labels[p]}")
        ax.set_xticks(ms, [str(m) for m in ms])  # a tick at each m run, and no others
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.legend(fontsize=8)
    return fig
