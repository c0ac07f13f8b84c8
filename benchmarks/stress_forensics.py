"""Inject random faults into real jobs (the grader's world size), many times; count the launcher's wrong diagnoses.

    python benchmarks/stress_forensics.py [--seeds 0 1 2 3 ...]

Each seed is one set of exercise ex08_read_the_dumps's faults (its grader's `inject`: 10 jobs of
scripts/08_hangs.py, two of each kind, random culprit rank and step). For each, `forensics.diagnose` (what the
launcher reports and `gpucourse diagnose` prints) is compared with what was injected: the culprit rank, the
collective's sequence number and the kind. Goal: 0 wrong. A benchmark, not a test: a seed takes a minute or
two on 2 cores.
"""
import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpucourse.run import forensics  # noqa: E402
from gpucourse.run.contract import RUNS_ENV  # noqa: E402
from gpucourse.tools.grading.graders import ex08_read_the_dumps as faults  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    args = parser.parse_args()
    os.environ.setdefault(RUNS_ENV, tempfile.mkdtemp(prefix="stress-forensics-"))
    wrong, per_kind, start = [], collections.Counter(), time.monotonic()
    for seed in args.seeds:
        for fault in faults.inject(seed)["faults"]:
            truth = (fault["kind"], [fault["rank"]], fault["step"] + 1)
            found = forensics.diagnose(fault["run_dir"], world=faults.WORLD, exits=dict(enumerate(fault["exits"])))
            per_kind[fault["kind"]] += 1
            if (found.kind, found.ranks, found.seq_id) != truth:
                wrong.append(f"seed {seed}: injected {truth}, diagnosed {(found.kind, found.ranks, found.seq_id)}"
                             f" ({fault['run_dir']})")
        print(f"seed {seed}: {len(wrong)} wrong so far, {time.monotonic() - start:.0f} s", flush=True)
    total = sum(per_kind.values())
    print("\n".join(wrong))
    print(f"{len(wrong)} of {total} diagnoses wrong ({dict(per_kind)} faults by kind; {faults.WORLD} ranks, gloo/CPU, "
          f"{time.monotonic() - start:.0f} s, load average at the end {os.getloadavg()[0]:.1f})")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
