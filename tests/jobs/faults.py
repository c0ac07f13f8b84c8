"""Faults for the forensics tests that chapter 08's hang script (scripts/08_hangs.py) does not make.

    --mode crash       after three all-reduces, --rank kills itself (SIGKILL) as the others enter the fourth
    --mode rendezvous  every rank asks for one rank more than torchrun started: no process group ever forms
"""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["crash", "rendezvous"], required=True)
parser.add_argument("--rank", type=int, default=1, help="the rank that crashes")
args = parser.parse_args()

if args.mode == "rendezvous":
    os.environ["WORLD_SIZE"] = str(int(os.environ["WORLD_SIZE"]) + 1)  # a rank that will never come
ctx = runtime.setup()
for step in range(3):
    dist.all_reduce(torch.ones(4))
    runtime.log(step=step)
print(f"rank {ctx.rank}: three steps done", flush=True)
store = dist.distributed_c10d._get_default_store()
if ctx.rank == args.rank:  # once the others are in the 4th: no exception, no dump, as an OOM kill or a lost node
    while store.add("entered", 0) < ctx.world_size - 1:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
work = dist.all_reduce(torch.ones(4), async_op=True)
store.add("entered", 1)
work.wait()
runtime.teardown()
