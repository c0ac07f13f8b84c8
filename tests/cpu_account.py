"""CPU seconds per test: a pytest plugin, and a summary of what it wrote. CI does not load it.

    .venv/bin/python -m pytest -p tests.cpu_account -n 2 --dist loadgroup -q   # make test's run, counted
    .venv/bin/python -m tests.cpu_account [--top 30]                          # the costliest, by test and file

CI's time on 2 cores is its CPU seconds over two: a timing moves with the machine's load, CPU seconds much less.
Per test: this process's CPU time plus that of every child it waited for (launches, kernels, graders), between the
test's start and end, one line per test in $CPU_ACCOUNT (default /tmp/cpu-account) + "-<xdist worker>.tsv".
A process that no waiting parent reaps (an orphan) is not counted.
"""
import argparse
import glob
import os
import resource
import time
from collections import defaultdict

OUT = os.environ.get("CPU_ACCOUNT", "/tmp/cpu-account")
_started = {}


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (_cpu(), time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    cpu, wall = _started.pop(nodeid)
    with open(f"{OUT}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.tsv", "a") as f:
        f.write(f"{_cpu() - cpu:.1f}\t{time.monotonic() - wall:.1f}\t{nodeid}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = []  # the workers' files: the controller ("main") sees every test too, but not its CPU
    for path in glob.glob(f"{OUT}-gw*.tsv") or glob.glob(f"{OUT}-main.tsv"):
        with open(path) as f:
            rows += [(float(cpu), float(wall), node.strip()) for cpu, wall, node in (line.split("\t") for line in f)]
    if not rows:
        raise SystemExit(f"nothing in {OUT}-*.tsv: run pytest with -p tests.cpu_account first (see the docstring)")
    by_file = defaultdict(float)
    for cpu, _, node in rows:
        by_file[node.split("::")[0]] += cpu
    print(f"{len(rows)} tests, {sum(r[0] for r in rows):,.0f} CPU s, {sum(r[1] for r in rows):,.0f} s in workers")
    for cpu, wall, node in sorted(rows, reverse=True)[:args.top]:
        print(f"{cpu:7.1f} CPU s {wall:7.1f} s  {node}")
    print("by file:")
    for path, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{cpu:7.1f} CPU s  {path}")


if __name__ == "__main__":
    main()
