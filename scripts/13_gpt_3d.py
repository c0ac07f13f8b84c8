"""Chapter 13: the capstone GPT on a 3-D mesh, pipeline x FSDP x tensor parallel, equal to one process.

    torchrun --nproc-per-node 8 scripts/13_gpt_3d.py --pp 2 --dp 2 --tp 2      # 8 ranks, float64, checked
    python scripts/13_gpt_3d.py                                                  # 1 rank: pp = dp = tp = 1
    gpucourse dryrun scripts/13_gpt_3d.py --world 8 --fake-tensors -- --pp 2 --dp 2 --tp 2   # ranks 0 and 7, no peers
    python benchmarks/dryrun_llama3_405b.py    # --arch llama at Llama 3 405B's shape, 16,384 ranks, ranks 0 and 16,383

--arch llama makes it a Llama 3-style model (RMSNorm, a SwiGLU MLP of --ffn, grouped-query attention with
--kv-heads, rotary positions and no position table, an untied head; Meta's and torchtitan's names), tensor-parallel
by torchtitan's plan (the token embedding row-parallel over the vocabulary too); --split llama3 gives the first and
the last stage one block fewer than the others, as Llama 3 did for the embedding's memory and the head's and loss's
time (126 layers on 16 stages: 7, 8 x 14, 7; the Llama 3 paper, section 3.3.2, "Pipeline parallelism
improvements"); --vocab draws random tokens from a vocabulary that large (128,256); --dtype bfloat16 holds
parameters, gradients and Adam's states in bf16 (the planner's recipe "bf16"). The check holds for it as for the
GPT: float64 at world 4 (pp 2 x tp 2) and 8 (pp 4 x tp 2 split 1, 2, 2, 1; pp 2 x dp 2 x tp 2), differences below
1e-15.

The mesh (init_device_mesh) has three named dimensions, ("pp", "dp", "tp"), tp innermost. A rank's number is
pp_rank * dp * tp + dp_rank * tp + tp_rank, so the tp ranks of a group are neighbours (ranks 0-1, 2-3, ...) and the
pp ranks are the farthest apart (0 and 4). That is the order of how much each dimension talks: tensor parallelism
all-gathers and reduce-scatters activations inside every block, forward and backward, on the critical path, so its
ranks must share the fastest links (one node's NVLink); FSDP moves each parameter and gradient once a step, which
overlaps with compute; the pipeline sends one activation per micro-batch between neighbouring stages, the least of
all, and crosses the slowest links (between nodes). Megatron-LM and torchtitan lay their meshes out the same way.

How the three are composed, in torchtitan's order (torchtitan/distributed/pipeline_parallel.py, then each model's
parallelize function):
  1. pipeline split: every rank builds the whole model (same seed), then keeps only its stage's part: the
     embeddings on the first stage, blocks [s*L/pp, (s+1)*L/pp) on stage s, the final norm and head on the last.
     The blocks live in a ModuleDict keyed by their global number, so a stage's parameter names are the whole
     model's ("blocks.3.attn.q.weight"): that is how each gradient is compared with the one process's.
  2. tensor parallelism with sequence parallelism over mesh["tp"] (parallelize_module), on the stage's part:
     norms are SequenceParallel (each tp rank normalises its slice of the sequence); before attention and the MLP
     the sequence is all-gathered (PrepareModuleInput Shard(1) -> Replicate), q/k/v and fc are column-parallel,
     out and proj row-parallel with their outputs reduce-scattered back to sequence slices (Shard(1)).
  3. FSDP2 over mesh["dp"] (fully_shard, each block then the stage's root), on parameters TP has already split:
     FSDP shards the tp shards again. reshard_after_forward=False: with micro-batches, resharding after each
     forward would all-gather the parameters again for every micro-batch (torchtitan does the same under PP).
  4. the pipeline schedule (PipelineStage over mesh["pp"]'s group, ScheduleGPipe or Schedule1F1B) around the
     stage's part. The schedule knows FSDP: gradients are reduce-scattered once, after the last micro-batch's
     backward, and it divides them by the number of micro-batches (each micro-batch loss is a mean).

What crosses a stage boundary is each tp rank's slice of the sequence (micro_batch, context / tp, d_model), a plain
tensor: tp rank j of stage s sends to tp rank j of stage s+1, in its own pp group.

Where the loss is scaled: each micro-batch loss is a mean over its tokens; the schedule divides gradients by the m
micro-batches; FSDP's reduce-scatter averages over the dp groups. All micro-batches have the same size, so that is
the mean over the whole global batch: what one process computes. The loss the last stage logs is the mean of its
micro-batch losses, averaged over dp.

Gradient clipping (--clip-norm, off by default) needs the norm of the WHOLE model's gradient, and no rank holds it:
each rank sums the squares of the gradient shards it holds (a shard that every tp rank holds alike counted once,
as Megatron-LM does), and one all-reduce over every rank adds the stages, the dp shards and the tp shards at once.
torchtitan's first version summed over a stage only (torchtitan #596): the bug clip_norm_per_stage below.

The check (on by default, left out in a dry run): every rank also trains the unsplit model, in this process, in
float64, on the same global batches with the same optimizer, and compares each step's loss (last stage) and every
gradient it holds with it. A rank compares its own shard of each gradient with the same slice of the one process's
gradient (compute_local_shape_and_global_offset gives the slice): no communication, so the check adds nothing to
what the run communicates (what $GPUCOURSE_COUNT_FILE counts). Any difference above --tol (1e-10) fails the run,
after its summary.

What did not compose as-is on CPU/gloo in float64, and what is done instead (each says why where it is done):
  - the embeddings are not tensor-parallel: the token and position tables stay whole on the tp ranks, and their
    output is cut into sequence slices by DTensor (PrepareModuleOutput Replicate -> Shard(1)), so that backward
    all-gathers the slices' gradients and every tp rank computes the tables' whole gradient. (The capstone adds a
    learned position table; a row-parallel token embedding would need the position one cut the same way.)
  - each PipelineStage is given its shapes (input_args, output_args: stage_shapes) instead of finding them at the
    first step, where the stages run a forward and backward and send each other the shapes: under a dry run's fake
    process group nothing arrives. Then the schedule's opening vote (does every stage know its shapes?) is still
    sent and read with .item(): gpucourse's dry run lets each stage vote alone (run/fake.py, prepare_fake_group).
  - counting the run ($GPUCOURSE_COUNT_FILE: gpucourse's step counter, torch's MemTracker inside) made the later
    stages fail: MemTracker's module tracker hooks every module input that needs a gradient, and torch 2.13 refuses
    such a hook on a leaf inside autograd.grad, which is how a stage computes its received activation's gradient
    (smallest reproduction: Linear(4, 4) on a leaf x under ModTracker, then torch.autograd.grad(y, [x])). The
    counter's tracker now leaves leaf inputs alone (run/counting.py, LeafSafeModTracker).

With --arch llama, and for the dry run at Llama 3 405B's shape:
  - the key/value heads are not copied per query head: scaled_dot_product_attention(enable_gqa=True), whose CPU
    kernel and FlopCounterMode both take fewer key/value heads; --tp must divide --kv-heads (each tp rank holds
    whole key/value heads: 8 at Llama 3's shape, one a rank at tp 8).
  - no loss parallelism: the head's logits are gathered whole (as for the GPT), so the last stage keeps the whole
    bf16 logits and their log-softmax for one micro-batch (2 x 2.1 GB at Llama 3's shape) where Megatron-LM keeps
    1/tp of them. And schedule.step(return_outputs=False): by default torch's schedule keeps every micro-batch's
    output on the last stage and concatenates them at the end of the step (16 x 2.1 GB, then as much again).
  - the rotary tables are non-persistent buffers of the model, so each stage keeps its own (4 MB at 8,192 tokens).
  - the token embedding is row-parallel (torchtitan's plan; no position table to cut alike), but its weight's
    gradient comes out of DTensor's backward (2.13) Replicate: the whole table's gradient on every tp rank (4.2 GB
    at Llama 3's shape) until FSDP keeps the rank's shard; no collective, but a transient whole table.
  - what a fake-tensor dry run counts where a GPU would differ: nn.RMSNorm in bf16 on the CPU device computes in
    fp32 and keeps its input and product in fp32 for backward (CUDA's fused kernel keeps the bf16 input and rstd);
    and DTensor's sequence parallelism keeps the whole gathered input of the column-parallel layers (Megatron-LM
    keeps a 1/tp slice and gathers it again in backward): benchmarks/dryrun_llama3_405b.py says by how much.
  - every rank still builds the whole model before keeping its stage (the check needs the same initialisation):
    at 405 B parameters that is 810 GB of fake bf16 tensors, a few seconds, no memory; the first step's counts
    include it, so the dry run is read at its second step (--steps 2).

The model is chapter 09's (scripts/09_gpt_2d.py), copied because chapter scripts stand alone: the same blocks and
initialisation, with the blocks in a ModuleDict and the embeddings in a module of their own so that a stage can
drop what it does not run.
"""
import argparse
import copy
import math
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.nn import functional as F

from gpucourse import runtime

warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

DATA = Path(__file__).resolve().parents[1] / "data" / "macbeth.txt"
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


# --- data: characters are the tokens (chapter 09's) -----------------------------------------------------
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

    def batch(self, split: str, batch: int, context: int, seed: int):
        """`batch` random windows (inputs, next-character targets), the same on every rank for the same seed."""
        ids = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(ids) - context - 1, (batch,), generator=gen)
        windows = starts[:, None] + torch.arange(context + 1)  # indexed on the tensor: fake-tensor dry runs too
        return ids[windows[:, :-1]], ids[windows[:, 1:]]



class RandomTokens:
    """Token ids drawn uniformly from a vocabulary of `vocab_size` (--vocab: a model's real vocabulary, Llama 3's
    128,256, without its tokenizer or data), the same on every rank for the same seed."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def batch(self, split: str, batch: int, context: int, seed: int):
        gen = torch.Generator().manual_seed(seed + (split != "train"))
        ids = torch.randint(self.vocab_size, (batch, context + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]

# --- the model: chapter 09's GPT, cut so that a stage keeps only its part -------------------------------
class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: under TP a rank holds n_heads / tp whole heads (q/k/v column-parallel)
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


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


class Embed(nn.Module):
    """Token plus learned position embeddings (a module of its own: the first stage's)."""

    def __init__(self, vocab_size: int, context: int, d_model: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab_size, d_model), nn.Embedding(context, d_model)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    """Chapter 09's GPT. Each part may be None: a pipeline stage keeps only its own (forward skips the rest)."""

    def __init__(self, vocab_size: int, context: int, d_model: int = 64, n_heads: int = 4, layers: int = 4):
        super().__init__()
        self.context = context
        self.embed = Embed(vocab_size, context, d_model)
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_heads) for i in range(layers)})
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x):
        """Token ids -> logits on the whole model; a stage: its input (ids or activations) -> its output."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x



# --- or Llama's: RMSNorm, SwiGLU, grouped-query attention, rotary positions, an untied head (--arch llama) ----------
# Meta's and torchtitan's names (wq/wk/wv/wo, w1/w2/w3, attention_norm/ffn_norm); the containers keep the GPT's
# names (embed, blocks, ln_f, head) so that the pipeline split and the check are the same code for both.
def rotary_tables(head_dim: int, context: int, theta: float):
    """cos and sin of each position's angles (context, head_dim), the frequencies theta^(-2i/head_dim) repeated for
    the two halves of a head (the rotate-half form; Meta's code rotates interleaved pairs, the same rotation of a
    permuted head)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float64), inv)  # float64: positions up to 8,192 and more
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(torch.get_default_dtype()), angles.sin().to(torch.get_default_dtype())


def rotate(x, cos, sin):
    """Rotary position embedding of x (B, T, heads, head_dim): each pair (x_i, x_i+hd/2) turned by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class GQAttention(nn.Module):
    """Grouped-query attention: kv_heads key/value heads, each shared by heads / kv_heads query heads."""

    def __init__(self, d_model: int, n_heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.wq, self.wo = nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model, bias=False)
        self.wk, self.wv = (nn.Linear(d_model, kv_heads * self.head_dim, bias=False) for _ in range(2))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # -1 heads: under TP a rank holds heads / tp query heads and kv_heads / tp key/value heads
        q, k, v = (proj(x).view(B, T, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos[:T], sin[:T]), rotate(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)  # no copy of k and v per query head
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): three matrices, ffn wide."""

    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d_model, ffn, bias=False), nn.Linear(d_model, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """x + attention(rmsnorm(x)), then x + feed_forward(rmsnorm(x))."""

    def __init__(self, d_model: int, n_heads: int, kv_heads: int, ffn: int, eps: float):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(d_model, eps=eps), GQAttention(d_model, n_heads, kv_heads)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(d_model, eps=eps), SwiGLU(d_model, ffn)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A Llama 3-style model; like GPT, each part may be None on a pipeline stage. No position table: the rotary
    tables are non-persistent buffers (each stage keeps them), given to every block."""

    def __init__(self, vocab_size: int, context: int, d_model: int, n_heads: int, layers: int, kv_heads: int,
                 ffn: int, rope_theta: float = 500_000.0, eps: float = 1e-5):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleDict({str(i): LlamaBlock(d_model, n_heads, kv_heads, ffn, eps) for i in range(layers)})
        self.ln_f, self.head = nn.RMSNorm(d_model, eps=eps), nn.Linear(d_model, vocab_size, bias=False)
        cos, sin = rotary_tables(d_model // n_heads, context, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(GPT._init)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x, self.rope_cos, self.rope_sin)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def build_model(args, vocab_size: int) -> nn.Module:
    if args.arch == "llama":
        return Llama(vocab_size, args.context, args.d_model, args.heads, args.layers, args.kv_heads or args.heads,
                     args.ffn or 4 * args.d_model, args.rope_theta)
    return GPT(vocab_size, args.context, args.d_model, args.heads, args.layers)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- 1. the pipeline split ------------------------------------------------------------------------------
def stage_layers(layers: int, stages: int, split: str = "even") -> list[int]:
    """Blocks per stage. even: layers / stages each. llama3: the first and the last stage one block fewer than the
    others, for the embedding and for the head and loss (Llama 3's 126 layers on 16 stages: 7, 8 x 14, 7; the Llama
    3 paper, section 3.3.2, takes one layer from each to even out the first stage's memory and the last's time)."""
    if split == "llama3" and stages > 1:
        per = (layers + 2) // stages
        return [per - 1] + [per] * (stages - 2) + [per - 1]
    return [layers // stages] * stages


def stage_part(model: GPT, stage: int, stages: int, split: str = "even") -> GPT:
    """The whole model's part that pipeline stage `stage` of `stages` runs (torchtitan's split: delete the rest)."""
    part = copy.deepcopy(model)
    counts = stage_layers(len(model.blocks), stages, split)
    start = sum(counts[:stage])
    keep = {str(i) for i in range(start, start + counts[stage])}
    for name in [n for n in part.blocks if n not in keep]:
        del part.blocks[name]
    if stage > 0:
        part.embed = None
    if stage < stages - 1:
        part.ln_f = part.head = None
    return part


# --- 2. tensor and sequence parallelism -----------------------------------------------------------------
def apply_tp(part: GPT, tp_mesh, bug: str | None = None) -> None:
    """Megatron-style TP with sequence parallelism (torchtitan's plan for Llama, adapted to this GPT).

    Between the blocks, each tp rank holds a slice of the sequence (Shard(1)), as a plain tensor. Per block and
    micro-batch: forward all-gathers the sequence twice (before attention, before the MLP) and reduce-scatters
    twice (after out, after proj); backward does the opposite. The norms' weights are replicated; their gradients
    (partial sums over the tp ranks' slices) are summed by DTensor."""
    if isinstance(part, Llama):
        return apply_tp_llama(part, tp_mesh)
    if part.embed is not None:
        # Not tensor-parallel (see the docstring): whole tables on each tp rank; DTensor cuts the output into
        # sequence slices. Cutting it with a plain slice would be a silent bug: each tp rank's table gradient
        # would hold only its own slice's tokens, and nothing would sum them.
        parallelize_module(part.embed, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
    # The bug norm_grad_not_reduced leaves the blocks' norms plain modules on each tp rank's slice: forward is
    # right (a norm is per token), but each rank's weight gradient holds only its slice's tokens, never summed.
    norm = {} if bug == "norm_grad_not_reduced" else {"ln1": SequenceParallel(), "ln2": SequenceParallel()}
    for block in part.blocks.values():
        parallelize_module(block, tp_mesh, {
            **norm,
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    if part.head is not None:
        # The head column-parallel over the vocabulary, its logits gathered whole (no loss parallelism): the loss
        # is then the plain one. Vocabulary 64 divides by tp here.
        parallelize_module(part, tp_mesh, {
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })



def apply_tp_llama(part: "Llama", tp_mesh) -> None:
    """torchtitan's plan for Llama (torchtitan/models/llama3/infra/parallelize.py, apply_tp), without loss
    parallelism: the token embedding row-parallel over the vocabulary (each tp rank holds vocab / tp rows; its
    partial output is reduce-scattered into sequence slices), the norms SequenceParallel, wq/wk/wv and w1/w3
    column-parallel (a rank holds heads / tp query heads and kv_heads / tp key/value heads), wo and w2 row-parallel
    reduce-scattered back to sequence slices (Shard(1)), the head column-parallel with its logits gathered whole."""
    if part.embed is not None:
        parallelize_module(part.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
    for block in part.blocks.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    if part.head is not None:
        parallelize_module(part, tp_mesh, {
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })

def stage_shapes(args, stage: int, vocab: int, dtype, device) -> dict:
    """What stage `stage` receives and sends for one micro-batch, given to PipelineStage up front (its input_args,
    output_args): a tp rank's slice of the sequence between stages, token ids into the first, whole logits out of the
    last. Without them the stages find the shapes at their first step by running a forward and backward and
    sending the shapes to each other: in a dry run (gpucourse dryrun: a fake process group) nothing arrives, and
    the next stage would read garbage."""
    micro = args.batch // args.dp // args.micro
    # requires_grad: the stages read from these whether a gradient flows back through them (else none is sent)
    between = torch.empty(micro, args.context // args.tp, args.d_model, dtype=dtype, device=device, requires_grad=True)
    inputs = torch.zeros(micro, args.context, dtype=torch.long, device=device) if stage == 0 else between
    outputs = (torch.empty(micro, args.context, vocab, dtype=dtype, device=device, requires_grad=True)
               if stage == args.pp - 1 else between)
    return {"input_args": (inputs,), "output_args": (outputs,)}


# --- 3. FSDP2 over dp ------------------------------------------------------------------------------------
def apply_fsdp(part: GPT, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in part.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=False)


# --- the check against one process -----------------------------------------------------------------------
def offset_of(like: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's shard of the DTensor `like` starts in the whole tensor (zeros for a plain tensor): read from
    its placements, no communication."""
    if not isinstance(like, DTensor):
        return (0,) * like.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)[1])


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of `full` (a whole tensor) that this rank's shard of `like` holds."""
    shape = local_of(like).shape
    return full[tuple(slice(o, o + n) for o, n in zip(offset_of(like), shape))]


def grad_diff(part: nn.Module, reference: nn.Module) -> tuple[float, int]:
    """(largest |this rank's gradient - the one process's| over every parameter of the stage, parameters compared)."""
    ref = dict(reference.named_parameters())
    worst, n = 0.0, 0
    for name, p in part.named_parameters():
        mine, theirs = local_of(p.grad), local_slice(ref[name].grad, p.grad)
        if mine.shape != theirs.shape:
            raise AssertionError(f"{name}: local gradient {tuple(mine.shape)} vs its slice {tuple(theirs.shape)}")
        worst, n = max(worst, (mine - theirs).abs().max().item() if mine.numel() else 0.0), n + 1
    return worst, n


def shards(tensors: dict) -> dict:
    """{name: {"offset", "value"}}: this rank's shard of each tensor and where it starts in the whole one (what
    --record writes, and what exercise 13 compares with the one process)."""
    return {name: {"offset": offset_of(t), "value": local_of(t).detach().clone()} for name, t in tensors.items()}


# --- silent bugs: each trains without an error and with a plausible loss (chapter 13, exercise 13) ----------
BUGS = {
    "tp_same_seed": "each tp shard of a weight initialised on its own rank, the seed not offset by the tp rank: "
                    "every tp rank holds the same slice (Megatron's model-parallel seed forgotten)",
    "norm_grad_not_reduced": "the blocks' norms left out of sequence parallelism: each tp rank's norm gradient "
                             "holds only its slice's tokens, never summed over tp",
    "micro_loss_scale": "the schedule's gradients not divided by the micro-batches (scale_grads=False, a mean loss "
                        "per micro-batch): m times too large, which Adam barely notices",
    "dp_same_batch": "every dp group trains on the first rows of the global batch: the data not split by dp rank",
    "vocab_parallel_lse": "the loss's softmax normalised over each tp rank's slice of the vocabulary, its sum never "
                          "all-reduced over tp: the loss about log(tp) too low at the start",
    "clip_norm_per_stage": "gradient clipping's norm summed over one pipeline stage's ranks, never over the stages "
                           "(torchtitan #596): each stage clips by its own norm; the gradients are right, the update "
                           "is not, so the run parts from one process a step later",
}


def init_shards_same_seed(part: nn.Module, seed: int) -> None:
    """tp_same_seed: re-draw every tensor-parallel weight's local shard from one seed, the same on every tp rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in part.named_parameters():
            if name.endswith("weight") and isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
                p.to_local().normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def clip_grad_norm(part: nn.Module, max_norm: float, mesh, group) -> None:
    """Scale this rank's gradients so that the whole model's gradient norm is at most max_norm. Each rank sums the
    squares of the shards it holds, a shard that k ranks of its stage hold alike divided by k (every dp x tp rank
    holds a plain tensor; a DTensor is cut over its mesh dimensions that do not Replicate), then one all-reduce
    over every rank (group None), or over `group` (clip_norm_per_stage: this stage's dp x tp ranks only)."""
    stage_ranks = mesh["dp"].size() * mesh["tp"].size()
    squares = torch.zeros((), dtype=torch.float64, device=next(part.parameters()).device)
    for p in part.parameters():
        if p.grad is not None:
            g = p.grad
            cuts = math.prod(n for n, pl in zip(g.device_mesh.shape, g.placements) if not pl.is_replicate()) \
                if isinstance(g, DTensor) else 1  # not is_shard(): FSDP2's _StridedShard over TP is not one
            squares += local_of(g).double().square().sum() * cuts / stage_ranks
    dist.all_reduce(squares, group=group)
    scale = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
    for p in part.parameters():
        if p.grad is not None:
            local_of(p.grad).mul_(scale.to(p.grad.dtype))


def vocab_parallel_lse_loss(tp_rank: int, tp: int):
    """vocab_parallel_lse: cross-entropy whose log-sum-exp covers only this tp rank's slice of the vocabulary."""
    def loss(logits, targets):
        size = logits.shape[-1] // tp
        lse = logits[..., tp_rank * size:(tp_rank + 1) * size].logsumexp(-1)  # should sum over every tp rank
        return (lse - logits.gather(-1, targets[..., None]).squeeze(-1)).mean()
    return loss


# --- training --------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--dp", type=int, default=1, help="FSDP size (pp * dp * tp = world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size; must divide --heads and --context")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step in each dp group")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--arch", choices=["gpt", "llama"], default="gpt",
                   help="gpt: chapter 09's; llama: RMSNorm, SwiGLU, grouped-query attention, rotary positions")
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default --heads)")
    p.add_argument("--ffn", type=int, default=None, help="llama: SwiGLU's hidden size (default 4 x --d-model)")
    p.add_argument("--rope-theta", type=float, default=500_000.0, help="llama: rotary base (Llama 3's)")
    p.add_argument("--split", choices=["even", "llama3"], default="even",
                   help="blocks per stage: even, or llama3 (the first and last stage one fewer than the others)")
    p.add_argument("--vocab", type=int, default=None,
                   help="random tokens from a vocabulary this large instead of the corpus's characters")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (split over the dp groups)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip-norm", type=float, default=0.0,
                   help="clip the whole model's gradient norm to at most this (0: no clipping)")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16"], default="float64")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="train the one-process model beside it and compare (off in a dry run)")
    p.add_argument("--tol", type=float, default=1e-10, help="largest difference the check accepts")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", type=bug_list, default=["none"], metavar="NAME[,NAME...]",
                   help=f"inject a silent bug ({', '.join(BUGS)}), or none; several: trained one after the other "
                        "in the same launch")
    p.add_argument("--record", metavar="DIR", help="each rank writes its loss and its shard of every parameter "
                   "and gradient, per step, to DIR/<bug>/rank<r>.pt; rank 0 the one process's to DIR/reference.pt "
                   "(a relative DIR is in the run's folder)")
    args = p.parse_args(argv)
    if args.record and not args.check:
        p.error("--record writes the one process's run too: it needs --check")
    return args


def bug_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n != "none" and n not in BUGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown bug {', '.join(unknown)}: choose from none, {', '.join(BUGS)}")
    return names


def check_sizes(args, world_size: int) -> None:
    if args.pp * args.dp * args.tp != world_size:
        raise ValueError(f"--pp {args.pp} x --dp {args.dp} x --tp {args.tp} = {args.pp * args.dp * args.tp}, but "
                         f"the job has {world_size} ranks")
    if args.split == "llama3" and args.pp > 1:
        if (args.layers + 2) % args.pp or args.layers + 2 < 2 * args.pp:
            raise ValueError(f"--split llama3: --pp {args.pp} must divide --layers {args.layers} + 2 (the first and "
                             "last stage take one block fewer than the others)")
    elif args.layers % args.pp:
        raise ValueError(f"--pp {args.pp} must divide --layers {args.layers}: each stage takes as many blocks")
    if args.heads % args.tp or args.d_model % args.heads or args.context % args.tp:
        raise ValueError(f"--tp {args.tp} must divide --heads {args.heads} and --context {args.context} (sequence "
                         f"parallelism), and --heads --d-model {args.d_model}")
    kv_heads = args.kv_heads or args.heads
    if args.arch == "llama" and (args.heads % kv_heads or kv_heads % args.tp):
        raise ValueError(f"--kv-heads {kv_heads} must divide --heads {args.heads}, and --tp {args.tp} must divide "
                         f"--kv-heads {kv_heads}: each tp rank holds whole key/value heads")
    if args.arch == "llama" and (args.d_model // args.heads) % 2:
        raise ValueError(f"--d-model / --heads = {args.d_model // args.heads}: rotary embeddings need an even head "
                         "size")
    if args.arch == "gpt" and (args.kv_heads or args.ffn):
        raise ValueError("--kv-heads and --ffn are --arch llama's")
    if args.arch == "llama" and args.bug != ["none"]:
        raise ValueError("--bug is injected into the GPT (--arch gpt) only")
    if "clip_norm_per_stage" in args.bug and not args.clip_norm > 0:
        raise ValueError("--bug clip_norm_per_stage is a clipping bug: give --clip-norm (for example 1.0)")
    if args.batch % (args.dp * args.micro):
        raise ValueError(f"--batch {args.batch} must be a multiple of --dp {args.dp} x --micro {args.micro}")


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = runtime.setup(seed=args.seed, seed_per_rank=False, cuda_with_gloo=False)  # gloo's send/recv: CPU only
    check_sizes(args, ctx.world_size)
    torch.set_num_threads(1)
    mesh = init_device_mesh(ctx.device.type, (args.pp, args.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    data = RandomTokens(args.vocab) if args.vocab else CharData(args.data)
    failed = [bug for bug in args.bug if not train(args, ctx, mesh, data, bug)]
    runtime.teardown()
    if failed:
        raise AssertionError(f"rank {ctx.rank}: differs from one process (--tol {args.tol}), see its log")


def train(args, ctx, mesh, data, bug: str) -> bool:
    """Build, split and train the model with `bug` in it ("none": the right run); False if the check failed."""
    dtype = getattr(torch, args.dtype)
    check = args.check and not runtime.dry_run()
    torch.manual_seed(args.seed)  # every variant starts from the same model
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("pp", "dp", "tp"))
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    # Built in its dtype (the default dtype while it is made), not converted after: a dry run with fake tensors
    # cannot convert a module its FakeTensorMode made (torch 2.13: module.to(float64) on fake parameters fails).
    torch.set_default_dtype(dtype)
    model = build_model(args, data.vocab_size).to(ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    reference = copy.deepcopy(model) if check else None
    part = stage_part(model, pp_rank, args.pp, args.split)  # 1. pipeline split
    del model
    apply_tp(part, mesh["tp"], bug)  # 2. TP + SP
    if bug == "tp_same_seed" and args.tp > 1:
        init_shards_same_seed(part, args.seed + 1 + pp_rank)
    apply_fsdp(part, mesh["dp"])  # 3. FSDP2
    stage = PipelineStage(part, pp_rank, args.pp, ctx.device, group=mesh["pp"].get_group(),
                          **stage_shapes(args, pp_rank, data.vocab_size, dtype, ctx.device))
    loss = vocab_parallel_lse_loss(tp_rank, args.tp) if bug == "vocab_parallel_lse" else loss_fn
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.micro, loss_fn=loss,  # 4. the schedule
                                        scale_grads=bug != "micro_loss_scale")
    opt = torch.optim.AdamW(part.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
    # clip_norm_per_stage's group: the stage's dp x tp ranks as one (torchtitan flattens mesh dimensions alike)
    stage_group = mesh["dp", "tp"]._flatten().get_group() if bug == "clip_norm_per_stage" else None
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0, foreach=False) if check else None
    runtime.log(header=True, pp=args.pp, dp=args.dp, tp=args.tp, schedule=args.schedule, micro=args.micro,
                params=n_params, stage_params=[n for n, _ in part.named_parameters()], vocab=data.vocab_size,
                global_batch=args.batch, context=args.context, dtype=args.dtype, device=str(ctx.device),
                backend=ctx.backend, world_size=ctx.world_size, pp_rank=pp_rank, dp_rank=dp_rank,
                tp_rank=tp_rank, check=check, bug=bug)

    per_group = args.batch // args.dp
    rows = slice(0, per_group) if bug == "dp_same_batch" else slice(dp_rank * per_group, (dp_rank + 1) * per_group)
    worst = {"loss_diff": 0.0, "grad_diff": 0.0}
    recorded, ref_recorded = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = data.batch("train", args.batch, args.context, seed=args.seed * 100_003 + step)
        opt.zero_grad(set_to_none=True)
        if args.record:
            recorded.append({"params": shards(dict(part.named_parameters()))})
            ref_recorded.append({"params": {n: p.detach().clone() for n, p in reference.named_parameters()}})
        losses = []
        kwargs = ({"target": y[rows].to(ctx.device), "losses": losses} if last else {})
        # return_outputs=False: else the last stage keeps every micro-batch's logits and concatenates them at the
        # end of the step (torch 2.13's default), 2 x 16 x 2.1 GB of whole logits at Llama 3 405B's shape
        schedule.step(*((x[rows].to(ctx.device),) if first else ()), return_outputs=False, **kwargs)
        step_loss = None
        if last:  # the mean of this dp group's micro-batch losses, then over the dp groups: the global batch's
            step_loss = torch.stack(losses).detach().mean()
            dist.all_reduce(step_loss, group=mesh["dp"].get_group())
            step_loss = step_loss / args.dp
        record = {}
        if check:
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = loss_fn(reference(x.to(ctx.device)), y.to(ctx.device))
            ref_loss.backward()
            diff, compared = grad_diff(part, reference)
            record = {"grad_diff": diff, "grads_compared": compared, "ref_loss": ref_loss.item()}
            if last:
                record["loss_diff"] = abs(step_loss.item() - ref_loss.item())
            for key in worst:
                worst[key] = max(worst[key], record.get(key, 0.0))
            if args.record:
                recorded[-1].update(loss=step_loss.item() if last else None,
                                    grads=shards({n: p.grad for n, p in part.named_parameters()}))
                ref_recorded[-1].update(loss=ref_loss.item(), grads={n: p.grad.detach().clone()
                                                                    for n, p in reference.named_parameters()})
            if args.clip_norm:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip_norm, foreach=False)
            ref_opt.step()
        if args.clip_norm:  # after the check and the record: the gradients backward made, then the update
            clip_grad_norm(part, args.clip_norm, mesh, stage_group)
        opt.step()
        runtime.log(step=step, total=args.steps, loss=runtime.value(step_loss) if last else None,
                    seconds=time.perf_counter() - start, bug=bug, **record)
    if args.record:
        write_record(runtime.default_run_dir() / args.record, bug, ctx.rank, mesh, recorded, ref_recorded)
    ok = not check or max(worst.values()) <= args.tol
    runtime.log(summary=True, checked=check, tol=args.tol, bug=bug, ok=ok,
                **({f"max_{k}": v for k, v in worst.items()} if check else {}))
    if ctx.rank == ctx.world_size - 1 and not runtime.dry_run():
        print(f"pp={args.pp} dp={args.dp} tp={args.tp} ({args.schedule}, {args.micro} micro-batches) on "
              f"{ctx.world_size} rank(s), {args.dtype}" + (f", bug {bug}" if bug != "none" else "")
              + f": final loss {runtime.value(step_loss):.4f}"
              + (f"; largest difference from one process: loss {worst['loss_diff']:.1e}, gradients "
                 f"{worst['grad_diff']:.1e}" if check else ""), flush=True)
    return ok or bug != "none"  # a bug is meant to differ: only the right run fails the job


def write_record(folder: Path, bug: str, rank: int, mesh, steps: list, ref_steps: list) -> None:
    """DIR/<bug>/rank<r>.pt: {"coords": {dim: this rank's index}, "mesh": {dim: size}, "steps": [{"loss" (the last
    stage's, else None), "params", "grads": {name: {"offset", "value"}}}]}; rank 0 adds DIR/reference.pt, the one
    process's {"steps": [{"loss", "params", "grads": {name: whole tensor}}]}, parameters in the model's order."""
    (folder / bug).mkdir(parents=True, exist_ok=True)
    dims = mesh.mesh_dim_names
    torch.save({"coords": {d: mesh[d].get_local_rank() for d in dims}, "mesh": dict(zip(dims, mesh.shape)),
                "steps": steps}, folder / bug / f"rank{rank}.pt")
    if rank == 0:
        torch.save({"steps": ref_steps}, folder / "reference.pt")


if __name__ == "__main__":
    main()
