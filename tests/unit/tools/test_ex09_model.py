"""ex09's grader trains its own copy of the course's model (gpucourse/tools/grading/graders/_ex09_model.py), never the learner's file:
that copy and the classes the solution (hence the exercise) defines for the learner must stay one model.

One model: the same parameter names and shapes, the same initial weights from the same seed (the grader compares
the submission's build_model with `torch.manual_seed(seed); TinyLM(vocab)`), and the same output and gradients for
the same weights and input. `differences` is also shown to catch a copy that drifted.
"""
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpucourse import exercises
from gpucourse.tools.grading.graders import _ex09_model as ex09_model

NAME = "ex09_fix_2d"
VOCAB, SEED = 32, 5  # as the ex09 grader's
SHAPES = ({}, {"d_model": 16, "layers": 3})  # the default TinyLM (the grader's) and another, so that no default hides


def load(path: Path):
    """The course's own file (solutions/ or exercises/) as a module: only its classes are used."""
    spec = importlib.util.spec_from_file_location(f"_ex09_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def differences(shipped: type, other: type) -> list[str]:
    """What tells `other` from `shipped` as a model ([] when none): parameters, initial weights, output, gradients."""
    found = []
    for kwargs in SHAPES:
        torch.manual_seed(SEED)
        a = shipped(VOCAB, **kwargs)
        torch.manual_seed(SEED)
        b = other(VOCAB, **kwargs)
        shapes_a = {n: p.shape for n, p in a.named_parameters()}
        shapes_b = {n: p.shape for n, p in b.named_parameters()}
        if shapes_a != shapes_b:
            found.append(f"{kwargs}: parameters {sorted(set(shapes_a.items()) ^ set(shapes_b.items()))}")
            continue
        for n, p in b.named_parameters():
            if not torch.equal(p, a.get_parameter(n)):
                found.append(f"{kwargs}: initial {n} from seed {SEED}")
        with torch.no_grad():  # the same weights, away from the initial ones, in both
            gen = torch.Generator().manual_seed(7)
            for p in a.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
        b.load_state_dict(a.state_dict())
        idx = torch.randint(VOCAB, (4, 8), generator=torch.Generator().manual_seed(8))
        out_a, out_b = a(idx), b(idx)
        if out_a.shape != out_b.shape or not torch.allclose(out_a, out_b, rtol=0, atol=1e-6):
            found.append(f"{kwargs}: output for the same weights and input")
            continue
        out_a.square().mean().backward()
        out_b.square().mean().backward()
        for n, p in b.named_parameters():
            if not torch.allclose(p.grad, a.get_parameter(n).grad, rtol=0, atol=1e-6):
                found.append(f"{kwargs}: gradient of {n}")
    return found


@pytest.mark.parametrize("folder", ["solutions", "exercises"])
def test_the_graders_model_is_the_courses(folder):
    path = exercises.course_root() / folder / f"{NAME}.py"
    module = load(path)
    for cls in ("TinyLM", "Block"):
        assert isinstance(getattr(module, cls, None), type), f"{path} defines no class {cls}"
    assert differences(ex09_model.TinyLM, module.TinyLM) == [], \
        f"gpucourse/tools/grading/graders/_ex09_model.py and {folder}/{NAME}.py define different models: make them the same again"


class _ReluBlock(ex09_model.Block):
    def forward(self, x):
        return x + self.proj(F.relu(self.fc(self.ln(x))))


class _ReluLM(ex09_model.TinyLM):  # another activation: same parameters and initial weights, another output
    def __init__(self, vocab, d_model=32, layers=2):
        super().__init__(vocab, d_model, layers)
        self.blocks = nn.ModuleList(_ReluBlock(d_model) for _ in range(layers))
        torch.manual_seed(SEED)
        fresh = ex09_model.TinyLM(vocab, d_model, layers)  # the initial weights the seed gives, restored
        self.load_state_dict(fresh.state_dict())


class _HeadFirstLM(ex09_model.TinyLM):  # the head made first: same parameters and output, other initial weights
    def __init__(self, vocab, d_model=32, layers=2):
        nn.Module.__init__(self)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.tok = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(ex09_model.Block(d_model) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)


class _BiasedHeadLM(ex09_model.TinyLM):  # one parameter more
    def __init__(self, vocab, d_model=32, layers=2):
        super().__init__(vocab, d_model, layers)
        self.head = nn.Linear(d_model, vocab)


@pytest.mark.parametrize("drifted, what", [(_ReluLM, "output"), (_HeadFirstLM, "initial"),
                                           (_BiasedHeadLM, "parameters")])
def test_a_copy_that_drifted_is_caught(drifted, what):
    found = differences(ex09_model.TinyLM, drifted)
    assert found and all(what in line for line in found), found
