"""Chapter 00: every rank reports who it is, then all ranks sum their rank numbers with all_reduce."""
import os
import socket

import torch
import torch.distributed as dist

from gpucourse import runtime

ctx = runtime.setup()
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
print(f"rank {ctx.rank}/{ctx.world_size} (local rank {ctx.local_rank}) on {socket.gethostname()}, "
      f"pid {os.getpid()}, backend {ctx.backend}, device {ctx.device}")
print("torchrun environment:", env)

value = torch.tensor([float(ctx.rank)], device=ctx.device)
dist.all_reduce(value)  # default op: SUM over all ranks; every rank receives the result
expected = ctx.world_size * (ctx.world_size - 1) / 2
print(f"rank {ctx.rank}: all_reduce of all ranks = {value.item():g} (expected {expected:g})")
runtime.log(step=0, total=1, all_reduce=value.item(), expected=expected, pid=os.getpid(),
            local_rank=ctx.local_rank, backend=ctx.backend, device=str(ctx.device))
runtime.teardown()
