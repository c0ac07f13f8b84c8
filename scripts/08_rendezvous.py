"""Chapter 08: join a process group the way a hand-written launch does, and fail fast when it is misconfigured.

Start one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment: what torchrun
or an sbatch script sets for you. init_process_group (env://) reads them; rank 0 hosts the store at
MASTER_ADDR:MASTER_PORT and waits until WORLD_SIZE ranks have joined. --timeout bounds every wait, so a
misconfigured launch fails in seconds instead of after the 30-minute default.
"""
import argparse
import datetime
import os

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the other ranks")
args = parser.parse_args()

print(f"rank {os.environ['RANK']}: joining a group of {os.environ['WORLD_SIZE']} at "
      f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
dist.barrier()
print(f"rank {dist.get_rank()}: joined, {dist.get_world_size()} ranks", flush=True)
dist.destroy_process_group()
