"""`gpucourse dryrun` at scale: wall time and the ranks' peak memory (RSS) against its goals (below). Not a test.

    python benchmarks/dryrun_scale.py [--only capstone|7b] [--steps 2] [--timeout 1800]

capstone: scripts/09_gpt_2d.py at world 1,024 (dp 256 x tp 4, FSDP x TP, 2D), its first and last rank, real
  tensors at the capstone's own sizes; goal <= 60 s and <= 2 GB (the largest rank process's peak RSS).
7b: the same script with its width, depth and heads at a 7 B-class size (d_model 4096, 32 layers, 32 heads, 4 x
  d_model MLP: 6.4 B parameters in the blocks, a character vocabulary) on 1,024 ranks, dp 128 x tp 8 (FSDP x TP, 2D:
  the capstone has no pipeline dimension), with fake tensors (--fake-tensors); goal <= 5 min. Its fp32 model
  states alone would be 16 bytes x 6.4 B = 103 GB on one real rank without sharding.

RSS and CPU time are sampled with psutil every 50 ms over the rank processes (the driver's children); a rank's CPU
seconds are what its wall time would be on an idle core, and the load average beside the numbers says how busy
the machine was (other work shares it).
"""
import argparse
import os
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import gpucourse  # noqa: E402

SCRIPT = ROOT / "scripts" / "09_gpt_2d.py"
RUN = ["--eval-batches", "0", "--sample", "0", "--warmup-steps", "0"]
CASES = {  # name: (world, script args, fake tensors, goal seconds, goal peak RSS bytes or None)
    "capstone": (1024, ["--dp", "256", "--tp", "4", "--batch", "256"], False, 60, 2e9),
    "7b": (1024, ["--dp", "128", "--tp", "8", "--batch", "128", "--d-model", "4096", "--layers", "32",
                  "--heads", "32", "--context", "2048"], True, 300, None),
}


class PeakRss:
    """The largest RSS any child process of this one reached, sampled every `interval` seconds."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self.cpu: dict[int, float] = {}  # pid -> CPU seconds (user + system) at its last sample
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            for child in me.children(recursive=True):
                try:
                    self.peak = max(self.peak, child.memory_info().rss)
                    times = child.cpu_times()
                    self.cpu[child.pid] = times.user + times.system
                except psutil.Error:  # it ended between the listing and the read
                    pass
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_case(name: str, steps: int, timeout: float) -> dict:
    world, args, fake, goal_s, goal_rss = CASES[name]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with PeakRss() as rss:
        report = gpucourse.dryrun(SCRIPT, world=world, args=[*args, "--steps", str(steps), *RUN], timeout=timeout,
                                  fake_tensors=fake)
    seconds = time.perf_counter() - start
    last = report["ranks"][-1]
    return {"case": name, "world": world, "fake": fake, "seconds": seconds, "peak_rss": rss.peak,
            "rank_cpu_s": max(rss.cpu.values(), default=0.0),
            "goal_s": goal_s, "goal_rss": goal_rss, "load_before": load, "load_after": os.getloadavg()[0],
            "params_per_rank": last["model_states"]["params"], "peak_bytes": last["peak_bytes"],
            "flops": last["flops"], "ranks": [r["rank"] for r in report["ranks"]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=list(CASES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a case's dry run is stopped")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, dry run (fake process "
          "group): wall time of the whole dryrun() call (both ranks, side by side), peak RSS of one rank process")
    for name in [args.only] if args.only else list(CASES):
        r = run_case(name, args.steps, args.timeout)
        rss_goal = f" (goal <= {r['goal_rss'] / 1e9:.0f} GB)" if r["goal_rss"] else ""
        ok = r["seconds"] <= r["goal_s"] and (r["goal_rss"] is None or r["peak_rss"] <= r["goal_rss"])
        print(f"{name}: world {r['world']}, ranks {r['ranks']}, {'fake' if r['fake'] else 'real'} tensors: "
              f"{r['seconds']:.1f} s (goal <= {r['goal_s']} s; {r['rank_cpu_s']:.0f} CPU s in one rank), "
              f"peak RSS {r['peak_rss'] / 1e6:,.0f} MB{rss_goal}; "
              f"load {r['load_before']:.1f} -> {r['load_after']:.1f}; rank {r['ranks'][-1]}: "
              f"{r['params_per_rank'] / 1e6:.3g} MB of parameters, peak {r['peak_bytes'] / 1e6:,.3g} MB counted, "
              f"{r['flops'] / 1e9:,.4g} GFLOP a step -> {'met' if ok else 'MISSED'}", flush=True)


if __name__ == "__main__":
    main()
