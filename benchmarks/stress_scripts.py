"""Run every chapter script that trains, many times, and count the runs that fail: a correct run must succeed every time.

    python benchmarks/stress_scripts.py [--repeats 20] [--nproc 2 4] [--only 02_equivalence 08_resume]

Each script runs at small sizes through `gpucourse.launch`, exactly as a notebook launches it, `--repeats`
times at each world size. Failures are grouped by their root cause (rank numbers folded, so the same abort
on rank 1 and rank 3 counts as one cause). Goal: 0 failures. This is a benchmark, not a test: it takes
tens of minutes on 2 cores, and its result is recorded in benchmarks/README.md.
"""
import argparse
import collections
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gpucourse  # noqa: E402

# script -> its arguments for a world size (small sizes: seconds per run on a laptop)
TRAINING_SCRIPTS = {
    "02_equivalence": lambda w: ["--steps", "4"],
    "02_ddp_compare": lambda w: [str(ROOT / "solutions" / "ex02_ddp.py"), "--steps", "5"],
    "02_no_sync": lambda w: ["--steps", "3"],
    "02_plain_ddp": lambda w: ["--epochs", "2"],
    "02_precision": lambda w: ["--steps", "3"],
    "02_sampler": lambda w: [],
    "03_ddp_train": lambda w: ["--steps", "5", "--warmup", "2", "--profile-steps", "2", "--hidden", "128",
                               "--layers", "2"],
    "03_plain_profiler": lambda w: ["--steps", "2"],
    "04_large_batch": lambda w: ["--epochs", "1", "--n-train", "2048", "--n-test", "512", "--evals-per-epoch",
                                 "2", "--rules", "linear"],
    "05_pipeline": lambda w: ["--micro", "2", "4", "--steps", "1", "--work-ms", "2"],
    "06_tp_block": lambda w: [],
    "06_dtensor_tp": lambda w: [],
    "07_memory": lambda w: ["--steps", "2", "--width", "64", "--depth", "4", "--batch", "8"],
    "07b_precision": lambda w: ["--steps", "2", "--width", "64", "--depth", "4", "--scaler-steps", "8"],
    "08_resume": lambda w: ["--steps", "10", "--ckpt-every", "5"],
    "09_gpt_2d": lambda w: ["--dp", str(max(1, w // 2)), "--tp", str(min(w, 2)), "--steps", "5", "--layers", "1",
                            "--eval-batches", "1", "--sample", "0"],
    "11_moe": lambda w: ["--router", "learned", "skewed", "--capacity-factor", "1.0", "1.25"],
    "08_reshard": lambda w: ["--layout", "fsdp-tp" if w % 2 == 0 else "fsdp", "--steps", "6", "--save-at", "2",
                             "--batch", str(4 * w), "--samples", str(24 * w)],  # trains, saves with DCP, trains on
}


def cause(result) -> str:
    """The root cause with rank numbers and run-specific paths folded, so equal causes count together."""
    text = result.error.summary if result.error else result.status
    text = re.sub(r"\brank \d+", "rank r", text)
    return re.sub(r"/\S+", "<path>", text)[:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only", nargs="+", choices=sorted(TRAINING_SCRIPTS), help="these scripts only")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    args = parser.parse_args()
    os.environ.setdefault("GPUCOURSE_RUNS_DIR", tempfile.mkdtemp(prefix="stress-runs-"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = args.only or list(TRAINING_SCRIPTS)
    failures = collections.Counter()
    rows, total, start = [], 0, time.monotonic()
    for name in names:
        for nproc in args.nproc:
            bad, seconds = 0, []
            for i in range(args.repeats):
                t0 = time.monotonic()
                result = gpucourse.launch(ROOT / "scripts" / f"{name}.py", nproc=nproc, args=TRAINING_SCRIPTS[name](nproc),
                                          timeout=args.timeout, live=False, check=False, name=f"stress-{name}")
                seconds.append(time.monotonic() - t0)
                total += 1
                if not result.ok:
                    bad += 1
                    failures[(name, cause(result))] += 1
                    print(f"  FAILED {name} x{nproc} run {i + 1}: {cause(result)} ({result.run_dir})", flush=True)
            seconds.sort()
            rows.append((name, nproc, bad, seconds[len(seconds) // 2]))
            print(f"{name:16s} {nproc} ranks: {bad} of {args.repeats} failed (median {rows[-1][3]:.1f} s a run)",
                  flush=True)
    print(f"\n{sum(r[2] for r in rows)} of {total} runs failed, {time.monotonic() - start:.0f} s in all "
          f"(gloo/CPU, {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
          f"load average at the end {os.getloadavg()[0]:.1f})")
    for (name, text), n in failures.most_common():
        print(f"  {n} x {name}: {text}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
