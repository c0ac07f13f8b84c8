"""Chapter 00: one rank fails; the others wait in a collective and are stopped by torchrun."""
import argparse

import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--failing-rank", type=int, default=1)
args = parser.parse_args()

ctx = runtime.setup()
dist.barrier()
print(f"rank {ctx.rank}: passed the first barrier")
if ctx.rank == args.failing_rank:
    weights = torch.ones(3, 4)
    weights @ torch.ones(3)  # shapes (3, 4) @ (3,): a mistake that raises RuntimeError
dist.barrier()  # the other ranks wait here for a rank that will never come
runtime.teardown()
