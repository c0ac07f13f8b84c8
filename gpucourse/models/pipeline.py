"""What chapter 05's pipeline runs say, read from their records and timelines.

A timeline is {rank: [(action, start ms, end ms)]} (traces.step_spans), an action named like "F3" or "1B3":
stage, kind (F forward, B full backward, I/W its input and weight halves), micro-batch.

    from gpucourse.models import pipeline
    rows = pipeline.bubble_rows({(p, kind, m): timeline, ...}, work_ms=20)   # measured bubble vs the formula
    pipeline.schedule_bubbles({(name, m): timeline, ...}, p=2, work_ms=20)  # PyTorch's schedules, replayed
"""
from __future__ import annotations

import re

from . import costs, traces

# The schedules whose bubble (p-1)/(v*m) describes, and those pipeline_peak_activations knows.
FORMULA_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
PEAK_RULE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "DualPipeV")
_ACTION = re.compile(r"(\d*)([FBIW])(\d*)")


def _check_timeline(timeline: dict) -> None:
    if not timeline or not all(timeline.values()):
        raise ValueError("a timeline needs {rank: [(action, start ms, end ms), ...]} with actions on every rank")


def stages_per_rank(timeline: dict) -> int:
    """v: the stages a rank ran (the most over the ranks), read from the actions' stage numbers."""
    _check_timeline(timeline)
    return max(len({_ACTION.fullmatch(a)[1] for a, _, _ in spans}) for spans in timeline.values())


def nominal_durations(work_ms: float, v: int = 1) -> dict[str, float]:
    """Each kind of action's nominal time (ms) when a rank's forward sleeps work_ms over its v stages: a chunk is
    1/v of it; a full backward twice a forward; its input and weight halves one forward each."""
    return {"F": work_ms / v, "B": 2 * work_ms / v, "I": work_ms / v, "W": work_ms / v}


def replay(timeline: dict, work_ms: float, *, measured: bool = False) -> dict:
    """The same order per rank through costs.simulate_pipeline: with nominal durations, or with each action's
    measured duration (measured=True: what the step would take with free messages)."""
    v = stages_per_rank(timeline)
    orders = {rank: [a for a, _, _ in spans] for rank, spans in timeline.items()}
    own = {a: end - start for spans in timeline.values() for a, start, end in spans} if measured else {}
    return costs.simulate_pipeline(orders, {**nominal_durations(work_ms, v), **own})


# --- sections 2-7: the hand-written GPipe and 1F1B ---------------------------------------------------------
def bubble_rows(timelines: dict, work_ms: float) -> list[dict]:
    """One row per (p, schedule, m): the measured bubble (mean idle share of the stages), the formula's
    (p-1)/(m+p-1), the step (ms) and the ideal step (m+p-1) slots of a forward and a backward (3 × work_ms).
    timelines: {(p, schedule, m): timeline}."""
    rows = []
    for (p, kind, m), timeline in timelines.items():
        _check_timeline(timeline)
        step, measured, _ = traces.idle(timeline)
        rows.append({"p": p, "kind": kind, "m": m, "measured": measured,
                     "formula": costs.pipeline_bubble_fraction(p, m), "step_ms": step,
                     "ideal_ms": (m + p - 1) * 3 * work_ms})
    return rows


def bubble_summary(rows: list[dict]) -> dict:
    """How the measured bubbles compare with the formula: configurations measured above it, the largest
    difference (fraction), the (p, schedule) series whose bubble fell at every larger m and those that did not,
    and the largest gap between GPipe and 1F1B at the same p and m (None when only one schedule ran)."""
    if not rows:
        raise ValueError("bubble_summary needs bubble_rows' rows")
    by = {(r["p"], r["kind"], r["m"]): r["measured"] for r in rows}
    series = list(dict.fromkeys((r["p"], r["kind"]) for r in rows))
    ms = {s: sorted(m for p, k, m in by if (p, k) == s) for s in series}
    falling = [s for s in series if all(by[(*s, a)] > by[(*s, b)] for a, b in zip(ms[s], ms[s][1:]))]
    pairs = [(p, m) for p, k, m in by if k == "gpipe" and (p, "1f1b", m) in by]
    return {"above": sum(r["measured"] > r["formula"] for r in rows), "configurations": len(rows),
            "largest_difference": max(abs(r["measured"] - r["formula"]) for r in rows),
            "series": series, "falling": falling, "not_falling": [s for s in series if s not in falling],
            "one_m": all(len(v) < 2 for v in ms.values()),
            "gpipe_1f1b_gap": max((abs(by[p, "gpipe", m] - by[p, "1f1b", m]) for p, m in pairs), default=None)}


def stage_activation_rows(records: dict, micro: list[int]) -> list[dict]:
    """One row per (p, schedule, m): each stage's peak of micro-batches held and its bytes, the rule's count
    (GPipe m; 1F1B min(p - stage, m)) and whether every stage held exactly that many micro-batches' bytes.
    records: {p: every rank's 05_pipeline.py records with "schedule"}."""
    rows = []
    for p, recs in records.items():
        for kind in ("gpipe", "1f1b"):
            for m in micro:
                by_rank = sorted((r for r in recs if r["schedule"] == kind and r["m"] == m), key=lambda r: r["rank"])
                if not by_rank:
                    raise ValueError(f"no records of {kind} with m={m} on {p} stages")
                rule = [m if kind == "gpipe" else min(p - r["rank"], m) for r in by_rank]
                ok = all(r["peak_micro"] == want and r["peak_bytes"] == want * r["saved_bytes"][0]
                         for r, want in zip(by_rank, rule))
                rows.append({"p": p, "schedule": kind, "m": m, "held": [r["peak_micro"] for r in by_rank],
                             "bytes": [r["peak_bytes"] for r in by_rank], "rule": rule, "matches": ok})
    return rows


def gpipe_check_verdict(metrics: dict, impl: str) -> str:
    """One sentence on the exercise check's run: which of its pipelines ran and how close their gradients came
    to the unsplit model's, and what to do if the learner's gpipe_step is not written yet."""
    tried = [rec for recs in metrics.values() for rec in recs if "pipeline" in rec]
    ran = [rec for rec in tried if not rec["error"]]
    names = sorted({rec["pipeline"] for rec in ran})
    worst = max((rec["max_grad_diff"] for rec in ran), default=float("nan"))
    kinds = len({rec["pipeline"] for rec in tried})
    text = f"{len(names)} of {kinds} pipelines ran ({', '.join(names) or 'none'}): gradients " + (
        f"within {worst:.1e} of the unsplit model's on every stage, float32 rounding" if worst < 1e-5 else
        f"up to {worst:.1e} from the unsplit model's: more than rounding, look for a bug" if ran else "none")
    if len(ran) < len(tried):
        text += (f"\nyour gpipe_step in {impl} is not written yet: write it, rerun this cell, "
                 "then `gpucourse grade ex05`")
    return text


# --- sections 10-13: PyTorch's schedules ------------------------------------------------------------------
def schedule_records(metrics: dict) -> dict:
    """{(schedule, m): {rank: record}} from 05_schedules.py's records (those with "schedule")."""
    runs: dict = {}
    for rank, recs in metrics.items():
        for rec in recs:
            if "schedule" in rec:
                runs.setdefault((rec["schedule"], rec["m"]), {})[rank] = rec
    return runs


def schedule_bubbles(timelines: dict, *, p: int, work_ms: float) -> dict:
    """{(schedule, m): row} for each schedule that ran: v, step and mean busy time per rank (ms), idle share of
    the step and idle over work, measured; idle over work of the same order replayed with the measured durations
    ("free": free messages) and with the nominal ones ("nominal"); and, for the schedules (p-1)/(v*m) describes,
    the formula's share and ratio. timelines: {(schedule, m): the profiled step's compute spans}."""
    table = {}
    for (name, m), timeline in timelines.items():
        v = stages_per_rank(timeline)
        step, share, ratio = traces.idle(timeline)
        busy = sum(end - start for spans in timeline.values() for _, start, end in spans) / len(timeline)
        row = {"v": v, "step": step, "busy": busy, "share": share, "ratio": ratio,
               "free": traces.idle(replay(timeline, work_ms, measured=True))[2],
               "nominal": traces.idle(replay(timeline, work_ms))[2]}
        if name in FORMULA_SCHEDULES:
            row["f_share"] = costs.pipeline_bubble_fraction(p, m, v)
            row["f_ratio"] = costs.pipeline_bubble_ratio(p, m, v)
        table[(name, m)] = row
    return table


def schedule_bubble_checks(table: dict, p: int) -> dict:
    """What schedule_bubbles' table says against the formula, for GPipe, 1F1B and Interleaved1F1B with m >= p:
    "full" those runs, "exact" those whose own order replayed with nominal durations has exactly the formula's
    bubble, "required" those where it must (m a multiple of p: Megatron's condition for interleaving), and the
    range of measured idle/work minus the formula ("over") and minus the free-message replay ("lost")."""
    full = [k for k in table if k[0] in FORMULA_SCHEDULES and k[1] >= p]
    exact = [k for k in full if abs(table[k]["nominal"] - table[k]["f_ratio"]) < 1e-9]
    over = [table[k]["ratio"] - table[k]["f_ratio"] for k in full]
    lost = [table[k]["ratio"] - table[k]["free"] for k in full]
    return {"full": full, "exact": exact, "required": [k for k in full if k[1] % p == 0],
            "over": (min(over), max(over)) if full else None, "lost": (min(lost), max(lost)) if full else None}


def action_overheads(timelines: dict, work_ms: float) -> dict:
    """{schedule: {kind: (mean measured minus nominal ms, actions)}}: how much longer than its sleep each kind of
    action took. timelines: {schedule: the profiled step's compute spans}."""
    out = {}
    for name, timeline in timelines.items():
        nominal, extra = nominal_durations(work_ms, stages_per_rank(timeline)), {}
        for spans in timeline.values():
            for action, start, end in spans:
                kind = _ACTION.fullmatch(action)[2]
                extra.setdefault(kind, []).append(end - start - nominal[kind])
        out[name] = {k: (sum(x) / len(x), len(x)) for k, x in extra.items()}
    return out


def timeline_idle(timelines: dict) -> dict:
    """{title: (step ms, {rank: idle ms})} of each timeline; actions run as one block (same start and end) count
    once."""
    out = {}
    for title, timeline in timelines.items():
        _check_timeline(timeline)
        step = max(end for spans in timeline.values() for *_, end in spans)
        out[title] = (step, {r: step - sum(e - s for s, e in {(s, e) for _, s, e in spans})
                             for r, spans in timeline.items()})
    return out


def chunk_activation_rows(runs: dict, p: int) -> list[dict]:
    """One row per (schedule, m, rank) that ran: chunks held at the peak, pipeline_peak_activations' count
    (None where it has no rule), micro-batches (chunks / v), bytes, and whether both the count and the bytes
    (chunks × one chunk's) match. runs: schedule_records(...)."""
    rows = []
    for (name, m), by_rank in runs.items():
        if by_rank[min(by_rank)]["error"]:
            continue
        for rank, rec in sorted(by_rank.items()):
            v, chunks = len(rec["stages"]), rec["peak_chunks"]
            want = costs.pipeline_peak_activations(p, m, v, rank, name) if name in PEAK_RULE_SCHEDULES else None
            rows.append({"schedule": name, "m": m, "rank": rank, "chunks": chunks, "formula": want,
                         "micro-batches": chunks / v, "bytes": rec["peak_bytes"],
                         "matches": want in (None, chunks) and rec["peak_bytes"] == chunks * max(rec["chunk_bytes"])})
    return rows
