"""Chapter 08b, hangs and desyncs: the tables it shows from its runs.

`notebooks/08b_hangs_and_desyncs.ipynb` imports it by its short name:

    from gpucourse.chapters import ch08b
    ch08b.diagnoses(runs)                # each broken run's fault and whom it blames
    ch08b.shard_batches(result)          # {rank: training batches} of an 08b_uneven.py run, from its logs

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
"""
from __future__ import annotations

import re

import pandas as pd

from ..viz.tables import as_table


@as_table
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


def shard_batches(result) -> dict[int, int]:
    """{rank: training batches it held} of a scripts/08b_uneven.py run, read from the line each rank prints before it
    trains ("rank 1: 4 training batches"): the buggy loop's run has them too, whether it hung or crashed after."""
    found = {}
    for rank in range(result.world_size):
        said = re.search(r"^rank \d+: (\d+) training batches$", result.log(rank), re.MULTILINE)
        if said:
            found[rank] = int(said.group(1))
    return found
