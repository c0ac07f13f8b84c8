"""The tables a chapter shows, as pandas DataFrames: rendered as real HTML tables in JupyterLab (nothing wraps
mid-word, no cell's text cut short), units in the column headers, built from a run's records.

    from gpucourse.viz import tables
    tables.bandwidth(rows)                     # chapter 01: time and busbw per op and size
"""
from __future__ import annotations

import pandas as pd

from ..models import costs

# A chapter's table shows each cell whole (pandas cuts text at 50 characters by default); HTML wraps it.
pd.set_option("display.max_colwidth", None)
from ..models.units import human_bytes


BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def frame(rows: list[dict], index: str | None = None, *, bytes_columns=()) -> pd.DataFrame:
    """A DataFrame of rows (dicts), indexed by the column `index` if given; each of `bytes_columns` (counts of
    bytes) shown in one binary unit for the whole column, named in its header: "sent" -> "sent (MiB)"."""
    df = pd.DataFrame(rows)
    for column in bytes_columns:
        largest = df[column].abs().max() if len(df) else 0
        power = 0
        while power < len(BINARY_UNITS) - 1 and largest >= 1024 ** (power + 1):
            power += 1
        df[column] = (df[column] / 1024**power).round(2 if power else 0)
        df = df.rename(columns={column: f"{column} ({BINARY_UNITS[power]})"})
    return df.set_index(index) if index else df


def backend_support(metrics: dict, ops: list[str]) -> pd.DataFrame:
    """Which operation ran on which backend (chapter 01). metrics: {rank: records}; the records with "op" say
    ok/error per (backend, op), and one record's "available" says which backends this PyTorch was built with.
    A cell: "yes (ran)", "NO: <error>", "not tried" (built in, but needs a GPU per rank here), or "—"."""
    available = next(rec["available"] for recs in metrics.values() for rec in recs if "available" in rec)
    tried: dict[tuple[str, str], tuple[bool, str]] = {}
    for recs in metrics.values():
        for rec in recs:
            if "op" in rec:
                ok, err = tried.get((rec["backend"], rec["op"]), (True, ""))
                tried[rec["backend"], rec["op"]] = (ok and rec["ok"], err or (rec.get("error") or ""))

    def cell(backend, op):
        if (backend, op) in tried:
            ok, err = tried[backend, op]
            return "yes (ran)" if ok else f"NO: {err[:60]}"
        return "not tried" if available[backend] else "—"

    rows = {"built in": {b: "yes" if a else "no (this PyTorch)" for b, a in available.items()}}
    rows |= {op: {b: cell(b, op) for b in available} for op in ops}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("operation")


def bytes_per_rank(ops: list[str], size: int, world_sizes: list[int]) -> pd.DataFrame:
    """MiB each rank sends for one collective of `size` bytes, by world size (costs.bytes_moved_per_rank)."""
    return pd.DataFrame({f"{op} (MiB)": [costs.bytes_moved_per_rank(op, size, n) / 2**20 for n in world_sizes]
                         for op in ops}, index=pd.Index(world_sizes, name="ranks")).round(1)


def bandwidth(rows: list[dict]) -> pd.DataFrame:
    """One row per message size, per op its time (µs) and busbw (GB/s per rank). rows: the benchmark's records
    {"op", "bytes", "time_s", "busbw"}."""
    df = pd.DataFrame(rows)
    table = df.pivot_table(index="bytes", columns="op", values=["time_s", "busbw"], sort=False)
    out = pd.concat({"time (µs)": table["time_s"] * 1e6, "busbw (GB/s)": table["busbw"] / 1e9}, axis=1)
    out = out.swaplevel(axis=1)[list(dict.fromkeys(df["op"]))]  # grouped by op, in the order run
    out.index = pd.Index([human_bytes(b) for b in out.index], name="message")
    return out.round({c: (1 if c[1].startswith("time") else 4) for c in out.columns})


def link_times(op: str, sizes: list[int], n: int, measured: dict, fit: costs.AlphaBeta) -> pd.DataFrame:
    """Modelled time of `op` on n ranks over each nominal interconnect (costs.INTERCONNECTS, ring model), and
    this machine's measured time beside them (measured: {size: seconds}; fit: its α–β fit)."""
    rows = [{"link": ic.name, "α (µs)": ic.alpha * 1e6, "GB/s": ic.bandwidth_bytes_per_s / 1e9,
             **{f"{human_bytes(s)} (µs)": costs.collective_time(op, s, n, ic.alpha, ic.beta) * 1e6 for s in sizes}}
            for ic in costs.INTERCONNECTS.values()]
    rows.append({"link": "this machine (measured)", "α (µs)": fit.alpha * 1e6, "GB/s": fit.bandwidth / 1e9,
                 **{f"{human_bytes(s)} (µs)": measured[s] * 1e6 for s in sizes}})
    return pd.DataFrame(rows).set_index("link").round(1)
