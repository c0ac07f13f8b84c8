"""Holds a small job open so a test can look at it from outside.

Each rank all-reduces rank + 1, logs what it sees of the job (the sum, MASTER_ADDR/PORT, the host name,
the remote addresses of its open TCP connections), then waits until the file given by --release exists
(or --max-wait seconds pass) before tearing down: while it waits, the job's sockets and processes can be
inspected.
"""
import argparse
import os
import socket
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--release", required=True, help="wait until this file exists")
parser.add_argument("--max-wait", type=float, default=60.0)
parser.add_argument("--fail-first-attempt", action="store_true", help="rank 0 raises on attempt 0 (tests restarts)")
args = parser.parse_args()

ctx = runtime.setup(seed=0)
if args.fail_first_attempt and ctx.rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    raise RuntimeError("deliberate failure on the first attempt")
value = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(value)
runtime.log(rank=ctx.rank, world_size=ctx.world_size, sum=value.item(), pid=os.getpid(),
            attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            master_addr=os.environ.get("MASTER_ADDR"), master_port=os.environ.get("MASTER_PORT"),
            group_rank=os.environ.get("GROUP_RANK"), host=socket.gethostname(),
            peers=sorted({c.raddr[0] for c in psutil.Process().net_connections(kind="tcp") if c.raddr}))
print(f"rank {ctx.rank} ready", flush=True)
deadline = time.monotonic() + args.max_wait
while not Path(args.release).exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.barrier()
runtime.teardown()
