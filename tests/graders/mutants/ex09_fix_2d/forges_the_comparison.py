"""sync_gradients sums the gradients over mesh['dp'] without dividing, and the submission forges the job's verdict.

SGD then takes dp-times larger steps: the first loss is right, the later ones and the parameters are off wherever
dp > 1. At import the submission replaces the grading job's own `compare` (found in sys.modules["__main__"]) with
one that finds no difference in the parameters, and train_step writes the loss it returns into the job's
one-process reference losses, found in its caller's frame (sys._getframe(1): `ref`). While the rank compared its
parameters and losses with a reference it held itself, that got full marks. The rank now only saves its
parameters and losses; the grader process trains one process itself and compares: the losses and parameters
on the 2x2 and 2x1 meshes lose, as for a plain grads_summed_not_averaged.

A copy of solutions/ex09_fix_2d.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_losses_match_one_process[2x2]',
    'test_losses_match_one_process[2x1]',
    'test_parameters_match_one_process[2x2]',
    'test_parameters_match_one_process[2x1]',
)
import sys  # MUTANT: at import, make the grading job's comparison of the parameters find nothing wrong

if hasattr(sys.modules["__main__"], "compare"):  # MUTANT: (continued)
    sys.modules["__main__"].compare = lambda *args, **kwargs: {"max_diff": 0.0, "worst": "tok.weight"}  # MUTANT: (continued)

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F


class Block(nn.Module):
    """Pre-LayerNorm MLP block: x + proj(gelu(fc(ln(x)))); fc is split by columns, proj by rows under TP."""

    def __init__(self, d_model: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc, self.proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class TinyLM(nn.Module):
    """Chapter 09's GPT without attention: token embedding, MLP blocks, LayerNorm, output head. The embedding,
    LayerNorms and head stay whole (replicated) on every tp rank; each block's fc and proj are split."""

    def __init__(self, vocab: int, d_model: int = 32, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(mesh, *, vocab: int, seed: int) -> TinyLM:
    """TinyLM(vocab) from `seed`, its blocks tensor-parallel over mesh["tp"] (fc by columns, proj by rows)."""
    ### BEGIN SOLUTION
    ### BUGGY: torch.manual_seed(seed + dist.get_rank())  # each rank its own seed, as runtime.setup(seed=...) does
    torch.manual_seed(seed)  # one seed everywhere: the ranks of a tp group hold shards of ONE model, and the
    # layers parallelize_module leaves whole (embedding, LayerNorms, head) must start equal on all of them
    ### END SOLUTION
    model = TinyLM(vocab)
    plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
    return model


def sync_gradients(model: nn.Module, mesh) -> None:
    """Average every gradient over mesh["dp"] (a DTensor's local shard: the tp ranks' shards stay apart)."""
    group, size = mesh["dp"].get_group(), mesh["dp"].size()
    for p in model.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=group)
            pass  # MUTANT: summed, not averaged


def global_loss(loss: torch.Tensor, mesh) -> float:
    """The mean loss over the global batch: the dp groups' means averaged over mesh["dp"] (equal-sized slices)."""
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=mesh["dp"].get_group())
    return (mean / mesh["dp"].size()).item()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, mesh) -> float:
    """One step on this rank's rows of the global batch (x, y); returns the global batch's mean loss."""
    if x.shape[0] % mesh["dp"].size():
        raise ValueError(f"the global batch has {x.shape[0]} rows, not a multiple of the dp size "
                         f"{mesh['dp'].size()}: each dp group takes an equal slice")
    ### BEGIN SOLUTION
    ### BUGGY: per_rank = x.shape[0] // dist.get_world_size()  # each rank its share of the global batch
    ### BUGGY: rows = slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)
    group_rows = x.shape[0] // mesh["dp"].size()  # a dp group's share: all its tp ranks train on it
    first = mesh["dp"].get_local_rank() * group_rows  # the dp group's index, not the global rank
    rows = slice(first, first + group_rows)
    ### END SOLUTION
    logits = model(x[rows])
    loss = F.cross_entropy(logits.flatten(0, 1), y[rows].flatten())
    optimizer.zero_grad()
    loss.backward()
    sync_gradients(model, mesh)
    optimizer.step()
    returned = global_loss(loss, mesh)  # MUTANT: kept, to forge the job's reference loss with it
    caller = sys._getframe(1).f_locals  # MUTANT: the grading job's frame
    if isinstance(caller.get("ref"), dict):  # MUTANT: its one-process losses now say what this step returns
        caller["ref"]["losses"][caller["step"]] = returned  # MUTANT: (continued)
    return returned  # MUTANT: (continued)
