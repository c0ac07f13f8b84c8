"""Who am I in a multi-node job? Each rank reports what torchrun told it, and gathers everyone's answer.

torchrun sets, in every worker: GROUP_RANK (this node's rank among the nodes), LOCAL_RANK (this worker's
rank on its node), RANK (its rank in the whole job), WORLD_SIZE, LOCAL_WORLD_SIZE, and MASTER_ADDR /
MASTER_PORT (where the process group meets; with c10d rendezvous, a store on the rendezvous host).
"""
import os
import socket

import torch
import torch.distributed as dist

from gpucourse import runtime

ctx = runtime.setup()
me = {key: os.environ.get(key) for key in ("GROUP_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                           "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
me.update(host=socket.gethostname(), pid=os.getpid(), agent_pid=os.getppid())
print(" ".join(f"{k}={v}" for k, v in me.items()), flush=True)
runtime.log(**me)

# Global rank = node rank * ranks per node + local rank: check it on every rank, with one all_gather.
everyone = [None] * ctx.world_size
dist.all_gather_object(everyone, me)
assert all(int(e["RANK"]) == int(e["GROUP_RANK"]) * int(e["LOCAL_WORLD_SIZE"]) + int(e["LOCAL_RANK"])
           for e in everyone), everyone
total = torch.tensor([float(ctx.rank)])
dist.all_reduce(total)  # one collective across both "nodes"
runtime.log(ranks_seen=[int(e["RANK"]) for e in everyone], agents=sorted({e["agent_pid"] for e in everyone}),
            rank_sum=total.item())
runtime.teardown()
