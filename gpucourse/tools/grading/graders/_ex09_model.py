"""ex09's model, as the grader trains it in one process: the course's TinyLM and its Block, shipped with the graders.

Why a copy here: the exercise gives this model (exercises/ex09_fix_2d.py defines it, for the learner to read),
and the grader's one-process reference must never run code from the learner's file, which a release has in place
of the solution. So the grader process imports these classes and nothing of exercises/ or solutions/.
tests/unit/tools/test_ex09_model.py checks that this copy and solutions/ex09_fix_2d.py's (hence the exercise's)
are the same model: the same parameters from the same seed, and the same output for the same weights and input.
"""
from torch import nn
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
