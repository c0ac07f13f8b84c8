"""Run the dry run many times, its ranks forked from one host (run/fake.py's _host); count anything wrong.

    python benchmarks/stress_dryrun.py [--rounds 10] [--json out.json]

Each round dry-runs, side by side with nothing else of its own: the 2-D capstone at world 1,024 (ranks 0 and
1,023, real tensors), the same with fake tensors, a script whose rank 1 raises while rank 0 sleeps, and one whose
ranks sleep past the timeout. Wrong: a report that differs from the first round's (the counts are deterministic),
a failure whose message differs, a run that passes when it should fail, or a process of the dry run still alive
after it returned. Goal: 0 wrong. A benchmark, not a test: a round takes ~40 s on 2 cores.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpucourse.run import dryrun as dr  # noqa: E402

CAPSTONE = ROOT / "scripts" / "09_gpt_2d.py"
ARGS = ["--dp", "256", "--tp", "4", "--batch", "256", "--steps", "2", "--layers", "1", "--eval-batches", "0",
        "--sample", "0"]
STUCK = """import sys, time
from gpucourse import runtime
ctx = runtime.setup()
if sys.argv[1] == "give-up" and ctx.rank == 1:
    raise RuntimeError("rank 1 gives up")
time.sleep(600)
"""
CASES = {"real": dict(script=CAPSTONE, world=1024, args=ARGS),
         "fake": dict(script=CAPSTONE, world=1024, args=ARGS, fake_tensors=True),
         "give-up": dict(world=2, args=["give-up"], timeout=60),
         "late": dict(world=2, args=["wait"], timeout=15)}


def hosts() -> list[psutil.Process]:
    """Dry-run hosts and ranks alive on this machine (a forked rank keeps its host's command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "from gpucourse.run.fake import _host; _host()" in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def one(case: dict, stuck: Path) -> tuple[str, object]:
    case = {"script": stuck, **case}
    try:
        report = dr.dryrun(case.pop("script"), **case)
        return "ok", [{k: r[k] for k in ("comms", "model_states", "flops", "peak_bytes")} for r in report["ranks"]]
    except (dr.DryRunFailed, dr.DryRunError) as err:
        return "failed", str(err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    stuck = Path(tempfile.mkdtemp()) / "stuck.py"
    stuck.write_text(STUCK)
    first, wrong, seconds = {}, [], {name: [] for name in CASES}
    for round_ in range(args.rounds):
        for name, case in CASES.items():
            started = time.monotonic()
            got = one(case, stuck)
            seconds[name].append(time.monotonic() - started)
            expected_kind = "ok" if name in ("real", "fake") else "failed"
            first.setdefault(name, got)
            if got[0] != expected_kind or got != first[name]:
                wrong.append(f"round {round_} {name}: {got[0]}: {str(got[1])[:200]}")
            _, alive = psutil.wait_procs(hosts(), timeout=5)
            if alive:
                wrong.append(f"round {round_} {name}: left running: {[p.pid for p in alive]}")
                for proc in alive:
                    proc.kill()
        print(f"round {round_ + 1}/{args.rounds}: {len(wrong)} wrong so far", flush=True)
    summary = {"rounds": args.rounds, "wrong": wrong,
               "median_s": {name: sorted(s)[len(s) // 2] for name, s in seconds.items()}}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
