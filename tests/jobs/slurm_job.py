"""The Slurm test's job: each rank records who it is, where it ran and an all-reduce, through gpucourse.run.runtime."""
import os
import socket

import torch
import torch.distributed as dist

from gpucourse import runtime

ctx = runtime.setup(seed=0)
value = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(value)  # every rank must see 1 + 2 + ... + world_size
print(f"rank {ctx.rank} of {ctx.world_size}: all-reduce {value.item():g}", flush=True)
runtime.log(step=0, total=1, world_size=ctx.world_size, local_rank=ctx.local_rank, backend=ctx.backend,
            allreduce=value.item(), pid=os.getpid(), host=socket.gethostname(),
            slurm_job_id=os.environ.get("SLURM_JOB_ID"), run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
runtime.teardown()
