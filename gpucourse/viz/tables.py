"""The tables a chapter shows, as pandas DataFrames: rendered as real HTML tables in JupyterLab (nothing wraps
mid-word, no cell's text cut short), units in the column headers, built from a run's records.

    from gpucourse.viz import tables
    tables.bandwidth(rows)                     # chapter 01: time and busbw per op and size

Every table here is a `Table`: a DataFrame that holds the numbers (index it as any DataFrame) and is shown by one
formatting rule (`cell_texts`, every chapter): whole numbers with thousands separators, plain decimals (never 4.48e+02),
scientific notation only below 0.001 or from 10^15 on, a dash where there is no value, headers that do not break
inside their units.
"""
from __future__ import annotations

import inspect
import math
import numbers
import re

import numpy as np
import pandas as pd

from ..models import costs, training
from ..models.units import human_bytes
from ..run.contract import attempts as attempts_of
from ..run.procs import last_words

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


# --- chapter 02: data parallelism ---------------------------------------------------------------------
def _kib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 1024, 1)


def equivalence(diffs: dict[str, list[float]]) -> pd.DataFrame:
    """One row per variant (mean, sum, batchnorm, ...), one column per step: the largest |parameter difference|
    between DDP and one process after that step. diffs: {variant: [after step 1, after step 2, ...]}."""
    if not diffs:
        raise ValueError("equivalence needs {variant: [max difference after each step]}")
    steps = max(len(v) for v in diffs.values())
    df = pd.DataFrame.from_dict({v: list(d) + [None] * (steps - len(d)) for v, d in diffs.items()}, orient="index",
                                columns=[f"step {s + 1}" for s in range(steps)])
    df.columns.name = "max |Δθ| after"
    return df.rename_axis("variant")


def sampler_shards(shards: dict, items: int) -> pd.DataFrame:
    """One row per (mode, epoch) of the sampler demo: the indices each rank read, the indices read twice (the
    padding) and those no rank read (drop_last). shards: {(mode, epoch): {rank: [indices]}}; items: dataset size."""
    rows = []
    for (mode, epoch), by_rank in shards.items():
        every = [i for idx in by_rank.values() for i in idx]
        rows.append({"mode": mode, "epoch": epoch, **{f"rank {r}": idx for r, idx in by_rank.items()},
                     "read twice": sorted({i for i in every if every.count(i) > 1}),
                     "read by none": sorted(set(range(items)) - set(every))})
    return pd.DataFrame(rows).set_index(["mode", "epoch"])


def accumulation(records: list[dict], comm: dict[str, list[tuple]]) -> pd.DataFrame:
    """One row per accumulation mode (big, every, no_sync): all-reduce calls and KiB of the last profiled step,
    the largest parameter difference from one big batch over the run, and every profiled step's (calls, bytes).
    records: rank 0's records ({"mode", "max_diff"}); comm: {mode: traces.all_reduces_per_step(...)}."""
    worst: dict[str, float] = {}
    for rec in records:
        if "mode" in rec:
            worst[rec["mode"]] = max(worst.get(rec["mode"], 0.0), rec["max_diff"])
    rows = [{"mode": mode, "all_reduces / step": steps[-1][0], "KiB / step": _kib(steps[-1][1]),
             "max |Δθ| vs big": worst[mode], "profiled steps (calls, bytes)": steps} for mode, steps in comm.items()]
    return pd.DataFrame(rows).set_index("mode")


def precision(records: list[dict], comm: dict[str, tuple]) -> pd.DataFrame:
    """One row per precision mode (fp32, autocast, fp16_hook, ...): dtypes of the output, parameters and
    gradients, whether a GradScaler ran, all-reduce calls and KiB of the last profiled step, and the largest
    parameter difference from fp32 over the run; a mode that could not run here has only its "not run" reason.
    records: rank 0's records; comm: {mode: (calls, bytes)} of the last profiled step, for the modes that ran."""
    merged: dict[str, dict] = {}
    for rec in records:
        if "mode" in rec:
            seen = merged.get(rec["mode"], {})
            merged[rec["mode"]] = {**seen, **rec, "worst": max(seen.get("worst", 0.0), rec.get("max_diff", 0.0))}
    rows = []
    for mode, rec in merged.items():
        if "error" in rec:
            rows.append({"mode": mode, "not run": rec["error"]})
            continue
        calls, nbytes = comm[mode]
        rows.append({"mode": mode, "output": rec["output_dtype"], "params": rec["param_dtype"],
                     "grads": rec["grad_dtype"], "GradScaler": bool(rec["scaler"]), "all_reduces / step": calls,
                     "KiB / step": _kib(nbytes), "max |Δθ| vs fp32": rec["worst"], "not run": ""})
    df = pd.DataFrame(rows).set_index("mode")
    if "all_reduces / step" in df:  # whole numbers, blank where a mode did not run
        df["all_reduces / step"] = df["all_reduces / step"].astype("Int64")
    return df


def ddp_compare(rows: list[dict]) -> pd.DataFrame:
    """One row per implementation (torch DDP, your DDP, your BucketedDDP): the last step's loss, the median step
    time over every step but the first (ms), the largest |parameter difference| from torch's DDP over the run
    (loss to 4 decimals, ms to 2).
    rows: rank 0's records of 02_ddp_compare.py ({"loss", "seconds", "max_diff"}: dicts by implementation)."""
    if len(rows) < 2:
        raise ValueError("ddp_compare needs the records of at least two steps (the first is not timed)")
    timed = rows[1:]
    out = [{"implementation": name, "final loss": rows[-1]["loss"][name],
            "median step (ms)": sorted(r["seconds"][name] for r in timed)[len(timed) // 2] * 1e3,
            "max |Δθ| vs torch DDP": max(r["max_diff"].get(name, 0.0) for r in rows)} for name in rows[0]["loss"]]
    return pd.DataFrame(out).set_index("implementation").round({"final loss": 4, "median step (ms)": 2})


# --- chapters 08 and 08b: multi-node, faults and hangs ------------------------------------------
def whoami(metrics: dict) -> pd.DataFrame:
    """One row per rank: the ids torchrun gave it (GROUP_RANK is its node, LOCAL_RANK its place on the node),
    its agent's pid and the rendezvous address. metrics: {rank: records}, each rank's first record holding them."""
    rows = [{"RANK": me["RANK"], "GROUP_RANK": me["GROUP_RANK"], "LOCAL_RANK": me["LOCAL_RANK"],
             "WORLD_SIZE": me["WORLD_SIZE"], "agent pid": me["agent_pid"],
             "rendezvous": f"{me['MASTER_ADDR']}:{me['MASTER_PORT']}"}
            for me in (metrics[r][0] for r in sorted(metrics))]
    return pd.DataFrame(rows).set_index("RANK")


def process_outcomes(outcome: dict[str, list[tuple[int, str]]]) -> pd.DataFrame:
    """One row per process started by hand, by case: its exit code and the line to read first (its last
    exception line, procs.last_words). outcome: {case: [(exit code, output), ...]}."""
    rows = [{"case": case, "process": i, "exit code": code, "last words": last_words(text)}
            for case, procs in outcome.items() for i, (code, text) in enumerate(procs)]
    return pd.DataFrame(rows).set_index(["case", "process"])


def placement(times: dict[str, tuple[float, float]]) -> pd.DataFrame:
    """One row per communication of a layout: its modelled time inside a node and across nodes (ms), and how
    many times slower across is. times: {what: (seconds inside, seconds across)}."""
    rows = [{"communication": name, "inside a node (ms)": round(inside * 1e3, 1),
             "across nodes (ms)": round(across * 1e3, 1), "across / inside (×)": round(across / inside)}
            for name, (inside, across) in times.items()]
    return pd.DataFrame(rows).set_index("communication")


def attempt_logs(result, ranks: int) -> pd.DataFrame:
    """One row per (attempt, rank) of a run torchrun restarted: what the rank printed, lines joined by " | ".
    result: a RunResult (the attempts that left a log folder in its run folder, and .log(rank, attempt=K))."""
    rows = [{"attempt": k, "rank": r, "printed": " | ".join(result.log(r, attempt=k).strip().splitlines())}
            for k in attempts_of(result.run_dir) for r in range(ranks)]
    return pd.DataFrame(rows).set_index(["attempt", "rank"])


def diagnoses(runs: dict) -> pd.DataFrame:
    """One row per broken run: how it ended and what its ranks' Flight Recorder dumps point to (run/forensics.py):
    the fault's kind, the rank(s) to blame, the collective (op and sequence number) and its process group (its
    description and global ranks, as "mesh_tp [0, 1]"). runs: {name: RunResult}."""
    rows = []
    for name, result in runs.items():
        found = result.diagnosis()
        rows.append({"run": name, "ranks": result.world_size, "ended": result.status,
                     "kind": found.kind if found else None, "blamed rank(s)": found.ranks if found else None,
                     "collective": f"{found.op} #{found.seq_id}" if found and found.op else None,
                     "group": f"{found.group} {found.group_ranks}" if found and found.group else None})
    return pd.DataFrame(rows).set_index("run")


# --- chapter 04: large batches ----------------------------------------------------------------------
def large_batch_runs(runs: dict, *, names: dict, early: float) -> pd.DataFrame:
    """One row per (world size, rule): global batch, learning rate (after warmup), optimizer steps, the first
    step's loss and the largest step loss of epoch 1, test accuracy at epoch `early` and at the end, the final
    test loss and the run's seconds. runs: {world size: training.curves(...)}; names: {rule: its name}; a
    1-rank run is the baseline (all rules are one there)."""
    rows = []
    for n, by_rule in runs.items():
        for rule, run in by_rule.items():
            h, pts = run["header"], run["points"]
            rows.append({"ranks": n, "rule": "baseline (all rules are one)" if n == 1 else names[rule],
                         "global batch": h["global_batch"],
                         "lr (after warmup)": h["target_lr"] if rule != "keep" else h["base_lr"],
                         "steps": pts[-1]["opt_step"], "loss: step 1": training.first_loss(pts),
                         "max, epoch 1": training.early_max_loss(pts),
                         f"test acc @ epoch {early:.2g}": training.at_epoch(pts, early)["test_acc"],
                         "final test acc": pts[-1]["test_acc"], "final test loss": pts[-1]["test_loss"],
                         "time (s)": pts[-1]["seconds"]})
    return pd.DataFrame(rows).set_index(["ranks", "rule"]).round(
        {"loss: step 1": 2, "max, epoch 1": 2, f"test acc @ epoch {early:.2g}": 3, "final test acc": 3,
         "final test loss": 3, "time (s)": 1})


def large_batch_vs_baseline(runs: dict, baseline: dict, *, names: dict, early: float) -> pd.DataFrame:
    """One row per (world size > 1, rule): test accuracy at epoch `early` and at the end, each with its
    difference from the 1-rank baseline, the first step's loss, the largest step loss of epoch 1, and whether
    the run diverged (final test loss not finite, or accuracy under 0.15: chance is 0.1). runs: {world size:
    training.curves(...)}; baseline: the 1-rank run's curve; names: {rule: its name}."""
    base = baseline["points"]
    early_base, final_base = training.at_epoch(base, early)["test_acc"], base[-1]["test_acc"]
    rows = []
    for n, by_rule in runs.items():
        for rule in (names if n > 1 else ()):
            pts = by_rule[rule]["points"]
            acc_early, acc_final = training.at_epoch(pts, early)["test_acc"], pts[-1]["test_acc"]
            rows.append({"ranks": n, "rule": names[rule], f"test acc @ epoch {early:.2g}": acc_early,
                         "Δ vs 1 rank (early)": acc_early - early_base, "final test acc": acc_final,
                         "Δ vs 1 rank (final)": acc_final - final_base, "loss: step 1": training.first_loss(pts),
                         "max, epoch 1": training.early_max_loss(pts),
                         "diverged": not math.isfinite(pts[-1]["test_loss"]) or acc_final < 0.15})
    return pd.DataFrame(rows).set_index(["ranks", "rule"]).round(3)


def sgd_assumptions(measured: dict) -> pd.DataFrame:
    """One row per state of the weights: ‖G‖², B × mean ‖g_B − G‖² per batch size B (constant in B where the
    noise goes as 1/B), the noise scale tr(Σ)/‖G‖² (samples), each to three significant digits, and how far k
    small steps end from one k× step (% of that step, whole). measured: training.sgd_assumptions(...)."""
    def g3(v):  # three significant digits: the quantities span orders of magnitude
        return float(f"{v:.3g}")

    rows = []
    for where, m in measured.items():
        rows.append({"weights": where, "‖G‖²": g3(m["g2"]),
                     **{f"B×noise, B={b}": g3(v) for b, v in m["b_noise"].items()},
                     "noise scale (samples)": g3(m["noise_scale"]),
                     **{f"k={k}: k steps vs one (%)": round(100 * r) for k, r in m["ks"].items()}})
    return pd.DataFrame(rows).set_index("weights")


# --- chapter 06: tensor parallelism -----------------------------------------------------------------
def tp_check(metrics: dict, case: str, *, tol: float, skip: tuple = ()) -> pd.DataFrame:
    """One row per world size: the largest |parallel − dense| of each checked quantity over every rank, the
    verdict (every one within `tol`, except those named in `skip`) and rank 0's collectives (phase, op, size).
    A column per quantity, as the run named it. metrics: {world size: {rank: records}}, the records with
    "case" == case holding "diffs", "calls" and, for a single layer, "shapes"."""
    rows = []
    for n, by_rank in metrics.items():
        per_rank = [next(r for r in recs if r.get("case") == case) for recs in by_rank.values()]
        rank0 = next(r for r in by_rank[min(by_rank)] if r.get("case") == case)
        worst = {k: max(rec["diffs"][k] for rec in per_rank) for k in per_rank[0]["diffs"]}
        bad = [k for k, v in worst.items() if k not in skip and not v <= tol]
        rows.append({"ranks": n, **({"shapes": rank0["shapes"]} if "shapes" in rank0 else {}), **worst,
                     "verdict": f"all within {tol:g} of dense" if not bad else f"DIFFERENT from dense: {', '.join(bad)}",
                     "collectives (rank 0)": "; ".join(f"{c['phase']}: {c['op']} {human_bytes(c['bytes'])}"
                                                       for c in rank0["calls"]) or "none"})
    return pd.DataFrame(rows).set_index("ranks")


def tp_block_traffic(records: dict, *, batch: int, seq: int, hidden: int, bytes_per_value: int = 4) -> pd.DataFrame:
    """One row per (world size, block): all-reduces in forward and in backward, their sizes (bytes) against
    the formula b·s·h·bytes, what each rank sends per all-reduce (ring), and whether the run matches Megatron's
    one all-reduce each way (none on 1 rank, no other collective). records: {world size: {case: rank 0's
    record}} for the cases "mlp" and "attention", each with its "calls" ({"phase", "op", "bytes"})."""
    formula = batch * seq * hidden * bytes_per_value
    rows = []
    for n, by_case in records.items():
        for case in ("mlp", "attention"):
            calls = by_case[case]["calls"]
            fwd = [c for c in calls if c["phase"] == "forward" and c["op"] == "all_reduce"]
            bwd = [c for c in calls if c["phase"] == "backward" and c["op"] == "all_reduce"]
            others = [c for c in calls if c["op"] != "all_reduce"]
            sizes = sorted({c["bytes"] for c in fwd + bwd})
            one_each = len(fwd) == len(bwd) == 1 and sizes == [formula]
            rows.append({"ranks": n, "block": case, "forward all-reduces": len(fwd),
                         "backward all-reduces": len(bwd), "bytes each (run)": ", ".join(map(str, sizes)),
                         "b·s·h·4 (bytes, formula)": formula,
                         "sent per rank per all-reduce": human_bytes(costs.bytes_moved_per_rank("all_reduce", formula, n)),
                         "Megatron's count": "matches" if not others and (one_each or n == 1 and not fwd + bwd)
                         else "DIFFERS"})
    return pd.DataFrame(rows).set_index(["ranks", "block"])


def comm_counts(recs: dict) -> pd.DataFrame:
    """One row per implementation: its largest differences from dense (a column per quantity) and the
    collectives CommDebugMode counted in forward and in backward. recs: {name: {"diffs", "comms"}}, comms as
    {phase: {op: count}}."""
    rows = [{"implementation": name, **rec["diffs"],
             **{f"{phase} collectives": ", ".join(f"{op} ×{k}" for op, k in rec["comms"].get(phase, {}).items())
                or "none" for phase in ("forward", "backward")}} for name, rec in recs.items()]
    return pd.DataFrame(rows).set_index("implementation")


def tp_cost(model: dict) -> pd.DataFrame:
    """One row per (tensor-parallel degree, link): the modelled compute per rank of one layer (ms), the link's
    nominal bandwidth (GB/s per GPU, per direction), the time of the layer's 4 all-reduces (ms) and their ratio
    to the compute. model: {(degree, link name in costs.INTERCONNECTS): (compute seconds, communication seconds)}."""
    rows = [{"TP": tp, "link": link, "compute (ms)": compute * 1e3,
             "link (GB/s, nominal)": costs.INTERCONNECTS[link].bandwidth_bytes_per_s / 1e9,
             "4 all-reduces (ms)": comm * 1e3, "comm / compute": comm / compute}
            for (tp, link), (compute, comm) in model.items()]
    return pd.DataFrame(rows).set_index(["TP", "link"]).round(
        {"compute (ms)": 3, "link (GB/s, nominal)": 0, "4 all-reduces (ms)": 3, "comm / compute": 2})


# --- chapter 07b: precision and recomputation ---------------------------------------------------------
STATE_PARTS = ("parameters", "gradients", "master weights", "optimizer states")


def recipe_bytes(optimizer: str = "adamw") -> pd.DataFrame:
    """Bytes per parameter of each model state under each precision recipe (costs.recipe_bytes_per_param); the
    recipes a CPU run cannot hold (fp8) marked modelled."""
    rows = [{"recipe": r, **{f"{k} (bytes/param)": v for k, v in costs.recipe_bytes_per_param(r, optimizer).items()},
             "source": "measured below" if r in costs.MEASURED_RECIPES else "MODELLED"} for r in costs.RECIPES]
    return pd.DataFrame(rows).set_index("recipe")


def recipe_states(recipes: dict, optimizer: str = "adamw") -> pd.DataFrame:
    """Each recipe's model states counted after a real step, per parameter, beside the formula. recipes:
    {name: the run's record: "num_params", "num_tensors", "dtype", "state_dtype", "parameters", "gradients",
    "master_weights", "optimizer_states", "step_counters", "weight_copies", "cuda_peak", "cuda_held"}.
    "= formula": every part equal to costs.recipe_bytes_per_param; step counters (4 bytes per tensor) apart."""
    rows = []
    for name, rec in recipes.items():
        numel, formula = rec["num_params"], costs.recipe_bytes_per_param(name, optimizer)
        measured = {part: rec[part.replace(" ", "_")] / numel for part in STATE_PARTS}
        row = {"recipe": name, "dtype": rec["dtype"], "states dtype": rec["state_dtype"],
               **{f"{part} (bytes/param)": v for part, v in measured.items()},
               "= formula": all(measured[p] == formula[p] for p in STATE_PARTS),
               "step counters (bytes)": rec["step_counters"],
               "= 4 B per tensor": rec["step_counters"] == 4 * rec["num_tensors"],
               "16-bit weight copies kept (bytes/param)": round(rec.get("weight_copies", 0) / numel, 2)}
        if rec.get("cuda_peak") is not None:
            row |= {"CUDA peak (bytes/param)": round(rec["cuda_peak"] / numel, 2),
                    "CUDA held after the step (bytes/param)": round(rec["cuda_held"] / numel, 2)}
        rows.append(row)
    return pd.DataFrame(rows).set_index("recipe")


def loss_scale_steps(steps: list[dict]) -> pd.DataFrame:
    """GradScaler step by step: the scale used, whether a gradient overflowed, whether the step changed the
    parameters, the scale after update(), the loss. steps: the run's records {"scaler_step", "scale", "overflow",
    "params_changed", "new_scale", "loss"} (not "step": that key drives the launcher's progress bar)."""
    rows = [{"step": r["scaler_step"], "scale": f"2^{math.log2(r['scale']):g}", "overflow": r["overflow"],
             "step taken": r["params_changed"], "new scale": f"2^{math.log2(r['new_scale']):g}",
             "loss": round(r["loss"], 4)} for r in steps]
    return pd.DataFrame(rows).set_index("step")


def loss_scale_faults(steps: list[dict]) -> list[str]:
    """What GradScaler got wrong in these steps, as sentences (empty: it skipped exactly the overflowing steps,
    halving the scale each time, and kept or doubled it otherwise)."""
    faults = []
    for r in steps:
        if r["params_changed"] == r["overflow"]:
            faults.append(f"step {r['scaler_step']}: overflow {r['overflow']} but parameters changed "
                          f"{r['params_changed']}")
        ok = (r["new_scale"] == r["scale"] / 2 if r["overflow"] else r["new_scale"] in (r["scale"], 2 * r["scale"]))
        if not ok:
            faults.append(f"step {r['scaler_step']}: scale {r['scale']} -> {r['new_scale']} after overflow "
                          f"{r['overflow']}")
    return faults


def underflow(records: list[dict]) -> pd.DataFrame:
    """Gradient elements non-zero in fp32 that fp16 autocast made zero, per residual, without and with a
    GradScaler. records: {"residual", "median_abs_grad", "nonzero_fp32", "zero_fp16", "zero_fp16_scaler"}."""
    rows = [{"residual": f"{r['residual']:.0e}", "median |grad| in fp32": f"{r['median_abs_grad']:.1e}",
             "lost in fp16, no scaler": r["zero_fp16"],
             "lost, no scaler (%)": round(100 * r["zero_fp16"] / r["nonzero_fp32"], 1),
             "lost in fp16 + GradScaler": r["zero_fp16_scaler"],
             "lost, GradScaler (%)": round(100 * r["zero_fp16_scaler"] / r["nonzero_fp32"], 1)} for r in records]
    return pd.DataFrame(rows).set_index("residual")


def float_formats(dtypes) -> pd.DataFrame:
    """Range and precision of floating-point dtypes (torch.finfo): largest value, smallest normal, relative step."""
    import torch

    rows = [{"dtype": str(dt).replace("torch.", ""), "max": torch.finfo(dt).max,
             "smallest normal": torch.finfo(dt).smallest_normal, "relative step (eps)": torch.finfo(dt).eps}
            for dt in dtypes]
    return pd.DataFrame(rows).set_index("dtype")


def cast_errors(reference, casts: dict, *, skip_first: bool = False) -> pd.DataFrame:
    """What casting lost, per cast: elements that became zero and the relative error (L2) against `reference`.
    casts: {name: the values after the cast (same shape)}; skip_first: leave element 0 out (an outlier placed
    there on purpose), counting the others only."""
    start = 1 if skip_first else 0
    ref = reference.flatten()[start:]
    rows = []
    for name, approx in casts.items():
        got = approx.flatten()[start:]
        rows.append({"cast": name, "became zero": int((got == 0).sum()), "of": ref.numel(),
                     "relative error": round(((got - ref).norm() / ref.norm()).item(), 3)})
    return pd.DataFrame(rows).set_index("cast")


def activations_kept(kept: dict, fused: dict, expected: dict, modes=("none", "selective", "full")) -> pd.DataFrame:
    """Bytes one layer keeps for backward, per sequence length and recomputation mode, counted; "= formula" says
    whether every mode's count equals `expected` ({(seq, mode): bytes}). kept: {(seq, mode): bytes};
    fused: {seq: bytes with a fused attention kernel}."""
    seqs = sorted({s for s, _ in kept})
    rows = [{"s": s, **{f"{m} (bytes)": kept[s, m] for m in modes}, "fused attention (bytes)": fused.get(s),
             "= formula": all(kept[s, m] == expected[s, m] for m in modes)} for s in seqs]
    return pd.DataFrame(rows).set_index("s")


def recomputation(kept: dict, flops: dict, expected_flops: dict, times: dict,
                  modes=("none", "selective", "full")) -> pd.DataFrame:
    """Each mode's trade at each sequence length, relative to no recomputation (modes[0]): bytes kept, FLOPs run
    (and whether they equal `expected_flops`), step time (the median of `times`, with their min and max). A mode in
    `times` but not in `kept` (a control) gets its time only. All dicts keyed (seq, mode); times in seconds."""
    import statistics

    base = modes[0]
    rows = []
    order = list(dict.fromkeys([*modes, *(m for _, m in times)]))  # the modes, then the controls
    for (s, m), t in sorted(times.items(), key=lambda item: (item[0][0], order.index(item[0][1]))):
        measured = (s, m) in kept
        median = statistics.median(t)
        rows.append({"s": s, "mode": m,
                     "kept (× none)": round(kept[s, m] / kept[s, base], 3) if measured else None,
                     "FLOPs run (× none)": round(flops[s, m] / flops[s, base], 2) if measured else None,
                     "FLOPs = formula": flops[s, m] == expected_flops[s, m] if measured else None,
                     "median step (ms)": round(1e3 * median, 1), "min (ms)": round(1e3 * min(t), 1),
                     "max (ms)": round(1e3 * max(t), 1),
                     "time (× none)": round(median / statistics.median(times[s, base]), 2)})
    return pd.DataFrame(rows).set_index(["s", "mode"])


def low_precision_speedup(device: str, shares, fast: str = "fp8", base: str = "bf16") -> pd.DataFrame:
    """MODELLED: the most a step can gain when its matrix products run at `fast`'s datasheet peak instead of
    `base`'s (costs.low_precision_speedup, Amdahl: everything else unchanged), for each share of the step's time
    that the matrix products take."""
    rows = [{"matrix products (% of a step)": round(100 * f), f"at most × faster in {fast}":
             round(costs.low_precision_speedup(f, device, dtype=fast, baseline=base), 2)} for f in shares]
    return pd.DataFrame(rows).set_index("matrix products (% of a step)")


# --- chapter 07: ZeRO and FSDP ------------------------------------------------------------------------
def _gb(num_bytes) -> float:
    return round(num_bytes / 1e9, 1)  # decimal GB, as the ZeRO paper counts


def zero_stages(num_params, world_size, **kwargs) -> pd.DataFrame:
    """MODELLED: each ZeRO stage's model states per device (memory.model_states) and its communication per rank
    and step (costs.zero_comm_volume), in decimal GB. kwargs: model_states' optimizer, precision, offload."""
    from ..models.memory import model_states

    rows = []
    for stage in range(4):
        row = model_states(num_params, world_size, stage, **kwargs)
        rows.append({"stage": stage, "parameters (GB)": _gb(row["parameters"]), "gradients (GB)": _gb(row["gradients"]),
                     "optimizer states (GB)": _gb(row["optimizer states"]), "per device (GB)": _gb(row["total"]),
                     "communication per step (GB)": _gb(costs.zero_comm_volume(num_params, stage))})
    return pd.DataFrame(rows).set_index("stage")


def model_sizes(sizes, device_bytes, *, node=8) -> pd.DataFrame:
    """MODELLED: for each model size (parameters), mixed-precision Adam's model states per device under DDP and on
    one `node`-device node under ZeRO-1 and ZeRO-3, and the fewest devices (a power of 2) whose states fit in
    device_bytes under each ("never": ZeRO-1's replicated 4 bytes per parameter alone do not fit)."""
    from ..models.memory import model_states
    from ..models.sharding import fewest_devices

    rows = []
    for psi in sizes:
        ddp = model_states(psi, 1, 0)["total"]
        rows.append({"model": f"{psi / 1e9:g}B", "DDP per device (GB)": _gb(ddp), "fits under DDP": ddp <= device_bytes,
                     f"ZeRO-1 on {node} (GB)": _gb(model_states(psi, node, 1)["total"]),
                     f"ZeRO-3 on {node} (GB)": _gb(model_states(psi, node, 3)["total"]),
                     "fewest devices, ZeRO-1": fewest_devices(psi, 1, device_bytes) or "never",
                     "fewest devices, ZeRO-3": fewest_devices(psi, 3, device_bytes) or "never"})
    return pd.DataFrame(rows).set_index("model")


def memory_per_rank(rows: list) -> pd.DataFrame:
    """Chapter 07's measured bytes per rank (the largest over the ranks), MB, beside the formula's total, their
    ratio, and how far rank 0's final parameters ended from DDP's. rows: sharding.measured_states."""
    from ..models.sharding import STATE_KEYS

    out = []
    for row in rows:
        out.append({"N": row["N"], "mode": row["mode"],
                    **{f"{part} (MB)": round(row["measured"][k] / 1e6, 3) for k, part in STATE_KEYS.items()},
                    "total (MB)": round(row["total"] / 1e6, 3), "formula (MB)": round(row["model"]["total"] / 1e6, 3),
                    "measured / formula": round(row["total"] / row["model"]["total"], 6),
                    "|θ − θ_DDP|": row["diff"]})
    return pd.DataFrame(out).set_index(["N", "mode"])


def share_of_ddp(rows: list) -> pd.DataFrame:
    """Each mode's bytes of each part as a share of DDP's at the same world size, beside 1/N."""
    from ..models.sharding import STATE_KEYS, share_of_ddp as shares

    out = [{"N": n, "mode": mode, **{part: round(s[k], 3) for k, part in STATE_KEYS.items()}, "1/N": round(1 / n, 3)}
           for (n, mode), s in shares(rows).items()]
    return pd.DataFrame(out).set_index(["N", "mode"])


def prefetch(analyses: dict, records: dict) -> pd.DataFrame:
    """FSDP2's variants from their traces, per step over every rank's profiled steps: all-gathers counted (how
    many, MB each, how many issued asynchronously), all-gather time and its exposed part (mean, min, max, ms), the
    share hidden under compute, the step time. analyses: {variant: traces.analyze_run}; records: {variant: rank
    0's record}."""
    import statistics

    from ..models.sharding import all_gather_ms

    rows = []
    for v, analysis in analyses.items():
        rec, ag = records[v], all_gather_ms(analysis)
        total, exposed = [t for t, _ in ag], [e for _, e in ag]
        rows.append({"variant": v, "all-gathers": rec["all_gathers"],
                     "MB each": round(rec["all_gather_bytes"][0] / 1e6, 2),
                     "async": rec["async_all_gathers"], "all-gather (ms)": round(statistics.mean(total), 1),
                     "min (ms)": round(min(total), 1), "max (ms)": round(max(total), 1),
                     "exposed (ms)": round(statistics.mean(exposed), 1),
                     "hidden (%)": round(100 * (1 - sum(exposed) / sum(total)), 0) if sum(total) else math.nan,
                     "step (ms)": round(statistics.mean(s.duration_us / 1e3 for s in analysis.steps), 1)})
    return pd.DataFrame(rows).set_index("variant")


def unsharded(records: dict) -> pd.DataFrame:
    """Per FSDP2 wrapping (records: {name: rank 0's record}): all-gathers and reduce-scatters of a step, MB each,
    and the most parameter MB unsharded while a layer runs forward, against the model's."""
    rows = [{"wrapping": name, "all-gathers": rec["all_gathers"], "MB each": round(rec["all_gather_bytes"][0] / 1e6, 2),
             "reduce-scatters": rec["reduce_scatters"],
             "unsharded at most (MB)": round(rec["peak_unsharded_bytes"] / 1e6, 2),
             "model (MB)": round(rec["model_bytes"] / 1e6, 2)} for name, rec in records.items()]
    return pd.DataFrame(rows).set_index("wrapping")


def hsdp_states(rows: list) -> pd.DataFrame:
    """DDP, FSDP and HSDP bytes per rank (MB, largest over the ranks) beside the formula, "= formula" when every
    part is exact, and the largest loss and parameter differences from one process. rows: sharding.hsdp_states."""
    from ..models.sharding import STATE_KEYS

    out = []
    for row in rows:
        out.append({"variant": row["variant"], "mesh": row["mesh"],
                    **{f"{part} (MB)": round(row["measured"][k] / 1e6, 3) for k, part in STATE_KEYS.items()},
                    "formula total (MB)": round(sum(row["model"].values()) / 1e6, 3),
                    "= formula": row["measured"] == row["model"],
                    "max |Δloss|": row["loss diff"], "max |Δθ|": row["param diff"]})
    return pd.DataFrame(out).set_index("variant")


def hsdp_comm(comm: dict) -> pd.DataFrame:
    """Rank 0's collectives of one step per variant and group (sharding.hsdp_comm): MB counted (handed to the
    collective), the formula's, and MB a bandwidth-optimal algorithm sends for it."""
    rows = [{"variant": v, "collective": op, "group": f["group"], "ranks": str(f["ranks_list"]),
             "counted (MB)": round(f["counted"] / 1e6, 3), "formula (MB)": round(f["calls_bytes"] / 1e6, 3),
             "sent per rank (MB)": round(f["sent"] / 1e6, 3)} for v, ops in comm.items() for op, f in ops.items()]
    return pd.DataFrame(rows).set_index(["variant", "collective"])


def accumulation_calls(records: dict, ops=("all_gather", "reduce_scatter")) -> pd.DataFrame:
    """Per gradient-accumulation variant (records: {variant: rank 0's record with "calls" [{"op", "bytes"}] and
    "max_param_diff"}): calls and MB of each collective in one step, and the distance from one process."""
    rows = []
    for variant, rec in records.items():
        row = {"variant": variant}
        for op in ops:
            sizes = [c["bytes"] for c in rec["calls"] if c["op"] == op]
            row |= {f"{op} calls": len(sizes), f"{op} (MB)": round(sum(sizes) / 1e6, 3)}
        rows.append(row | {"max |Δθ| vs one process": rec["max_param_diff"]})
    return pd.DataFrame(rows).set_index("variant")


# --- chapters 03, 09, 10 (profiling and scaling, the capstone, context parallelism) ------------------
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


def trace_breakdowns(analyses: dict) -> pd.DataFrame:
    """trace_breakdown of several runs, one block of rows per run: {title: traces.analyze_run(...)}."""
    if not analyses:
        raise ValueError("no runs to show: pass {title: traces.analyze_run(...)}")
    return pd.concat({title: trace_breakdown(a) for title, a in analyses.items()}, names=["run"])


def ddp_modes(res) -> pd.DataFrame:
    """Chapter 03's main run, one row per mode: its median step (ms, mean over ranks), the 10th and 90th
    percentile of all ranks' steps, and what communication adds to compute alone (ms and %)."""
    from ..models import ddpsteps

    alone = ddpsteps.step_ms(res, "no-ddp")
    rows = []
    for title, mode in (("compute alone (no-ddp)", "no-ddp"), ("DDP (overlap)", "ddp"),
                        ("DDP without overlap", "no-overlap")):
        ms, (lo, hi) = ddpsteps.step_ms(res, mode), ddpsteps.spread(res, mode)
        rows.append({"mode": title, "median step (ms)": ms, "p10 (ms)": lo, "p90 (ms)": hi,
                     "comm adds (ms)": ms - alone if mode != "no-ddp" else None,
                     "comm adds (%)": 100 * (ms - alone) / alone if mode != "no-ddp" else None})
    return pd.DataFrame(rows).set_index("mode").round(1)


def bucket_runs(variants: dict, analyses: dict) -> pd.DataFrame:
    """One row per bucket variant: DDP's buckets, the median step of its mode and the same launch's compute
    alone (no-ddp steps), then the trace's means per step, averaged over ranks: compute, all-reduce, exposed
    all-reduce (ms) and the share hidden (%). variants: {title: (run, trace name, mode)}; analyses: {title:
    traces.analyze_run(...)}."""
    from ..models import ddpsteps

    rows = []
    for title, (res, _, mode) in variants.items():
        trace = analyses[title].table()
        mean = {k: sum(r[k] for r in trace) / len(trace) for k in ("compute_ms", "comm_ms", "exposed_comm_ms")}
        rows.append({"run": title, "buckets": len(ddpsteps.info(res)["buckets"]),
                     "median step (ms)": ddpsteps.step_ms(res, mode),
                     "compute alone (ms)": ddpsteps.step_ms(res, "no-ddp"),
                     "traced compute (ms)": mean["compute_ms"], "all-reduce (ms)": mean["comm_ms"],
                     "exposed (ms)": mean["exposed_comm_ms"],
                     "hidden (%)": 100 * (1 - mean["exposed_comm_ms"] / mean["comm_ms"]) if mean["comm_ms"] else None})
    return pd.DataFrame(rows).set_index("run").round(1)


def scaling_runs(throughputs: dict[int, list[float]], efficiency: dict[int, float]) -> pd.DataFrame:
    """One row per world size: the samples/s of each launch, their mean, and the scaling efficiency (%).
    throughputs: {N: [samples/s per launch]}; efficiency: timeline.efficiencies(throughputs)."""
    rows = [{"ranks": n, "samples/s (each launch)": [round(v) for v in values],
             "mean (samples/s)": round(sum(values) / len(values)), "efficiency (%)": round(100 * efficiency[n])}
            for n, values in throughputs.items()]
    return pd.DataFrame(rows).set_index("ranks")


def allreduce_fit(measured: list[tuple[int, float]], fit) -> pd.DataFrame:
    """One row per all-reduce size: the measured time and the α–β fit's (ms). measured: [(bytes, seconds)]."""
    rows = [{"size": human_bytes(size), "measured (ms)": round(seconds * 1e3, 3),
             "α–β fit (ms)": round(fit.predict(size) * 1e3, 3)} for size, seconds in measured]
    return pd.DataFrame(rows).set_index("size")


def overlap_trials(trials: dict[str, float]) -> pd.DataFrame:
    """The overlap-cost benchmark: each trial's time (ms), and what side by side would take for free (the longer
    of compute and comm) and one after the other (their sum). trials: ddpsteps.trial_ms(...)."""
    shorter, longer = sorted([trials["compute"], trials["comm"]])
    rows = [*({"trial": t, "time (ms)": ms} for t, ms in trials.items()),
            {"trial": "free overlap would take", "time (ms)": longer},
            {"trial": "one after the other would take", "time (ms)": longer + shorter}]
    return pd.DataFrame(rows).set_index("trial").round(1)


def step_predictions(variants: dict, *, overlap_cost: float, fit, load: dict) -> pd.DataFrame:
    """One row per configuration: the modelled step from the run's own parts (ddpsteps.predict: buckets timed
    alone; with the α–β line; with free overlap) against the measured step, in ms, and each prediction's error
    (%, (predicted − measured) / measured), with the load average around the launch. Unrounded errors (fractions)
    in `.attrs["errors"]`: {"alone" | "line" | "free": {title: error}}. variants: {title: (run, trace name,
    mode)}; load: {run name: (before, after)}."""
    from ..models import ddpsteps

    rows, errors = [], {"alone": {}, "line": {}, "free": {}}
    for title, (res, _, mode) in variants.items():
        overlap = mode == "ddp"
        model = ddpsteps.predict(res, overlap=overlap, overlap_cost=overlap_cost)
        line = ddpsteps.predict(res, overlap=overlap, overlap_cost=overlap_cost, comm="line", fit=fit)
        free = ddpsteps.predict(res, overlap=overlap)
        measured = ddpsteps.step_ms(res, mode)
        for kind, m in (("alone", model), ("line", line), ("free", free)):
            errors[kind][title] = (m.step * 1e3 - measured) / measured
        before, after = load[res.name]
        rows.append({"run": title, "buckets": model.num_buckets, "compute (ms)": model.compute * 1e3,
                     "comm alone (ms)": model.comm * 1e3, "comm, line (ms)": line.comm * 1e3,
                     "hidden (ms)": model.hidden * 1e3, "predicted (ms)": model.step * 1e3,
                     "predicted, line (ms)": line.step * 1e3, "predicted, free overlap (ms)": free.step * 1e3,
                     "measured (ms)": measured, "error (%)": 100 * errors["alone"][title],
                     "error, line (%)": 100 * errors["line"][title], "error, free (%)": 100 * errors["free"][title],
                     "load before → after": f"{before:.1f} → {after:.1f}"})
    df = pd.DataFrame(rows).set_index("run").round(1)
    df.attrs["errors"] = errors
    return df


def prediction_misses(variants: dict, errors: dict[str, float], *, load: dict, cores: int, goal: float) -> pd.DataFrame:
    """One row per configuration: the highest load average around its launch, how much its compute alone varied
    (p10–p90 width over the median, %), the prediction's error (%), and what the run measured that explains a
    miss beyond `goal` (ddpsteps.why_missed; blank where it met the goal). errors: {title: fraction}."""
    from ..models import ddpsteps

    rows = []
    for title, (res, _, _) in variants.items():
        lo, hi = ddpsteps.spread(res, "no-ddp")
        noise, busy = (hi - lo) / ddpsteps.step_ms(res, "no-ddp"), max(load[res.name])
        rows.append({"run": title, "load (max)": round(busy, 1), "compute noise (%)": round(100 * noise),
                     "error (%)": round(100 * errors[title]),
                     "why it missed": ddpsteps.why_missed(errors[title], load=busy, cores=cores, noise=noise,
                                                          goal=goal)})
    return pd.DataFrame(rows).set_index("run")


def modelled_scaling(curves: dict[str, list[dict]], at=(8, 256, 4096)) -> pd.DataFrame:
    """One row per modelled curve (widgets.simulate rows): its efficiency at the world sizes `at` (%) and the
    world size from which it is communication-bound (widgets.turning_point; "—" if not within the curve)."""
    from .widgets import turning_point

    rows = []
    for title, points in curves.items():
        by_n = {p["world_size"]: p for p in points}
        missing = [n for n in at if n not in by_n]
        if missing:
            raise ValueError(f"{title}: no modelled point at N = {missing}")
        rows.append({"modelled": title, **{f"efficiency, N={n} (%)": round(100 * by_n[n]["efficiency"]) for n in at},
                     "comm-bound from N": turning_point(points) or f"— (not up to {max(by_n)})"})
    return pd.DataFrame(rows).set_index("modelled")


def compiled_ddp(cmp: dict, models=("eager", "compiled", "one-graph")) -> pd.DataFrame:
    """Chapter 03's compiled DDP, one row per model: graphs compiled (blank for eager), the first step (s,
    compilation included), the median step afterwards (ms) and the final loss. cmp: the script's "compare"
    record ({"graphs", "compile_s", "step_ms", "loss"}: dicts by model)."""
    rows = [{"model": m, "graphs": cmp["graphs"].get(m), "first step (s)": round(cmp["compile_s"][m], 1),
             "median step (ms)": round(cmp["step_ms"][m], 1), "loss": round(cmp["loss"][m], 6)} for m in models]
    df = pd.DataFrame(rows).set_index("model")
    df["graphs"] = df["graphs"].astype("Int64")
    return df


# --- chapter 05: pipeline parallelism ---------------------------------------------------------------
def _pct(x):
    return None if x is None else round(100 * x, 1)


def pipeline_orders(schedule, kinds, p: int, m: int) -> pd.DataFrame:
    """One row per (schedule, stage): its actions in order, e.g. "F0 F1 B0 B1". schedule(kind, stage, p, m):
    [(action, micro-batch)], as 05_pipeline.py's `schedule`."""
    rows = [{"schedule": kind, "stage": s, "actions, in order": " ".join(f"{a}{i}" for a, i in schedule(kind, s, p, m))}
            for kind in kinds for s in range(p)]
    return pd.DataFrame(rows).set_index(["schedule", "stage"])


def pipeline_bubbles(rows: list[dict]) -> pd.DataFrame:
    """One row per (p, schedule, m) of pipeline.bubble_rows: the bubble measured and by (p-1)/(m+p-1) (%),
    the step measured and the ideal step (ms)."""
    out = [{"p": r["p"], "schedule": r["kind"], "m": r["m"], "bubble measured (%)": _pct(r["measured"]),
            "(p-1)/(m+p-1) (%)": _pct(r["formula"]), "step (ms)": round(r["step_ms"]),
            "(m+p-1)·3·work (ms)": round(r["ideal_ms"])} for r in rows]
    return pd.DataFrame(out).set_index(["p", "schedule", "m"])


def pipeline_real_compute(timelines: dict, p: int) -> pd.DataFrame:
    """One row per m of a real-compute GPipe run ({m: timeline}): the bubble measured and by the formula (%),
    the step (ms) and each stage's forward + backward time per micro-batch (ms)."""
    from ..models import traces  # chapter 05 only

    rows = []
    for m, timeline in timelines.items():
        step, measured, _ = traces.idle(timeline)
        rows.append({"m": m, "bubble measured (%)": _pct(measured),
                     "(p-1)/(m+p-1) (%)": _pct(costs.pipeline_bubble_fraction(p, m)), "step (ms)": round(step, 1),
                     **{f"F+B per micro-batch, stage {s} (ms)": round(sum(e - b for _, b, e in spans) / m, 1)
                        for s, spans in timeline.items()}})
    return pd.DataFrame(rows).set_index("m")


def stage_activations(rows: list[dict]) -> pd.DataFrame:
    """One row per (p, schedule, m) of pipeline.stage_activation_rows: micro-batches held at the peak and their
    saved bytes (KiB) by stage, the rule's count, and whether every stage matched it."""
    out = [{"p": r["p"], "schedule": r["schedule"], "m": r["m"],
            "held at peak (micro-batches, by stage)": r["held"],
            "saved (KiB, by stage)": [round(b / 1024) for b in r["bytes"]], "rule": r["rule"],
            "matches the rule": "✓" if r["matches"] else "✗"} for r in rows]
    return pd.DataFrame(out).set_index(["p", "schedule", "m"])


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


def timeline_idle(idle: dict) -> pd.DataFrame:
    """One row per timeline of pipeline.timeline_idle ({title: (step ms, {rank: idle ms})}): the step and each
    rank's idle time (ms, 1 decimal)."""
    rows = [{"timeline": title, "step (ms)": round(step, 1), **{f"idle, rank {r} (ms)": round(ms, 1)
                                                                for r, ms in by_rank.items()}}
            for title, (step, by_rank) in idle.items()]
    return pd.DataFrame(rows).set_index("timeline")


def chunk_activations(rows: list[dict]) -> pd.DataFrame:
    """One row per (schedule, m, rank) of pipeline.chunk_activation_rows: chunks held at the peak and the
    formula's count ("—" where it has none), micro-batches (chunks / v), bytes (KiB) and whether both matched."""
    out = [{"schedule": r["schedule"], "m": r["m"], "rank": r["rank"], "chunks held": r["chunks"],
            "formula": "—" if r["formula"] is None else r["formula"], "micro-batches": r["micro-batches"],
            "held (KiB)": round(r["bytes"] / 1024), "matches": "✓" if r["matches"] else "✗"} for r in rows]
    return pd.DataFrame(out).set_index(["schedule", "m", "rank"])


def stage_costs(counted: list[dict], modelled: list[dict]) -> pd.DataFrame:
    """One row per stage: weights and training FLOPs per token counted (FlopCounterMode) beside
    costs.pipeline_stage_costs' (counted: [{"stage", "params", "flops_per_token"}], modelled: the same keys)."""
    if len(counted) != len(modelled):
        raise ValueError(f"{len(counted)} counted stages but {len(modelled)} modelled")
    rows = [{"stage": c["stage"], "weights counted": c["params"], "weights modelled": m["params"],
             "FLOPs/token counted": c["flops_per_token"], "FLOPs/token modelled": m["flops_per_token"]}
            for c, m in zip(counted, modelled)]
    return pd.DataFrame(rows).set_index("stage")


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


# --- chapter 11: expert parallelism -------------------------------------------------------------------
def moe_per_rank(records: dict, columns: dict | None = None, *, diffs: bool = True) -> pd.DataFrame:
    """One row per rank of an 11_moe.py run ({rank: its case record}): the record's values named in `columns`
    ({header: key}), then, with diffs, each quantity's |expert parallel − one process| (the record's "diffs"),
    one column each ("|Δ| output", "|Δ| tokens.grad", ...)."""
    if not records:
        raise ValueError("moe_per_rank needs {rank: record}")
    rows = [{"rank": rank, **{header: rec[key] for header, key in (columns or {}).items()},
             **({f"|Δ| {k}": v for k, v in rec["diffs"].items()} if diffs else {})}
            for rank, rec in sorted(records.items())]
    return pd.DataFrame(rows).set_index("rank")


# --- chapter 04: large batches (helper p05's part of issue 29) ------------------------------------------
def warmup_lrs(schedule, runs: dict) -> pd.DataFrame:
    """One row per world size: the global batch, the warmup steps, and the learning rate the schedule gives at
    step 0, at the end of warmup and as scaled_lr (5 significant digits). schedule: a module with warmup_lr and
    scaled_lr (exercise ex04); runs: {world size: (warmup_lr's keyword arguments, total steps)}."""
    rows = []
    for n, (kwargs, total) in runs.items():
        end = min(kwargs["warmup_steps"], total)
        rows.append({"ranks": n, "global batch": kwargs["global_batch"], "warmup steps": kwargs["warmup_steps"],
                     "lr at step 0": schedule.warmup_lr(0, **kwargs),
                     "lr at end of warmup": schedule.warmup_lr(end, **kwargs),
                     "scaled_lr": schedule.scaled_lr(kwargs["base_lr"], kwargs["base_batch"], kwargs["global_batch"])})
    df = pd.DataFrame(rows).set_index("ranks")
    return df.map(lambda v: float(f"{v:.5g}") if isinstance(v, float) else v)


def best_rules(runs: dict, *, names: dict, early: float) -> pd.DataFrame:
    """One row per world size > 1: the rule with the best test accuracy at epoch `early` and the one with the
    best at the end, each with that accuracy. runs: {world size: training.curves(...)}; names: {rule: its name}."""
    rows = []
    for n, by_rule in runs.items():
        if n == 1:
            continue
        acc_early = {rule: training.at_epoch(by_rule[rule]["points"], early)["test_acc"] for rule in names}
        acc_end = {rule: by_rule[rule]["points"][-1]["test_acc"] for rule in names}
        first, last = max(acc_early, key=acc_early.get), max(acc_end, key=acc_end.get)
        rows.append({"ranks": n, f"best at epoch {early:.2g}": names[first], "its test acc (early)": acc_early[first],
                     "best at the end": names[last], "its test acc (end)": acc_end[last]})
    return pd.DataFrame(rows).set_index("ranks").round(3)


def noise_spread(measured: dict) -> pd.DataFrame:
    """One row per state of the weights (training.sgd_assumptions): how far B × noise spans over the batch sizes
    (max / min, 1.00 where the noise goes exactly as 1/B) and the noise scale (samples, 3 significant digits)."""
    rows = [{"weights": where,
             "B × noise, max / min": round(max(m["b_noise"].values()) / min(m["b_noise"].values()), 2),
             "batch sizes B": f"{min(m['b_noise'])}..{max(m['b_noise'])}",
             "noise scale (samples)": float(f"{m['noise_scale']:.3g}")} for where, m in measured.items()]
    return pd.DataFrame(rows).set_index("weights")


# --- chapter 12: at scale, on your laptop (dry runs counted, plans modelled) ------------------------------------
def _group_text(group: list) -> str:
    return str(group) if len(group) <= 4 else f"[{group[0]}, {group[1]}, …, {group[-1]}]"


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


def dryrun_comms(report: dict) -> pd.DataFrame:
    """Every collective and point-to-point call each simulated rank made in its step, by process group (its size
    and global ranks, first and last shown): calls and bytes in nccl-tests' convention, counted."""
    rows = [{"rank": r["rank"], "op": c["op"], "group size": c["group_size"], "group": _group_text(c["group"] or []),
             "calls": c["calls"], "bytes": c["bytes"]} for r in report["ranks"] for c in r["comms"]]
    return frame(rows, "rank", bytes_columns=["bytes"])


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


def plan_memory(plan: dict) -> pd.DataFrame:
    """A plan (models.planner.plan_parallelism), MODELLED: one row per pipeline stage shown (first, last), its
    layers, parameters held, memory by part and in all, in GiB (a device's "80 GB" is 80 GiB)."""
    rows = [{"stage (modelled)": st["stage"], "layers": st["layers"],
             "params held (billions)": round(st["params"] / 1e9, 2),
             **{f"{k} (GiB)": round(v / 2**30, 1) for k, v in st["memory"].items()},
             "total (GiB)": round(st["total"] / 2**30, 1)} for st in plan["stages"]]
    return pd.DataFrame(rows).set_index("stage (modelled)")


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


def step_terms(plan: dict) -> pd.DataFrame:
    """What each term of a plan's step-time estimate (models.planner.plan_parallelism) costs: seconds a step and
    share of the step, largest first; terms that cost nothing are left out."""
    rows = [{"term (modelled)": k, "seconds a step": round(v, 3), "share (%)": round(100 * v / plan["step_s"], 1)}
            for k, v in sorted(plan["terms"].items(), key=lambda kv: -kv[1]) if v > 0]
    return pd.DataFrame(rows).set_index("term (modelled)")


# --- chapter 08: checkpoints that reshard ---------------------------------------------------------------
def _steps(records: list[dict]) -> dict[int, dict]:
    """{step: record} of a run's step records (those carrying a loss and the step's sample ids)."""
    return {r["step"]: r for r in records if "loss" in r and "ids" in r}


def samples_out_of_place(reference: list[dict], resumed: list[dict], save_at: int) -> tuple[int, int]:
    """(repeated, skipped): how many samples the run that saved after step `save_at` and then `resumed` trained on
    more often, and less often, than the uninterrupted `reference` did over the same steps (rank 0's records)."""
    from collections import Counter

    ref, res = _steps(reference), _steps(resumed)
    last = max(res, default=save_at)
    missing = [s for s in range(last + 1) if s not in ref]
    if missing:
        raise ValueError(f"the reference run has no record of step(s) {missing[:5]}: it must run past step {last}")
    before = Counter(i for s in range(save_at + 1) for i in ref[s]["ids"])
    after = Counter(i for s in range(save_at + 1, last + 1) if s in res for i in res[s]["ids"])
    expected = Counter(i for s in range(last + 1) for i in ref[s]["ids"])
    got = before + after
    return sum((got - expected).values()), sum((expected - got).values())


def reshard(reference: list[dict], resumed: dict[str, list[dict]], save_at: int) -> pd.DataFrame:
    """One row per resumed run (chapter 08): its layout and world size, the steps it ran after the checkpoint, the
    largest difference of its float64 loss from the uninterrupted run's at the same step, how many of its steps used
    exactly the uninterrupted run's sample ids, and the samples it repeated or skipped. reference: the uninterrupted
    run's records (rank 0), which saved after step `save_at`; resumed: {name: records (rank 0)}."""
    ref = _steps(reference)
    rows = []
    for name, records in resumed.items():
        steps = _steps(records)
        if not steps:
            raise ValueError(f"{name}: no step records (did the run fail?)")
        unmatched = [s for s in steps if s not in ref]
        if unmatched:
            raise ValueError(f"{name}: step(s) {unmatched[:5]} are not in the reference run")
        repeated, skipped = samples_out_of_place(reference, records, save_at)
        first = next(iter(steps.values()))
        rows.append({"resumed as": name, "layout": first.get("layout"), "world": first.get("world"),
                     "steps after the save": len(steps),
                     "max |loss − uninterrupted|": max(abs(r["loss"] - ref[s]["loss"]) for s, r in steps.items()),
                     "steps with the same sample ids": sum(r["ids"] == ref[s]["ids"] for s, r in steps.items()),
                     "samples repeated": repeated, "samples skipped": skipped})
    return pd.DataFrame(rows).set_index("resumed as")


# --- one formatting rule for every chapter: each function above that returns a DataFrame returns a Table -------------
def _as_table(build):
    def table(*args, **kwargs) -> Table:
        df = build(*args, **kwargs)
        out = Table(df)
        out.attrs = df.attrs  # what a table carries beside its cells (step_predictions' errors)
        return out

    table.__name__, table.__qualname__, table.__doc__, table.__wrapped__ = build.__name__, build.__qualname__, \
        build.__doc__, build
    table.__signature__ = inspect.signature(build)
    return table


for _name, _build in list(globals().items()):
    if inspect.isfunction(_build) and _build.__module__ == __name__ and \
            _build.__annotations__.get("return") == "pd.DataFrame":
        globals()[_name] = _as_table(_build)
