"""gpucourse.launch against bare torchrun on the same 4-rank script, alternating, median ratio (goal <= 1.10).

    python benchmarks/launch_overhead.py [--repeats 5] [--nproc 4]

Both run scripts/00_hello.py (an all-reduce and a few prints); the difference is what the launcher adds:
validation, the agent wrapper, live tailing, the manifest, and the process-tree cleanup.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gpucourse  # noqa: E402

SCRIPT = ROOT / "scripts" / "00_hello.py"


def bare_torchrun(nproc: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    str(SCRIPT)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def with_gpucourse(nproc: int) -> float:
    start = time.perf_counter()
    gpucourse.launch(SCRIPT, nproc=nproc, live=False, name="bench-launch")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("GPUCOURSE_RUNS_DIR", tempfile.mkdtemp(prefix="bench-runs-"))
    bare, ours = [], []
    for i in range(args.repeats):
        # alternate the order so drift on a shared machine hits both sides alike
        pair = (bare_torchrun, with_gpucourse) if i % 2 == 0 else (with_gpucourse, bare_torchrun)
        for fn in pair:
            (bare if fn is bare_torchrun else ours).append(fn(args.nproc))
    b, o = statistics.median(bare), statistics.median(ours)
    print(f"{args.nproc} ranks, gloo/CPU, {args.repeats} runs each")
    print(f"bare torchrun     median {b:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in bare)})")
    print(f"gpucourse.launch  median {o:.2f} s  (runs: {', '.join(f'{t:.2f}' for t in ours)})")
    print(f"ratio gpucourse/torchrun: {o / b:.3f}  (goal <= 1.10)")


if __name__ == "__main__":
    main()
