"""Chapter 06: tensor parallelism by hand, checked against the dense layers on every rank.

Every rank builds the same dense layers and the same input from a fixed seed, keeps its shard of the weights
and runs the tensor-parallel version. Each case logs how far the parallel results are from the dense ones,
and every collective started in forward and in backward (op, bytes), counted by wrapping torch.distributed's
all_reduce and all_gather:
  column     Y = X Wᵀ + b, W split by output features (rows of W); the slices all-gathered
  row        Y = X Wᵀ + b, W split by input features (columns of W), X split the same way; partial sums all-reduced
  mlp        Megatron's MLP: f, column-parallel fc1, GELU, row-parallel fc2, g; forward and backward
  mlp-no-f   the same without f: each rank's input gradient is only its own part of the sum
  attention  causal self-attention, heads split over the ranks: column-parallel QKV, row-parallel output projection
f and g are exercise ex06's CopyToParallel and ReduceFromParallel, from --impl (the learner's file). While they
raise NotImplementedError the reference solution stands in; in a student release the three block cases are left
out until they are written, and the "impl" record says which ran.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gpucourse import exercises, runtime

GROUP = None  # f and g communicate over every rank (the default group)


class CommCounter:
    """Wraps dist.all_reduce and dist.all_gather: while `phase` is set, records (phase, op, bytes) of each call.

    Sizes follow nccl-tests: an all_reduce's buffer, an all_gather's whole output (every rank's slice).
    """

    def __init__(self):
        self.calls, self.phase = [], None
        for op in ("all_reduce", "all_gather"):
            setattr(dist, op, self._counted(op, getattr(dist, op)))

    def _counted(self, op, real):
        def counted(first, *args, **kwargs):
            if self.phase:
                tensors = first if op == "all_gather" else [first]  # all_gather(output list, input)
                self.calls.append({"phase": self.phase, "op": op,
                                   "bytes": sum(t.numel() * t.element_size() for t in tensors)})
            return real(first, *args, **kwargs)

        return counted

    def take(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


# --- the conjugate operators f and g (Megatron-LM, Shoeybi et al. 2019): exercise ex06's -----------------
def probe_f_and_g(impl) -> None:
    """f's backward and g's forward once, on one number: raises NotImplementedError while either is a stub."""
    x = torch.ones(1, requires_grad=True)
    impl.CopyToParallel.apply(x, GROUP).sum().backward()
    impl.ReduceFromParallel.apply(x.detach(), GROUP)


def gather_last(y: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y.contiguous())
    return torch.cat(parts, dim=-1)


def my_part(n_features: int) -> slice:
    """This rank's block of n_features, in rank order."""
    per = n_features // dist.get_world_size()
    return slice(dist.get_rank() * per, (dist.get_rank() + 1) * per)


def shard(t: torch.Tensor, part: slice, dim: int) -> nn.Parameter:
    return nn.Parameter(t.detach().narrow(dim, part.start, part.stop - part.start).clone())


def max_diff(a, b) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


# --- the cases -------------------------------------------------------------------------------------
def case_column(x, h, ffn, counter):
    dense = nn.Linear(h, ffn)
    cols = my_part(ffn)
    w, b = shard(dense.weight, cols, 0), shard(dense.bias, cols, 0)  # rows of W: output features
    counter.phase = "forward"
    y_local = F.linear(x, w, b)  # (batch, seq, ffn / N): this rank's output features
    y = gather_last(y_local)
    counter.phase = None
    return {"diffs": {"Y (gathered)": max_diff(y, dense(x)), "Y slice": max_diff(y_local, dense(x)[..., cols])},
            "shapes": {"W": list(dense.weight.shape), "W shard": list(w.shape), "Y shard": list(y_local.shape)},
            "calls": counter.take()}


def case_row(x_full, h, ffn, counter):
    dense = nn.Linear(ffn, h)
    rows = my_part(ffn)
    w = shard(dense.weight, rows, 1)  # columns of W: input features
    x = x_full[..., rows]  # this rank's input features
    counter.phase = "forward"
    partial = F.linear(x, w)  # X_r W_rᵀ: one term of the sum
    y = partial.clone()
    dist.all_reduce(y)
    y = y + dense.bias  # once, after the sum
    counter.phase = None
    return {"diffs": {"Y": max_diff(y, dense(x_full)),
                      "one rank's partial vs Y": max_diff(partial + dense.bias, dense(x_full))},
            "shapes": {"W": list(dense.weight.shape), "W shard": list(w.shape), "X shard": list(x.shape)},
            "calls": counter.take()}


class DenseMLP(nn.Module):
    def __init__(self, h, ffn):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TPMLP(nn.Module):
    """Column-parallel fc1, GELU on this rank's slice, row-parallel fc2: f before, g after."""

    def __init__(self, dense: DenseMLP, impl, use_f: bool = True):
        super().__init__()
        part = my_part(dense.fc1.out_features)
        self.w1, self.b1 = shard(dense.fc1.weight, part, 0), shard(dense.fc1.bias, part, 0)
        self.w2, self.b2 = shard(dense.fc2.weight, part, 1), nn.Parameter(dense.fc2.bias.detach().clone())
        self.f, self.g = (impl.CopyToParallel if use_f else None), impl.ReduceFromParallel

    def forward(self, x):
        if self.f:
            x = self.f.apply(x, GROUP)
        z = F.gelu(F.linear(x, self.w1, self.b1))  # (…, ffn / N): no communication needed for GELU
        return self.g.apply(F.linear(z, self.w2), GROUP) + self.b2


def grads_vs_dense(tp: TPMLP, dense: DenseMLP) -> dict:
    part = my_part(dense.fc1.out_features)
    return {"fc1.weight.grad": max_diff(tp.w1.grad, dense.fc1.weight.grad[part]),
            "fc1.bias.grad": max_diff(tp.b1.grad, dense.fc1.bias.grad[part]),
            "fc2.weight.grad": max_diff(tp.w2.grad, dense.fc2.weight.grad[:, part]),
            "fc2.bias.grad": max_diff(tp.b2.grad, dense.fc2.bias.grad)}


def case_mlp(x, gy, h, ffn, counter, impl, use_f=True):
    dense = DenseMLP(h, ffn)
    xd = x.clone().requires_grad_()
    dense(xd).backward(gy)
    tp, xs = TPMLP(dense, impl, use_f), x.clone().requires_grad_()
    counter.phase = "forward"
    y = tp(xs)
    counter.phase = "backward"
    y.backward(gy)
    counter.phase = None
    return {"diffs": {"Y": max_diff(y, dense(x)), "x.grad": max_diff(xs.grad, xd.grad), **grads_vs_dense(tp, dense)},
            "calls": counter.take()}


class DenseAttention(nn.Module):
    """Causal multi-head self-attention: one QKV projection, one output projection."""

    def __init__(self, h, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(attend(q, k, v, self.heads))


def attend(q, k, v, heads):
    """(batch, seq, heads·d) each → causal attention per head → (batch, seq, heads·d)."""
    b, s, hd = q.shape
    split = lambda t: t.view(b, s, heads, hd // heads).transpose(1, 2)  # noqa: E731
    o = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
    return o.transpose(1, 2).reshape(b, s, hd)


class TPAttention(nn.Module):
    """This rank's heads: the rows of Wq, Wk, Wv that produce them (column-parallel), the matching columns of
    the output projection (row-parallel). Attention itself needs nothing from the other heads."""

    def __init__(self, dense: DenseAttention, impl):
        super().__init__()
        self.f, self.g = impl.CopyToParallel, impl.ReduceFromParallel
        h = dense.out.in_features
        self.heads = dense.heads // dist.get_world_size()
        part = my_part(h)
        w, b = dense.qkv.weight.detach(), dense.qkv.bias.detach()  # [Wq; Wk; Wv], each h rows
        self.w_qkv = nn.Parameter(torch.cat([wi[part] for wi in w.chunk(3, dim=0)]))
        self.b_qkv = nn.Parameter(torch.cat([bi[part] for bi in b.chunk(3, dim=0)]))
        self.w_out, self.b_out = shard(dense.out.weight, part, 1), nn.Parameter(dense.out.bias.detach().clone())

    def forward(self, x):
        q, k, v = F.linear(self.f.apply(x, GROUP), self.w_qkv, self.b_qkv).chunk(3, dim=-1)
        return self.g.apply(F.linear(attend(q, k, v, self.heads), self.w_out), GROUP) + self.b_out


def case_attention(x, gy, h, heads, counter, impl):
    dense = DenseAttention(h, heads)
    xd = x.clone().requires_grad_()
    dense(xd).backward(gy)
    tp, xs = TPAttention(dense, impl), x.clone().requires_grad_()
    counter.phase = "forward"
    y = tp(xs)
    counter.phase = "backward"
    y.backward(gy)
    counter.phase = None
    part = my_part(h)
    wq_grad = torch.cat([g[part] for g in dense.qkv.weight.grad.chunk(3, dim=0)])
    return {"diffs": {"Y": max_diff(y, dense(x)), "x.grad": max_diff(xs.grad, xd.grad),
                      "qkv.weight.grad": max_diff(tp.w_qkv.grad, wq_grad),
                      "out.weight.grad": max_diff(tp.w_out.grad, dense.out.weight.grad[:, part])},
            "heads_per_rank": tp.heads, "calls": counter.take()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default=str(exercises.exercises_dir() / "ex06_tensor_parallel.py"),
                        help="the file defining CopyToParallel and ReduceFromParallel (exercise ex06)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    ctx = runtime.setup(seed=0)
    n, h, ffn = ctx.world_size, args.hidden, 4 * args.hidden
    for name, size in (("hidden", h), ("heads", args.heads)):
        if size % n:
            raise ValueError(f"--{name} {size} is not divisible by the world size {n}: choose a multiple of {n}")
    impl, source = exercises.load_for_chapter(args.impl, "ex06_tensor_parallel", probe_f_and_g)
    runtime.log(case="impl", source=source)
    counter = CommCounter()
    gen = torch.Generator().manual_seed(1)  # the same input and upstream gradient on every rank
    x = torch.randn(args.batch, args.seq, h, generator=gen)
    gy = torch.randn(args.batch, args.seq, h, generator=gen)
    x_ffn = torch.randn(args.batch, args.seq, ffn, generator=gen)
    activation_bytes = x.numel() * x.element_size()
    cases = {"column": lambda: case_column(x, h, ffn, counter),
             "row": lambda: case_row(x_ffn, h, ffn, counter)}
    if impl is not None:  # the blocks need f and g
        cases |= {"mlp": lambda: case_mlp(x, gy, h, ffn, counter, impl),
                  "mlp-no-f": lambda: case_mlp(x, gy, h, ffn, counter, impl, use_f=False),
                  "attention": lambda: case_attention(x, gy, h, args.heads, counter, impl)}
    for case, run in cases.items():
        torch.manual_seed(2)  # the same dense weights on every rank
        runtime.log(case=case, activation_bytes=activation_bytes, batch=args.batch, seq=args.seq, hidden=h,
                    ffn=ffn, **run())
    if ctx.rank == 0:
        print(f"{n} rank(s): {len(cases)} cases checked against the dense layers; f and g: {source}", flush=True)
    runtime.teardown()


if __name__ == "__main__":
    main()
