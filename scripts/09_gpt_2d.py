"""Chapter 09: a small GPT trained on a 2D mesh, data parallel x tensor parallel, with PyTorch's own APIs.

    torchrun --nproc-per-node 4 scripts/09_gpt_2d.py --dp 2 --tp 2     # 4 ranks: 2 DP groups of 2 TP ranks
    python scripts/09_gpt_2d.py                                         # the 1-rank reference (dp = tp = 1)

The mesh (init_device_mesh) has two named dimensions: "tp" ranks share every layer (parallelize_module:
q/k/v and fc column-parallel, out and proj row-parallel, Megatron style), "dp" groups see different data
(FSDP2 fully_shard over mesh["dp"], or --dp-mode allreduce: a plain gradient all-reduce over the dp group).
Every rank builds the model from the same seed before parallelizing, and every step draws the same global
batch on every rank; each dp group trains on its slice. So the run computes what one process would on the
whole batch, and the per-step losses can be compared with the 1-rank run.

Records: first the all-reduces each block issued in one forward and one backward (CommDebugMode, before
training; that step's gradients are dropped), then one per step (loss averaged over the global batch, step
seconds), then a summary: tokens/s over the
timed steps, bytes of parameters, gradients and optimizer state held by this rank (DTensor local shards),
validation loss, a text sample. --profile N profiles N more steps (traces/rank<r>.json for gpucourse.models.traces).
The same script runs on GPUs: the runtime picks NCCL and cuda:<local rank>; --dtype auto trains in bf16 there.
"""
import argparse
import math
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from gpucourse import costs, runtime

# Printed by every rank and harmless here: the logits FSDP2 returns as a view are never changed in place, and the
# backward hooks CommDebugMode puts on the model see its only input, token ids, needing no gradient.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect")

DATA = Path(__file__).resolve().parents[1] / "data" / "macbeth.txt"


# --- data: characters are the tokens ---------------------------------------------------------------
class CharData:
    """The corpus as a tensor of character ids; 90 % for training, the last 10 % for validation."""

    def __init__(self, path: Path):
        text = Path(path).read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        split = int(0.9 * len(ids))
        self.train, self.val = ids[:split], ids[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, split: str, batch: int, context: int, seed: int):
        """`batch` random windows (inputs, next-character targets). The same seed gives the same batch on
        every rank: that is what lets each dp group take its slice of one global batch."""
        ids = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(ids) - context - 1, (batch,), generator=gen)
        windows = starts[:, None] + torch.arange(context + 1)  # indexed on the tensor: no value read on the host,
        return ids[windows[:, :-1]], ids[windows[:, 1:]]  # so a fake-tensor dry run (no values) runs it too


# --- the model: nanoGPT, with q/k/v as three Linears so that each can be split by columns --------------
class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, _ = x.shape
        # Under TP, q/k/v are column-parallel: each rank gets d_model / tp features, i.e. n_heads / tp whole
        # heads. Reshaping with -1 heads (not n_heads) makes the same code right for any tp.
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))  # row-parallel: sums the heads' shares


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), Attention(d_model, n_heads)
        self.ln2, self.mlp = nn.LayerNorm(d_model), MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, context: int, d_model: int = 64, n_heads: int = 4, layers: int = 2):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"--d-model {d_model} is not a multiple of --heads {n_heads}: pick sizes that divide")
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab_size, d_model), nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)  # nanoGPT's (and GPT-2's) initialisation
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def matmul_params(model: nn.Module) -> int:
    """Parameters that take part in matrix products: the Linear weights (the output head included). Embedding
    tables are looked up, not multiplied; biases and norms add no matrix products."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def flops_per_token(model: GPT, causal: bool = False) -> float:
    """Model FLOPs per trained token, PaLM appendix B: 6 N + 12 L d T (gpucourse.models.costs.model_flops_per_token).
    causal=True counts only the unmasked half of attention's work, the useful part of a causal model."""
    return costs.model_flops_per_token(matmul_params(model), len(model.blocks), model.tok.embedding_dim,
                                       model.context, causal=causal)


# --- the 2D parallelization ----------------------------------------------------------------------------
def apply_tp(model: GPT, tp_mesh) -> None:
    """Megatron-style TP inside each block. Forward: two all-reduces (after the row-parallel out and proj).
    Backward: one per column-parallel layer, for the gradient of its replicated input: q, k, v and fc, four.
    (Megatron fuses q, k and v into one column-parallel layer: two.) count_block_all_reduces counts them.
    Embeddings, LayerNorms and the head stay replicated on the tp ranks (they are small here)."""
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def count_block_all_reduces(model: GPT, x, y, autocast) -> list[dict]:
    """[{"forward": n, "backward": m}] per block: the all-reduces DTensor issued inside it in one forward and
    backward of (x, y), counted per module by CommDebugMode. The gradients are dropped afterwards."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        with autocast():
            _, loss = model(x, y)
        loss.backward()
    model.zero_grad(set_to_none=True)
    all_reduce = torch.ops.c10d_functional.all_reduce  # what DTensor's all-reduces are counted as
    counts = comm.comm_module_counts  # module path ("GPT.blocks.0", ...) -> {"forward"/"backward": {op: count}}
    blocks = [next((c for name, c in counts.items() if name.endswith(f".blocks.{i}")), {})
              for i in range(len(model.blocks))]
    return [{phase: block.get(phase, {}).get(all_reduce, 0) for phase in ("forward", "backward")} for block in blocks]


def apply_dp(model: GPT, mesh, mode: str) -> None:
    """FSDP2 over the dp dimension: parameters (already TP-sharded) are sharded again over dp; gradients are
    reduce-scattered, i.e. averaged over the dp groups. "allreduce" leaves the parameters whole on the dp
    ranks and averages the gradients after backward (sync_grads)."""
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def sync_grads(model: nn.Module, mesh) -> None:
    """--dp-mode allreduce: average every gradient over the dp group (the tp ranks' shards stay as they are)."""
    group = mesh["dp"].get_group()
    for p in model.parameters():
        if p.grad is not None:
            g = local(p.grad)
            dist.all_reduce(g, group=group)
            g /= mesh["dp"].size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Bytes this rank holds for parameters, gradients and optimizer state (DTensors: local shards only)."""
    size = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"param_bytes": size(params), "grad_bytes": size(p.grad for p in params if p.grad is not None),
            "optim_bytes": size(states)}


# --- training ------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (dp * tp = world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size; must divide --heads")
    p.add_argument("--dp-mode", choices=["fsdp", "allreduce"], default="fsdp")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (split over the dp groups)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the throughput")
    p.add_argument("--profile", type=int, default=0, help="profile this many extra steps (0: no trace)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bf16 autocast on a GPU, float32 on the CPU")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches at the end (0: none)")
    p.add_argument("--sample", type=int, default=200, help="characters to generate at the end (0: none)")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (its first steps then include the compilation: keep them in warmup)")
    p.add_argument("--fused-optimizer", action="store_true",
                   help="AdamW(fused=True): one kernel for the whole update (default: the per-tensor path)")
    return p.parse_args(argv)


def check_sizes(args, world_size: int) -> None:
    if args.dp * args.tp != world_size:
        raise ValueError(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp}, but the job has {world_size} "
                         f"ranks: launch dp*tp processes")
    if args.heads % args.tp or args.d_model % args.heads:
        raise ValueError(f"--tp {args.tp} must divide --heads {args.heads}, and --heads --d-model {args.d_model}: "
                         "each tp rank takes whole heads")
    if args.batch % args.dp:
        raise ValueError(f"--batch {args.batch} is not a multiple of --dp {args.dp}: each dp group takes an "
                         "equal slice of the global batch")


def train_step(model, opt, data, args, step, mesh, autocast):
    """One optimizer step on this dp group's slice of global batch `step`; returns the global-batch loss."""
    x, y = data.batch("train", args.batch, args.context, seed=args.seed * 100_003 + step)
    dp_rank, per_group = mesh["dp"].get_local_rank(), args.batch // args.dp
    rows = slice(dp_rank * per_group, (dp_rank + 1) * per_group)
    device = runtime.context().device
    with autocast():
        _, loss = model(x[rows].to(device), y[rows].to(device))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if args.dp_mode == "allreduce" and args.dp > 1:
        sync_grads(model, mesh)
    opt.step()
    mean = loss.detach().float().clone()
    dist.all_reduce(mean, group=mesh["dp"].get_group())  # the groups' means -> the global batch's mean
    return runtime.value(mean / args.dp)  # None in a dry run (gpucourse dryrun), where values mean nothing


@torch.no_grad()
def evaluate(model, data, args, autocast, batches: int) -> float | None:
    """Validation loss on the same `batches` x `--batch` windows on every rank (all of them); None in a dry run."""
    device, losses = runtime.context().device, []
    for i in range(batches):
        x, y = data.batch("val", args.batch, args.context, seed=10_000 + i)
        with autocast():
            losses.append(runtime.value(model(x.to(device), y.to(device))[1].float()))
    return None if None in losses else sum(losses) / len(losses)


@torch.no_grad()
def sample(model, data, args, n: int, autocast) -> str:
    """Random sampling from the softmax, the same on every rank (same generator): the tp ranks must all run
    the same forwards, or their collectives would not match."""
    device, gen = runtime.context().device, torch.Generator().manual_seed(args.seed)
    idx = torch.tensor([[data.stoi["\n"]]], device=device)
    for _ in range(n):
        with autocast():
            logits = model(idx[:, -args.context:])[0][0, -1].float()
        nxt = torch.multinomial(F.softmax(logits, -1).cpu(), 1, generator=gen).to(device)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return data.decode(idx[0, 1:].tolist())


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = runtime.setup(seed=args.seed, seed_per_rank=False)  # the same seed on every rank: the same init
    check_sizes(args, ctx.world_size)
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # one thread per rank, on 1 rank too: the ranks share the cores
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and ctx.device.type == "cuda")
    autocast = lambda: torch.autocast(ctx.device.type, torch.bfloat16, enabled=bf16)  # noqa: E731
    mesh = init_device_mesh(ctx.device.type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    data = CharData(args.data)
    model = GPT(data.vocab_size, args.context, args.d_model, args.heads, args.layers).to(ctx.device)
    n_params, fpt = sum(p.numel() for p in model.parameters()), flops_per_token(model)
    apply_tp(model, mesh["tp"])
    apply_dp(model, mesh, args.dp_mode)
    # foreach=False: the per-tensor path, which takes any mix of plain tensors and DTensors. The fused kernel
    # takes one kind per call, and AdamW calls it once per parameter group: DTensors and plain tensors apart.
    params = list(model.parameters())
    groups = [g for g in ([p for p in params if isinstance(p, DTensor)], [p for p in params
                                                                          if not isinstance(p, DTensor)]) if g]
    opt = (torch.optim.AdamW([{"params": g} for g in groups], lr=args.lr, weight_decay=0.0, fused=True)
           if args.fused_optimizer else torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, foreach=False))
    runtime.log(header=True, dp=args.dp, tp=args.tp, dp_mode=args.dp_mode, params=n_params, flops_per_token=fpt,
                vocab=data.vocab_size, global_batch=args.batch, context=args.context, device=str(ctx.device),
                backend=ctx.backend, world_size=ctx.world_size, bf16=bf16, train_chars=len(data.train),
                **{k: True for k, on in (("compiled", args.compile), ("fused_optimizer", args.fused_optimizer)) if on})
    x, y = data.batch("train", args.batch // args.dp, args.context, seed=0)  # any batch: the counts do not vary
    runtime.log(block_all_reduces=count_block_all_reduces(model, x.to(ctx.device), y.to(ctx.device), autocast))
    if args.compile:  # after the count: a first call under CommDebugMode (a dispatch mode) made Dynamo skip it for good
        model.compile()  # in place: the module (and its parameters, state_dict) stays the one built above

    timed = 0.0
    cuda = ctx.device.type == "cuda"
    for step in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # each step's own allocator peak (what a dry run predicts)
        start = time.perf_counter()
        loss = train_step(model, opt, data, args, step, mesh, autocast)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        timed += seconds if step >= args.warmup_steps else 0.0
        runtime.log(step=step, total=args.steps, loss=loss, seconds=seconds,
                    **({"cuda_peak_bytes": torch.cuda.max_memory_allocated()} if cuda else {}))
    timed_steps = max(args.steps - args.warmup_steps, 0)
    tokens_per_s = timed_steps * args.batch * args.context / timed if timed > 0 else math.nan
    memory = state_bytes(model, opt)  # now, while the gradients of the last step are still there

    if args.profile:
        with runtime.profile(wait=0, warmup=1, active=args.profile) as prof:
            for i in range(args.profile + 1):
                train_step(model, opt, data, args, args.steps + i, mesh, autocast)
                prof.step()

    val = evaluate(model, data, args, autocast, args.eval_batches) if args.eval_batches else math.nan
    text = sample(model, data, args, args.sample, autocast) if args.sample and not runtime.dry_run() else ""
    runtime.log(summary=True, tokens_per_s=tokens_per_s, timed_steps=timed_steps, timed_seconds=timed,
                val_loss=val, sample=text, **memory)
    if ctx.rank == 0 and not runtime.dry_run():
        print(f"dp={args.dp} tp={args.tp} ({args.dp_mode}) on {ctx.world_size} rank(s), {ctx.backend}/"
              f"{ctx.device.type}: {tokens_per_s:,.0f} tokens/s, final loss {loss:.3f}"
              + (f", val {val:.3f}" if args.eval_batches else ""), flush=True)
    runtime.teardown()


if __name__ == "__main__":
    main()
