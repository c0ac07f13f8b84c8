"""The course's tables, as pandas DataFrames: rendered as real HTML tables in JupyterLab (nothing wraps mid-word, no
cell's text cut short), units in the column headers, built from a run's records. What several chapters show lives
here; a table one chapter shows lives in its chapter's module (`gpucourse/chapters/`), built with the same rule.

    from gpucourse.viz import tables
    tables.frame(rows, "rank", bytes_columns=["sent"])   # any rows, each bytes column in one unit

Every table is a `Table`: a DataFrame that holds the numbers (index it as any DataFrame) and is shown by one
formatting rule (`cell_texts`, every chapter): whole numbers with thousands separators, plain decimals (never 4.48e+02),
scientific notation only below 0.001 or from 10^15 on, a dash where there is no value, headers that do not break
inside their units. A function that builds a DataFrame becomes one that returns a `Table` with `@as_table`.
"""
from __future__ import annotations

import functools
import math
import numbers
import re

import numpy as np
import pandas as pd

# A chapter's table shows each cell whole (pandas cuts text at 50 characters by default); HTML wraps it.
pd.set_option("display.max_colwidth", None)

NO_VALUE = "—"  # a cell with nothing in it (None, NaN): a dash, not "NaN" or "None"


def _is_missing(v) -> bool:
    return v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float) and math.isnan(v))


def _decimals(v: float) -> int:
    """The fewest decimals that show v as it is, at most six significant digits."""
    most = max(0, 5 - math.floor(math.log10(abs(v))))
    return next((d for d in range(most) if abs(round(v, d) - v) <= 1e-9 * abs(v)), most)


def cell_texts(values) -> list[str]:
    """The course's one formatting rule, for one column (or index level) of a table: integers with thousands
    separators; floats with the decimals they need (six significant digits at most; the column's values aligned
    up to three decimals: 1.00 beside 1.27), in scientific notation only when tiny (< 0.001) or huge (>= 10^15);
    None and NaN as a dash; anything else (text, booleans, lists) as it is."""
    values = list(values)
    plain = [float(v) for v in values if isinstance(v, (float, np.floating)) and not _is_missing(v)
             and 1e-3 <= abs(v) < 1e15]
    column = min(3, max((_decimals(v) for v in plain), default=0))  # aligned up to 3 decimals; more where needed

    def text(v) -> str:
        if _is_missing(v):
            return NO_VALUE
        if isinstance(v, (bool, np.bool_)):
            return str(bool(v))
        if isinstance(v, numbers.Integral):
            return f"{int(v):,}"
        if isinstance(v, (float, np.floating)):
            v = float(v)
            if math.isinf(v) or v == 0:
                return str(v) if math.isinf(v) else "0"
            if not 1e-3 <= abs(v) < 1e15:
                return f"{v:.2e}"
            return f"{v:,.{max(column, _decimals(v))}f}"
        return str(v)

    return [text(v) for v in values]


def _header(label) -> str:
    """A header that breaks between words but never inside its unit: "kept (× none)", "80 GB" stay whole."""
    text = re.sub(r"\([^()]*\)", lambda m: m.group(0).replace(" ", "\u00a0"), str(label))
    return re.sub(r"(\d) (?=[A-Za-zµ%×])", "\\1\u00a0", text)


def _index_texts(index: pd.Index) -> pd.Index:
    if isinstance(index, pd.MultiIndex):
        levels = [cell_texts(index.get_level_values(i)) for i in range(index.nlevels)]
        return pd.MultiIndex.from_arrays(levels, names=[_header(n) if n is not None else None for n in index.names])
    return pd.Index(cell_texts(index), name=_header(index.name) if index.name is not None else None)


class Table(pd.DataFrame):
    """A DataFrame shown by the course's formatting rule (`cell_texts`); its values stay numbers."""

    @property
    def _constructor(self):
        return Table

    def shown(self) -> pd.DataFrame:
        """The table as it is shown: every cell formatted as text, headers that do not break inside units."""
        out = pd.DataFrame({i: cell_texts(self.iloc[:, i]) for i in range(self.shape[1])}, dtype=object)
        out.index = _index_texts(self.index)
        if isinstance(self.columns, pd.MultiIndex):
            out.columns = pd.MultiIndex.from_tuples([tuple(_header(x) for x in c) for c in self.columns],
                                                    names=self.columns.names)
        else:
            out.columns = pd.Index([_header(c) for c in self.columns], name=self.columns.name)
        return out

    def _repr_html_(self):
        return self.shown()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.shown())


def as_table(build):
    """`@as_table`: `build` (rows in, a DataFrame out) returns a `Table` instead, shown by the course's one rule; its
    name, docstring and signature stay build's (functools.wraps; `__wrapped__` is build)."""
    @functools.wraps(build)
    def table(*args, **kwargs) -> Table:
        df = build(*args, **kwargs)
        out = Table(df)
        out.attrs = df.attrs  # what a table carries beside its cells (chapter 03's step_predictions' errors)
        return out

    return table


BINARY_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")  # "bytes", never "B": "405B" is billions of parameters
DECIMAL_UNITS = ("bytes", "kB", "MB", "GB", "TB")


def _byte_unit(column: pd.Series, base: int) -> int:
    """The power of `base` a column of byte counts is shown in: the largest unit its largest value reaches, and
    no larger than one in which its smallest non-zero value still reads 0.1 or more (4 bytes never "0.00 MiB")."""
    sizes = column.abs()
    largest, smallest = (sizes.max(), sizes[sizes > 0].min()) if (sizes > 0).any() else (0, 0)
    power = 0
    while (power < len(BINARY_UNITS) - 1 and largest >= base ** (power + 1)
           and smallest >= 0.1 * base ** (power + 1)):
        power += 1
    return power


@as_table
def frame(rows: list[dict], index: str | None = None, *, bytes_columns=(), decimal=False) -> pd.DataFrame:
    """A DataFrame of rows (dicts), indexed by the column `index` if given; each of `bytes_columns` (counts of
    bytes) shown in one unit for the whole column (binary, or with decimal=True powers of 1000: kB, MB, GB),
    named in its header: "sent" -> "sent (MiB)"; a unit small enough that no non-zero count reads as zero."""
    df = pd.DataFrame(rows)
    base, units = (1000, DECIMAL_UNITS) if decimal else (1024, BINARY_UNITS)
    for column in bytes_columns:
        power = _byte_unit(df[column], base) if len(df) else 0
        df[column] = (df[column] / base**power).round(2) if power else df[column]
        if not (power == 0 and column.endswith("bytes")):  # a "bytes" column counted in bytes needs no unit
            df = df.rename(columns={column: f"{column} ({units[power]})"})
    return df.set_index(index) if index else df


# --- one table of a profiled run (chapters 03 and 10), and of several (chapter 09) ---------------------------
@as_table
def trace_breakdown(analysis) -> pd.DataFrame:
    """One row per rank of a profiled run: steps analysed, and the mean step, compute, communication, exposed
    communication and other time (ms), and the share of communication hidden behind compute (%, blank without
    communication). analysis: traces.analyze_run(...)."""
    rows = [{"rank": r["rank"], "steps": r["steps"], "step (ms)": r["step_ms"], "compute (ms)": r["compute_ms"],
             "comm (ms)": r["comm_ms"], "exposed comm (ms)": r["exposed_comm_ms"], "other (ms)": r["other_ms"],
             "hidden (%)": None if math.isnan(r["overlap"]) else 100 * r["overlap"]} for r in analysis.table()]
    if not rows:
        raise ValueError(f"{analysis.label()}: no rank analysed; {analysis.problems}")
    return pd.DataFrame(rows).set_index("rank").round(1)


@as_table
def trace_breakdowns(analyses: dict) -> pd.DataFrame:
    """trace_breakdown of several runs, one block of rows per run: {title: traces.analyze_run(...)}."""
    if not analyses:
        raise ValueError("no runs to show: pass {title: traces.analyze_run(...)}")
    return pd.concat({title: trace_breakdown(a) for title, a in analyses.items()}, names=["run"])


# --- dry runs (chapters 12 and 13) ----------------------------------------------------------------------
def group_text(group: list) -> str:
    """A process group's global ranks, the first two and the last when it has more than 4."""
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
    rows = [{"rank": r["rank"], "op": c["op"], "group size": c["group_size"], "group": group_text(c["group"] or []),
             "calls": c["calls"], "bytes": c["bytes"]} for r in report["ranks"] for c in r["comms"]]
    return frame(rows, "rank", bytes_columns=["bytes"])
