"""Log the buckets DDP settles on (after its rebuild in the second step), for bucket_cap_mb None and 25."""
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

runtime.setup(seed=0)
for cap in (None, 25):
    model = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]), bucket_cap_mb=cap)
    for _ in range(3):  # buckets are rebuilt, in gradient order, after the first step
        model(torch.randn(4, 512)).sum().backward()
    sizes = model._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    runtime.log(cap=cap, bucket_bytes=[int(s) for s in sizes.split(",")])
runtime.teardown()
