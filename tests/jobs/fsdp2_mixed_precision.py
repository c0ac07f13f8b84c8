"""FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): the dtypes of the sharded parameters and gradients it keeps,
and the dtype each layer computes in (chapter 07's recipe table)."""
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gpucourse import runtime

runtime.setup(seed=0)
model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
for layer in model:
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
computed = set()
for layer in model:
    layer.register_forward_hook(lambda module, args, out: computed.add(str(out.dtype)))
model(torch.randn(4, 16)).float().sum().backward()
params = list(model.parameters())
runtime.log(param_dtypes=sorted({str(p.dtype) for p in params}), grad_dtypes=sorted({str(p.grad.dtype) for p in params}),
            local_dtypes=sorted({str(p.to_local().dtype) for p in params}), computed_dtypes=sorted(computed),
            local_numel=sum(p.to_local().numel() for p in params), numel=sum(p.numel() for p in params))
runtime.teardown()
