"""Chapter 12, at scale, on your laptop: the tables it shows from its runs.

`notebooks/12_at_scale_on_your_laptop.ipynb` imports it by its short name:

    from gpucourse.chapters import ch12
    ch12.dry_vs_real(dry, real)          # the same script dry and real, per rank and group

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
"""
from __future__ import annotations

import pandas as pd

from ..viz.tables import as_table, frame, group_text


@as_table
def dry_vs_real(dry: list[dict], real: list[dict]) -> pd.DataFrame:
    """The same script at the same world size, dry (fake process group) and real (a launched job counting with
    $GPUCOURSE_COUNT_FILE): per rank, op and group, the calls and bytes each counted, and whether they agree."""
    rows = []
    for d, r in zip(dry, real):
        real_by = {(c["op"], tuple(c["group"] or [])): c for c in r["comms"]}
        for c in d["comms"]:
            other = real_by.get((c["op"], tuple(c["group"] or [])), {})
            rows.append({"rank": d["rank"], "op": c["op"], "group": group_text(c["group"] or []),
                         "calls, dry": c["calls"], "calls, real": other.get("calls"),
                         "bytes, dry": c["bytes"], "bytes, real": other.get("bytes"),
                         "equal": other.get("calls") == c["calls"] and other.get("bytes") == c["bytes"]})
    return pd.DataFrame(rows).set_index("rank")


@as_table
def plan_memory(plan: dict) -> pd.DataFrame:
    """A plan (models.planner.plan_parallelism), MODELLED: one row per pipeline stage shown (first, last), its
    layers, parameters held, memory by part and in all, in GiB (a device's "80 GB" is 80 GiB)."""
    rows = [{"stage (modelled)": st["stage"], "layers": st["layers"],
             "params held (billions)": round(st["params"] / 1e9, 2),
             **{f"{k} (GiB)": round(v / 2**30, 1) for k, v in st["memory"].items()},
             "total (GiB)": round(st["total"] / 2**30, 1)} for st in plan["stages"]]
    return pd.DataFrame(rows).set_index("stage (modelled)")


@as_table
def published_runs(readings: list[dict]) -> pd.DataFrame:
    """Published runs (models.published.read_published) beside the planner's estimate of the same layout: the
    paper's figures in the "reported" column, the model's in the "modelled" ones, throughput counted the paper's
    way (Megatron-LM's and MT-NLG's hardware FLOPs include the recomputed forward; Llama 3's are model FLOPs)."""
    rows = []
    for r in readings:
        p, lay = r["plan"], r["plan"]["layout"]
        schedule = p["schedule"] + (f", v {p['virtual_stages']}" if p["schedule"] == "interleaved" else "")
        rows.append({"run": r["name"], "GPUs": f"{p['gpus']:,}",
                     "dp×tp×pp×cp": "×".join(str(lay[k]) for k in ("dp", "tp", "pp", "cp")),
                     "schedule": schedule, "micro-batches": p["micro_batches"],
                     "reported (TFLOP/s a GPU)": r["reported"]["tflops_per_gpu"],
                     "modelled (TFLOP/s a GPU)": round(r["modelled_tflops"]),
                     "modelled / reported": round(r["ratio"], 2), "modelled MFU (%)": round(100 * p["mfu"], 1),
                     "assumed": r["assumed"]})
    return pd.DataFrame(rows).set_index("run")


@as_table
def step_terms(plan: dict) -> pd.DataFrame:
    """What each term of a plan's step-time estimate (models.planner.plan_parallelism) costs: seconds a step and
    share of the step, largest first; terms that cost nothing are left out."""
    rows = [{"term (modelled)": k, "seconds a step": round(v, 3), "share (%)": round(100 * v / plan["step_s"], 1)}
            for k, v in sorted(plan["terms"].items(), key=lambda kv: -kv[1]) if v > 0]
    return pd.DataFrame(rows).set_index("term (modelled)")
