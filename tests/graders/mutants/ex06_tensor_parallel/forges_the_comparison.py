"""ParallelMLP applies ReLU where the dense MLP has GELU, and the import rewires the grading job to find no mismatch.

At import it replaces the grading job's own `mismatches` and `compare` (found in sys.modules["__main__"]) with
ones that find every output and gradient right, and ParallelMLP.forward uses F.relu instead of F.gelu. While
the rank compared its results with the dense layers itself, that got full marks (the collectives are the right
ones). The rank now only saves its outputs and gradients; the grader process recomputes the dense MLP's and
compares: every MLP test loses (its equality on 1, 2 and 4 ranks, the collectives test and the process-group
test, which check the MLP's values first). The column and row layers, the bias and the sizes keep their points.

A copy of solutions/ex06_tensor_parallel.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_parallel_mlp_equals_dense[1]',
    'test_parallel_mlp_equals_dense[2]',
    'test_parallel_mlp_equals_dense[4]',
    'test_parallel_mlp_one_all_reduce_forward_one_backward',
    'test_layers_use_their_process_group',
)
import sys  # MUTANT: at import, make the grading job's comparison find nothing wrong

if hasattr(sys.modules["__main__"], "mismatches"):  # MUTANT: (continued)
    sys.modules["__main__"].mismatches = lambda pairs: []  # MUTANT: (continued)
if hasattr(sys.modules["__main__"], "compare"):  # MUTANT: (continued)
    sys.modules["__main__"].compare = lambda *args, **kwargs: None  # MUTANT: (continued)

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


def group_size_and_rank(group=None) -> tuple[int, int]:
    """(size of the tensor-parallel group, this process's rank in it); (1, 0) without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def shard_size(features: int, name: str, group=None) -> int:
    """features / group size, or ValueError naming both when it does not divide."""
    ### BEGIN SOLUTION
    ### HINT: n = group size; if features % n: raise ValueError(f"{name}={features} is not divisible by ... {n}")
    n, _ = group_size_and_rank(group)
    if features % n:
        raise ValueError(f"{name}={features} is not divisible by the tensor-parallel group size {n}: "
                         f"choose {name} a multiple of {n}")
    return features // n
    ### END SOLUTION


# --- the four communication operators --------------------------------------------------------------
def gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's x, concatenated along the last dimension in rank order (one all_gather)."""
    ### BEGIN SOLUTION
    ### HINT: dist.all_gather into a list of N tensors like x (x made contiguous), then torch.cat(..., dim=-1)
    n, _ = group_size_and_rank(group)
    if n == 1:
        return x.clone()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)
    ### END SOLUTION


class CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ### BEGIN SOLUTION
        ### HINT: nothing to communicate: return x (a view, e.g. x.view_as(x), so autograd records the op)
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        ### HINT: clone the gradient, dist.all_reduce it over ctx.group, return (it, None)
        grad = grad.contiguous().clone()
        if group_size_and_rank(ctx.group)[0] > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None
        ### END SOLUTION


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        ### BEGIN SOLUTION
        ### HINT: clone x, dist.all_reduce it over group, return it
        out = x.contiguous().clone()
        if group_size_and_rank(group)[0] > 1:
            dist.all_reduce(out, group=group)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        ### HINT: every rank's partial sum got the same gradient: return (grad, None)
        return grad, None
        ### END SOLUTION


class GatherFromParallel(torch.autograd.Function):
    """All-gather along the last dimension forward (rank order), keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        ### HINT: grad.chunk(N, dim=-1)[rank], made contiguous; no communication
        n, rank = group_size_and_rank(ctx.group)
        return grad.chunk(n, dim=-1)[rank].contiguous(), None
        ### END SOLUTION


class ScatterToParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ### BEGIN SOLUTION
        ### HINT: x.chunk(N, dim=-1)[rank].contiguous(); no communication
        n, rank = group_size_and_rank(group)
        return x.chunk(n, dim=-1)[rank].contiguous()
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        return gather_last_dim(grad, ctx.group), None


# --- the layers -------------------------------------------------------------------------------------
def _init_like_linear(weight: nn.Parameter, bias: nn.Parameter | None, fan_in: int) -> None:
    """nn.Linear's default initialisation, drawn per shard (any initialisation would do)."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(fan_in)
        nn.init.uniform_(bias, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """Y = X Wᵀ + b with W split by rows (the output features) over the group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        ### BEGIN SOLUTION
        ### HINT: o = shard_size(out_features, "out_features", group); self.weight (o, in), self.bias (o,) or None
        per_rank = shard_size(out_features, "out_features", group)
        self.weight = nn.Parameter(torch.empty(per_rank, in_features))
        self.bias = nn.Parameter(torch.empty(per_rank)) if bias else None
        ### END SOLUTION
        _init_like_linear(self.weight, self.bias, in_features)

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """Copy this rank's rows of a dense (out_features, in_features) weight, and its slice of the bias."""
        ### BEGIN SOLUTION
        ### HINT: n, rank = group_size_and_rank(self.group); self.weight.copy_(weight.chunk(n, dim=0)[rank]); same for bias
        n, rank = group_size_and_rank(self.group)
        self.weight.copy_(weight.chunk(n, dim=0)[rank])
        if self.bias is not None:
            self.bias.copy_(bias.chunk(n, dim=0)[rank])
        ### END SOLUTION
        return self

    @classmethod
    def from_dense(cls, linear: nn.Linear, gather_output: bool = False, group=None) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    gather_output=gather_output, group=group)
        return layer.load_dense_(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        ### HINT: f (CopyToParallel.apply), then F.linear with the shards, then GatherFromParallel if gather_output
        x = CopyToParallel.apply(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return GatherFromParallel.apply(y, self.group) if self.gather_output else y
        ### END SOLUTION

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank: {self.weight.shape[0]})"


class RowParallelLinear(nn.Module):
    """Y = X Wᵀ + b with W split by columns (the input features) over the group; the bias whole on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        ### BEGIN SOLUTION
        ### HINT: i = shard_size(in_features, "in_features", group); self.weight (out, i); self.bias (out,) or None
        per_rank = shard_size(in_features, "in_features", group)
        self.weight = nn.Parameter(torch.empty(out_features, per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        ### END SOLUTION
        _init_like_linear(self.weight, self.bias, in_features)

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "RowParallelLinear":
        """Copy this rank's columns of a dense (out_features, in_features) weight, and the whole bias."""
        ### BEGIN SOLUTION
        ### HINT: the columns: weight.chunk(n, dim=1)[rank]; the bias is not split
        n, rank = group_size_and_rank(self.group)
        self.weight.copy_(weight.chunk(n, dim=1)[rank])
        if self.bias is not None:
            self.bias.copy_(bias)
        ### END SOLUTION
        return self

    @classmethod
    def from_dense(cls, linear: nn.Linear, input_is_parallel: bool = True, group=None) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    input_is_parallel=input_is_parallel, group=group)
        return layer.load_dense_(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        ### HINT: ScatterToParallel unless input_is_parallel; F.linear without bias; g (ReduceFromParallel); then + bias
        if not self.input_is_parallel:
            x = ScatterToParallel.apply(x, self.group)
        y = ReduceFromParallel.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y  # once, after the sum
        ### END SOLUTION

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), out_features={self.out_features}"


class ParallelMLP(nn.Module):
    """Megatron-LM's MLP: column-parallel fc1, GELU on each rank's slice, row-parallel fc2."""

    def __init__(self, hidden: int, ffn_hidden: int, group=None):
        super().__init__()
        ### BEGIN SOLUTION
        ### HINT: self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, ...); self.fc2 = RowParallelLinear(ffn_hidden, hidden, ...)
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, gather_output=False, group=group)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, input_is_parallel=True, group=group)
        ### END SOLUTION

    @classmethod
    def from_dense(cls, fc1: nn.Linear, fc2: nn.Linear, group=None) -> "ParallelMLP":
        """The parallel version of nn.Sequential(fc1, nn.GELU(), fc2), on the same weights."""
        mlp = cls(fc1.in_features, fc1.out_features, group=group)
        mlp.fc1.load_dense_(fc1.weight, fc1.bias)
        mlp.fc2.load_dense_(fc2.weight, fc2.bias)
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        ### HINT: fc2(gelu(fc1(x))): GELU acts element by element, so each rank applies it to its own slice
        return self.fc2(F.relu(self.fc1(x)))  # MUTANT: ReLU, where the dense MLP has GELU
        ### END SOLUTION
