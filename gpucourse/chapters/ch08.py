"""Chapter 08, multi-node, faults and checkpoints that reshard: the tables it shows from its runs.

`notebooks/08_multinode_faults_hangs.ipynb` imports it by its short name:

    from gpucourse.chapters import ch08
    ch08.whoami(result.metrics)         # the ids torchrun gave each rank

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
"""
from __future__ import annotations

import pandas as pd

from ..run.contract import attempts as attempts_of
from ..run.procs import last_words
from ..viz.tables import as_table


@as_table
def whoami(metrics: dict) -> pd.DataFrame:
    """One row per rank: the ids torchrun gave it (GROUP_RANK is its node, LOCAL_RANK its place on the node),
    its agent's pid and the rendezvous address. metrics: {rank: records}, each rank's first record holding them."""
    rows = [{"RANK": me["RANK"], "GROUP_RANK": me["GROUP_RANK"], "LOCAL_RANK": me["LOCAL_RANK"],
             "WORLD_SIZE": me["WORLD_SIZE"], "agent pid": me["agent_pid"],
             "rendezvous": f"{me['MASTER_ADDR']}:{me['MASTER_PORT']}"}
            for me in (metrics[r][0] for r in sorted(metrics))]
    return pd.DataFrame(rows).set_index("RANK")


@as_table
def process_outcomes(outcome: dict[str, list[tuple[int, str]]]) -> pd.DataFrame:
    """One row per process started by hand, by case: its exit code and the line to read first (its last
    exception line, procs.last_words). outcome: {case: [(exit code, output), ...]}."""
    rows = [{"case": case, "process": i, "exit code": code, "last words": last_words(text)}
            for case, procs in outcome.items() for i, (code, text) in enumerate(procs)]
    return pd.DataFrame(rows).set_index(["case", "process"])


@as_table
def placement(times: dict[str, tuple[float, float]]) -> pd.DataFrame:
    """One row per communication of a layout: its modelled time inside a node and across nodes (ms), and how
    many times slower across is. times: {what: (seconds inside, seconds across)}."""
    rows = [{"communication": name, "inside a node (ms)": round(inside * 1e3, 1),
             "across nodes (ms)": round(across * 1e3, 1), "across / inside (×)": round(across / inside)}
            for name, (inside, across) in times.items()]
    return pd.DataFrame(rows).set_index("communication")


@as_table
def attempt_logs(result, ranks: int) -> pd.DataFrame:
    """One row per (attempt, rank) of a run torchrun restarted: what the rank printed, lines joined by " | ".
    result: a RunResult (the attempts that left a log folder in its run folder, and .log(rank, attempt=K))."""
    rows = [{"attempt": k, "rank": r, "printed": " | ".join(result.log(r, attempt=k).strip().splitlines())}
            for k in attempts_of(result.run_dir) for r in range(ranks)]
    return pd.DataFrame(rows).set_index(["attempt", "rank"])


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


@as_table
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
