"""Inject random faults into real jobs (the grader's world size), many times; count the launcher's wrong diagnoses.

    python benchmarks/stress_forensics.py [--seeds 0 1 2 3 ...] [--subgroup-faults N] [--no-world]

Each seed is one set of exercise ex08_read_the_dumps's faults (its grader's `inject`: 10 jobs of
scripts/08b_hangs.py, two of each kind, random culprit rank and step, in the default process group) and N faults
(default 10) inside a subgroup: the same script's --group tp or dp, its 4 ranks a 2 x 2 mesh ("dp", "tp"), each
kind in a TP group and in a DP group, random culprit rank (0 to 3) and step. For each, `forensics.diagnose` (what
the launcher reports and `gpucourse diagnose` prints) is compared with what was injected: the culprit rank, the
collective's sequence number (in its group), the kind and, in a subgroup, the group's global ranks and mesh
dimension. Goal: 0 wrong. A benchmark, not a test: a seed takes a few minutes on 2 cores.
"""
import argparse
import collections
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpucourse.run import forensics  # noqa: E402
from gpucourse.run.contract import RUNS_ENV  # noqa: E402
from gpucourse.run.launcher import launch_all  # noqa: E402
from gpucourse.tools.grading.graders import ex08_read_the_dumps as faults  # noqa: E402


def mesh_group(dim: str, rank: int, world: int = faults.WORLD) -> list[int]:
    """The global ranks of `rank`'s group along `dim` of the script's 2 x world/2 mesh ("dp", "tp")."""
    tp = world // 2
    return [rank // tp * tp + i for i in range(tp)] if dim == "tp" else [rank % tp + i * tp for i in range(2)]


def subgroup_faults(seed: int, count: int) -> list[dict]:
    """Inject `count` faults inside subgroups (the kinds in turn, TP then DP), 5 jobs at a time, like the grader."""
    rng = random.Random(f"subgroups-{seed}")
    drawn = [{"kind": faults.KINDS[i % len(faults.KINDS)], "group": ("tp", "dp")[i // len(faults.KINDS) % 2],
              "rank": rng.randrange(faults.WORLD), "step": rng.randrange(faults.STEPS)} for i in range(count)]
    jobs = []
    for i, fault in enumerate(drawn):
        job = faults.job(fault, i)
        jobs.append({**job, "args": [*job["args"], "--group", fault["group"]],
                     "name": f"stress-subgroup-{i}-{fault['group']}-{fault['kind']}"})
    results = launch_all(jobs, parallel=faults.PARALLEL)
    return [{**f, "run_dir": str(r.run_dir), "exits": [r.returncodes.get(k) for k in range(faults.WORLD)]}
            for f, r in zip(drawn, results)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--subgroup-faults", type=int, default=10, help="faults inside subgroups per seed")
    parser.add_argument("--no-world", action="store_true", help="only the subgroup faults")
    args = parser.parse_args()
    os.environ.setdefault(RUNS_ENV, tempfile.mkdtemp(prefix="stress-forensics-"))
    wrong, per_kind, start = [], collections.Counter(), time.monotonic()
    for seed in args.seeds:
        injected = [] if args.no_world else faults.inject(seed)["faults"]
        injected += subgroup_faults(seed, args.subgroup_faults) if args.subgroup_faults else []
        for fault in injected:
            group = fault.get("group", "world")
            truth = (fault["kind"], [fault["rank"]], fault["step"] + 1)
            found = forensics.diagnose(fault["run_dir"], world=faults.WORLD, exits=dict(enumerate(fault["exits"])))
            got = (found.kind, found.ranks, found.seq_id)
            if group != "world":
                truth += (mesh_group(group, fault["rank"]), group)
                got += (found.group_ranks, found.mesh_dim)
            else:
                truth += (list(range(faults.WORLD)), None)
                got += (found.group_ranks, found.mesh_dim)
            per_kind[f"{fault['kind']} ({group})"] += 1
            if got != truth:
                wrong.append(f"seed {seed}: injected {truth}, diagnosed {got} ({fault['run_dir']})")
        print(f"seed {seed}: {len(wrong)} wrong so far, {time.monotonic() - start:.0f} s, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    total = sum(per_kind.values())
    print("\n".join(wrong))
    print(f"{len(wrong)} of {total} diagnoses wrong ({dict(per_kind)} faults by kind and group; {faults.WORLD} ranks, "
          f"gloo/CPU, {time.monotonic() - start:.0f} s, load average at the end {os.getloadavg()[0]:.1f})")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
