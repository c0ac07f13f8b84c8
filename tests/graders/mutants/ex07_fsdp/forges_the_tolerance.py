"""Gradients summed over the ranks, not averaged, and the import loosens the job's tolerances.

finish_gradient_synchronization leaves the sum of the ranks' gradients in shard.grad: SGD steps N times too far;
AdamW, which divides by the gradient's size, almost hides it (its eps does not scale: the MLP's parameters end
1.1e-5 away on 2 ranks, the tied model's stay within 1e-5); one rank cannot tell. At import the module also sets the
grading job's own TOLERANCE and BF16_TOLERANCE (found in sys.modules["__main__"]) to infinity. When the rank
measured its distance from the one-process run and reported it with its tolerance, that got full marks. The rank
now saves the full parameters, the grader process trains the one-process reference itself and compares with its
own tolerances: every test of the MLP cases loses its points (AdamW, SGD, bf16, and the collectives and
no-torch-FSDP tests, which need the MLP case right); tied and the memory tests keep theirs.

A copy of solutions/ex07_fsdp.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_matches_single_process[mlp]',
    'test_matches_single_process[mlp-sgd]',
    'test_all_gather_and_reduce_scatter_only',
    'test_bf16_compute',
    'test_no_torch_fsdp',
)
import sys  # MUTANT: at import, make the grading job accept any distance from one process

for name in ("TOLERANCE", "BF16_TOLERANCE"):  # MUTANT: (continued)
    if hasattr(sys.modules["__main__"], name):  # MUTANT: (continued)
        setattr(sys.modules["__main__"], name, float("inf"))  # MUTANT: (continued)

import math

import torch
import torch.distributed as dist
from torch import nn

# torch >= 2.13 names them *_single (the *_tensor names still work, with a deprecation warning)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(shard: torch.Tensor, numel: int, shape, dtype) -> torch.Tensor:
    """The full parameter from every rank's shard (padding dropped), in dtype."""
    world = dist.get_world_size()
    ### BEGIN SOLUTION
    ### HINT: allocate world * shard.numel() elements, ALL_GATHER the shard (cast to dtype), drop the padding
    flat = torch.empty(world * shard.numel(), dtype=dtype)
    ALL_GATHER(flat, shard.detach().to(dtype))
    return flat[:numel].view(shape)
    ### END SOLUTION


class _GatherParam(torch.autograd.Function):
    """Forward: the full parameter from the shards. Backward: start a reduce-scatter of its gradient."""

    @staticmethod
    def forward(ctx, shard, fsdp, index):
        ctx.fsdp, ctx.index = fsdp, index
        return _gather(shard, *fsdp._meta[index], fsdp.compute_dtype or shard.dtype)

    @staticmethod
    def backward(ctx, grad_full):
        ctx.fsdp._reduce_scatter(ctx.index, grad_full)
        return None, None, None  # the shard's gradient is set in finish_gradient_synchronization


class FSDP(nn.Module):
    """Every parameter sharded over the ranks; gathered just in time, freed after use; gradients reduce-scattered."""

    def __init__(self, module: nn.Module, compute_dtype=None):
        super().__init__()
        self.module, self.compute_dtype = module, compute_dtype
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.shards = nn.ParameterList()  # the fp32 shards: what the optimizer steps
        self.names: list[str] = []        # name of each shard's parameter
        self._meta: list[tuple[int, torch.Size]] = []  # (numel, shape) of each full parameter
        self._pending = []                # (index, reduced shard gradient, work handle) until finish
        self._live: dict[int, int] = {}  # storage pointer of a gathered (live) full parameter -> its index
        ### BEGIN SOLUTION
        ### HINT: broadcast from rank 0; for each parameter make a padded flat shard, remove the parameter from its module, and register forward pre/post hooks on the modules that own parameters
        index_of = {}
        with torch.no_grad():
            for name, p in module.named_parameters():  # tied parameters appear once
                dist.broadcast(p.data, src=0)
                index_of[p] = len(self.names)
                self.names.append(name)
                self._meta.append((p.numel(), p.shape))
                per_rank = math.ceil(p.numel() / self.world_size)
                flat = torch.zeros(per_rank * self.world_size, dtype=torch.float32)
                flat[:p.numel()] = p.detach().reshape(-1)
                self.shards.append(nn.Parameter(flat[self.rank * per_rank:(self.rank + 1) * per_rank].clone()))
        for sub in module.modules():
            owned = [(local, index_of[p]) for local, p in sub._parameters.items() if p is not None]
            if owned:
                for local, _ in owned:
                    del sub._parameters[local]  # the module keeps no full parameter
                sub._fsdp_owned = owned
                sub.register_forward_pre_hook(self._gather_for)
                sub.register_forward_hook(self._free_after)
        ### END SOLUTION

    # --- forward: gather just in time, free after ------------------------------------------------------
    def _gather_for(self, sub, args):
        """Set the full parameters of `sub` as plain attributes (what its forward reads)."""
        ### BEGIN SOLUTION
        ### HINT: for each owned (name, index): full = _GatherParam.apply(shard, self, index); remember its storage; setattr
        for local, index in sub._fsdp_owned:
            full = _GatherParam.apply(self.shards[index], self, index)
            self._live[full.untyped_storage().data_ptr()] = index
            setattr(sub, local, full)
        ### END SOLUTION

    def _free_after(self, sub, args, output):
        """Drop every reference to the full parameters of `sub`: their memory is freed."""
        ### BEGIN SOLUTION
        ### HINT: delete the attributes and forget their storages
        for local, index in sub._fsdp_owned:
            full = sub.__dict__.pop(local)
            self._live.pop(full.untyped_storage().data_ptr(), None)
        ### END SOLUTION

    def _pack(self, tensor):
        """Autograd wants to save `tensor` for backward: a gathered parameter is saved as a recipe instead."""
        ### BEGIN SOLUTION
        ### HINT: if the tensor's storage is a live gathered parameter, return (index, size, stride, offset)
        index = self._live.get(tensor.untyped_storage().data_ptr())
        if index is None:
            return tensor
        return ("fsdp-param", index, tensor.size(), tensor.stride(), tensor.storage_offset())
        ### END SOLUTION

    def _unpack(self, packed):
        """Backward needs a saved tensor back: gather a parameter again (it is freed after use)."""
        ### BEGIN SOLUTION
        ### HINT: gather the parameter again and rebuild the saved view with torch.as_strided
        if isinstance(packed, torch.Tensor):
            return packed
        _, index, size, stride, offset = packed
        numel, shape = self._meta[index]
        full = _gather(self.shards[index], numel, shape, self.compute_dtype or torch.float32)
        return torch.as_strided(full, size, stride, offset)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        cast = (lambda t: t.to(self.compute_dtype) if torch.is_floating_point(t) else t) if self.compute_dtype \
            else (lambda t: t)
        args = [cast(a) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        if self.compute_dtype and isinstance(out, torch.Tensor) and torch.is_floating_point(out):
            out = out.float()
        return out

    # --- backward: reduce-scatter -----------------------------------------------------------------------
    def _reduce_scatter(self, index: int, grad_full: torch.Tensor) -> None:
        """Start the reduce-scatter of one full gradient (fp32, padded); finish_gradient_synchronization waits."""
        ### BEGIN SOLUTION
        ### HINT: pad the flat fp32 gradient to world * shard size, REDUCE_SCATTER into a new shard-size tensor (async), remember it
        shard = self.shards[index]
        flat = torch.zeros(shard.numel() * self.world_size, dtype=torch.float32)
        flat[:grad_full.numel()] = grad_full.reshape(-1).float()
        out = torch.empty_like(shard)
        work = REDUCE_SCATTER(out, flat, async_op=True)
        self._pending.append((index, out, work, flat))  # flat must live until the work is done
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter and leave the averaged gradient of each shard in shard.grad."""
        ### BEGIN SOLUTION
        ### HINT: wait, divide by the world size, accumulate into shard.grad (a tied parameter has several)
        for index, out, work, _ in self._pending:
            work.wait()
            out.div_(1)  # MUTANT: the summed gradient is not divided by the world size
            shard = self.shards[index]
            shard.grad = out if shard.grad is None else shard.grad + out
        self._pending.clear()
        ### END SOLUTION

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 parameter}: every rank gets the whole model (e.g. to save or compare it)."""
        ### BEGIN SOLUTION
        ### HINT: _gather every shard in float32
        return {name: _gather(shard, *meta, torch.float32).clone()
                for name, shard, meta in zip(self.names, self.shards, self._meta)}
        ### END SOLUTION
