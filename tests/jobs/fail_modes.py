"""One rank fails in a chosen way while the others wait: the launcher must name that rank, not an innocent one.

    --mode raise          --rank raises ValueError
    --mode abort          --rank calls os.abort() (SIGABRT)
    --mode exit           --rank calls os._exit(3): no traceback, no error file
    --mode segv           --rank sends itself SIGSEGV
    --mode abort-at-exit  every rank finishes its work (runtime.teardown()), then --rank calls std::terminate at
                          interpreter exit, as gloo's worker thread does ("terminate called without an active
                          exception", see runtime.wait_for_gloo_workers)
--others: what the other ranks do meanwhile: block in a collective the failing rank never joins (they then see
the peer's death, or torchrun SIGTERMs them first), sleep until torchrun SIGTERMs them, or leave their error file
torn (opened, nothing written: as a rank that torchrun stops while it writes its exception there) and sleep.
"""
import argparse
import atexit
import ctypes
import ctypes.util
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from gpucourse import runtime
from gpucourse.run.contract import EVENT_TEARDOWN, metrics_file

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["raise", "abort", "exit", "segv", "abort-at-exit"], required=True)
parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
parser.add_argument("--others", choices=["collective", "sleep", "torn"], default="sleep")
args = parser.parse_args()


def tore_down(run_dir, rank) -> bool:
    try:
        lines = metrics_file(run_dir, rank).read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(line).get("event") == EVENT_TEARDOWN for line in lines if line.strip())


def terminate():
    """std::terminate, the real thing: libstdc++ prints "terminate called without an active exception" and aborts."""
    ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")._ZSt9terminatev()


ctx = runtime.setup()
dist.all_reduce(torch.ones(1))  # every rank is up before anything fails
print(f"rank {ctx.rank} ready", flush=True)

if args.mode == "abort-at-exit":
    dist.barrier()
    runtime.teardown()
    if ctx.rank == args.rank:
        deadline = time.monotonic() + 60
        # Fail only once every rank has written its teardown record: that is the case under test.
        while not all(tore_down(ctx.run_dir, r) for r in range(ctx.world_size)) and time.monotonic() < deadline:
            time.sleep(0.05)
        atexit.register(terminate)  # runs at interpreter exit, after the script's last line
    else:
        time.sleep(120)  # still exiting when rank args.rank aborts: torchrun SIGTERMs us
elif ctx.rank == args.rank:
    time.sleep(1.0)  # let the others reach their wait
    if args.mode == "raise":
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    if args.mode == "abort":
        os.abort()
    if args.mode == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)
elif args.others == "torn":
    open(os.environ["TORCHELASTIC_ERROR_FILE"], "w").close()
    time.sleep(120)
elif args.others == "collective":
    dist.all_reduce(torch.ones(1))  # the failing rank never joins: this blocks until it dies
    time.sleep(120)
else:
    time.sleep(120)
