"""The smoke job `gpucourse doctor` launches: one all-reduce whose answer is known (0 + 1 + ... + N-1)."""
import torch
import torch.distributed as dist

from gpucourse.run import runtime

ctx = runtime.setup()
value = torch.tensor([float(ctx.rank)], device=ctx.device)
dist.all_reduce(value)
expected = ctx.world_size * (ctx.world_size - 1) / 2
if value.item() != expected:
    raise RuntimeError(f"all-reduce gave {value.item()}, expected {expected}: the backend is broken")
runtime.log(sum=value.item(), world_size=ctx.world_size, backend=ctx.backend, device=str(ctx.device))
runtime.teardown()
