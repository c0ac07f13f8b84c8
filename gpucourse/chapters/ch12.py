"""Chapter 12, at scale, on your laptop: the tables it shows from its runs.

`notebooks/12_at_scale_on_your_laptop.ipynb` imports it by its short name:

    from gpucourse.chapters import ch12
    ch12.dryrun_memory(report)           # a dry run's memory per simulated rank

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
"""
from __future__ import annotations

import pandas as pd

from ..viz.tables import as_table, frame


def _group_text(group: list) -> str:
    return str(group) if len(group) <= 4 else f"[{group[0]}, {group[1]}, …, {group[-1]}]"


@as_table
def dryrun_memory(report: dict, device_bytes: float = 80e9) -> pd.DataFrame:
    """One row per simulated rank of a dry run (gpucourse.dryrun, each rank's "predicted" filled by
    costs.dryrun_step_time): the memory peak and its parts (counted in the dry run, in decimal units as the
    device's "80 GB" is), the peak's share of `device_bytes`, the FLOPs counted, and the step time and MFU modelled
    on the named system."""
    rows = []
    for r in report["ranks"]:
        p = r.get("predicted") or {}
        rows.append({"rank": r["rank"], **r["memory"], "peak": r["peak_bytes"],
                     f"peak / {device_bytes / 1e9:.0f} GB (%)": round(100 * r["peak_bytes"] / device_bytes, 6),
                     "FLOPs counted": r["flops"],
                     "step, modelled (ms)": round(p["step_s"] * 1e3, 3) if p else None,
                     "MFU, modelled (%)": round(100 * p["mfu"], 4) if p and p["mfu"] is not None else None})
    parts = [*report["ranks"][0]["memory"], "peak"] if report["ranks"] else []
    return frame(rows, "rank", bytes_columns=parts, decimal=True)


@as_table
def dryrun_comms(report: dict) -> pd.DataFrame:
    """Every collective and point-to-point call each simulated rank made in its step, by process group (its size
    and global ranks, first and last shown): calls and bytes in nccl-tests' convention, counted."""
    rows = [{"rank": r["rank"], "op": c["op"], "group size": c["group_size"], "group": _group_text(c["group"] or []),
             "calls": c["calls"], "bytes": c["bytes"]} for r in report["ranks"] for c in r["comms"]]
    return frame(rows, "rank", bytes_columns=["bytes"])


@as_table
def dry_vs_real(dry: list[dict], real: list[dict]) -> pd.DataFrame:
    """The same script at the same world size, dry (fake process group) and real (a launched job counting with
    $GPUCOURSE_COUNT_FILE): per rank, op and group, the calls and bytes each counted, and whether they agree."""
    rows = []
    for d, r in zip(dry, real):
        real_by = {(c["op"], tuple(c["group"] or [])): c for c in r["comms"]}
        for c in d["comms"]:
            other = real_by.get((c["op"], tuple(c["group"] or [])), {})
            rows.append({"rank": d["rank"], "op": c["op"], "group": _group_text(c["group"] or []),
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
