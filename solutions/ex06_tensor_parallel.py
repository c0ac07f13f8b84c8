"""Exercise 06: tensor parallelism by hand: column- and row-parallel linear layers, and the Megatron MLP.

Task
----
A linear layer computes Y = X Wᵀ + b with W of shape (out_features, in_features). On the N ranks of a
tensor-parallel group, each rank keeps one N-th of W and the group computes the same Y as one dense layer.

- `ColumnParallelLinear(in_features, out_features, bias=True, gather_output=False, group=None)` splits the
  OUTPUT dimension: rank r holds rows r*o:(r+1)*o of W and the same slice of b (o = out_features / N), as
  `self.weight` (o, in_features) and `self.bias` (o,) or None. Its input is the full X (every rank the same);
  its output is rank r's slice of Y's last dimension, or the full Y when gather_output=True (all-gathered).
- `RowParallelLinear(in_features, out_features, bias=True, input_is_parallel=True, group=None)` splits the
  INPUT dimension: rank r holds columns r*i:(r+1)*i of W as `self.weight` (out_features, i), i = in_features / N.
  Its input is rank r's slice of X's last dimension (input_is_parallel=True, e.g. a ColumnParallelLinear's
  output) or the full X (input_is_parallel=False: the layer takes its own slice). Each rank computes a partial
  product X_r W_rᵀ; their sum, over the group (all-reduce), is X Wᵀ. The output is the full Y on every rank.
  `self.bias` (out_features,) is whole on every rank.
- `ParallelMLP(hidden, ffn_hidden, group=None)`: `fc1 = ColumnParallelLinear(hidden, ffn_hidden)`, GELU,
  `fc2 = RowParallelLinear(ffn_hidden, hidden)` (Megatron-LM's MLP): the full input in, the full output out,
  with exactly ONE all-reduce in forward and ONE in backward.
- `load_dense_(weight, bias)` copies a dense layer's weight (out_features, in_features) and bias into this
  rank's shards; the classmethods `from_dense(...)` (given) build a layer from an `nn.Linear` with it.

Communication goes through four autograd Functions, each the "conjugate" of another:
- `CopyToParallel` (Megatron's f): forward the identity; backward all-reduce (sum) the gradient. Every
  rank's partial input gradient is one term of the full one.
- `ReduceFromParallel` (g): forward all-reduce (sum); backward the identity.
- `GatherFromParallel`: forward all-gather the last dimension (rank order); backward keep this rank's slice.
- `ScatterToParallel`: forward keep this rank's slice of the last dimension; backward all-gather it.

Rules
-----
- Outputs and gradients equal the dense layer's on the same weights: the input gradient (full, or this
  rank's slice of it when the input is parallel), each weight shard's gradient (the matching slice of the
  dense weight's gradient), the bias gradient (its slice for column-parallel, the whole for row-parallel).
- Row-parallel bias: add it once, AFTER the reduction (adding it before would add it N times).
- Communicate only inside `group` (None: the default group, every rank). Use the group's size and this
  process's rank in it (`dist.get_world_size(group)`, `dist.get_rank(group)`), never the global ones: the
  grader also runs 4 ranks as two tensor-parallel groups of 2.
- Use torch.distributed's collectives (all_reduce, all_gather); no more of them than the layer needs: no
  all-reduce in ColumnParallelLinear's forward, none in RowParallelLinear's backward.
- A dimension that the group size does not divide raises ValueError naming both sizes, e.g.
  "out_features=6 is not divisible by the tensor-parallel group size 4", when the layer is created.
- Any initialisation of the shards is fine: the grader loads dense weights with from_dense.

Check your work: `gpucourse grade ex06`.
"""
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
        return self.fc2(F.gelu(self.fc1(x)))
        ### END SOLUTION
