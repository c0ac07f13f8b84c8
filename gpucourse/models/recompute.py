"""Activation recomputation measured (chapter 07b): the bytes a transformer layer keeps for backward under no, selective
and full recomputation, the FLOPs each runs, and the time each takes, on any model whose layers are `model.blocks`.

    build = lambda seq: GPT(vocab, seq, h, a, layers)           # the same weights on every call
    with one_thread():
        kept, fused = saved_bytes(build, seqs, batch=b, vocab=vocab)
        flops = executed_flops(build, seqs, batch=b, vocab=vocab)
        times = step_times(build, seqs, batch=b, vocab=vocab, repeats=5)

Counting uses `memory.SavedTensorBytes` (saved-tensor hooks: exact, the same on CPU and GPU), FLOPs torch's
`FlopCounterMode`, both on attention's math path (`SDPBackend.MATH`), which materialises the s x s scores.
"""
from __future__ import annotations

import contextlib
import functools
import time

from . import costs
from .memory import SavedTensorBytes, transformer_layer_activation_bytes

MODES = ("none", "selective", "full")
SAVE_ALL = "selective, saving everything"  # a control: the selective machinery, recomputing nothing


def _matmuls():
    import torch

    return {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}


def save_matmul_outputs(ctx, op, *args, **kwargs):
    """Selective recomputation's policy: keep what the matrix products produce, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _matmuls() else CheckpointPolicy.PREFER_RECOMPUTE


def save_everything(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE


def apply(model, mode: str, policy=save_matmul_outputs):
    """Checkpoint every block of `model.blocks`: fully, selectively (`policy` decides per op), or not ("none")."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    for block in model.blocks:
        if mode == "full":
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        elif mode == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, policy)
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=context)
    return model


def token_batch(vocab: int, batch: int, seq: int):
    """(inputs, targets): random tokens, the same for a given seq."""
    import torch

    gen = torch.Generator().manual_seed(seq)
    return tuple(torch.randint(vocab, (batch, seq), generator=gen) for _ in range(2))


@contextlib.contextmanager
def one_thread():
    """torch on one thread inside the block, as every rank of the course's launches runs (OMP_NUM_THREADS=1): on a
    shared 2-core machine two threads that wait for each other make a step several times slower, and erratic."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _count(build, seq, mode, batch, vocab, backend=None):
    """Bytes each layer keeps in one forward, and the loss and gradients of the step (backward under the same
    attention backend: recomputation must take the path the forward took)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build(seq)
    saved = SavedTensorBytes(exclude=model.parameters(), layers=model.blocks)
    apply(model, mode, saved.recording(save_matmul_outputs))
    with sdpa_kernel(backend or SDPBackend.MATH):
        with saved:
            loss = model(*token_batch(vocab, batch, seq))[1]
        loss.backward()
    return saved.per_layer, loss.item(), [p.grad for p in model.parameters()]


def saved_bytes(build, seqs, *, batch: int, vocab: int) -> tuple[dict, dict]:
    """({(seq, mode): bytes one layer keeps}, {seq: bytes with a fused attention kernel, no recomputation}).
    Raises AssertionError if the layers differ from each other, or a mode changes the loss or a gradient
    (recomputation changes what is kept, never what is computed)."""
    import torch
    from torch.nn.attention import SDPBackend

    kept, fused = {}, {}
    for seq in seqs:
        for mode in MODES:
            per_layer, loss, grads = _count(build, seq, mode, batch, vocab)
            assert len(set(per_layer)) == 1, f"s={seq} {mode}: layers kept different bytes {per_layer}"
            kept[seq, mode] = per_layer[0]
            if mode == "none":
                reference = (loss, grads)
            else:
                assert loss == reference[0] and all(torch.equal(g, r) for g, r in zip(grads, reference[1])), \
                    f"s={seq}: {mode} recomputation changed the loss or a gradient"
        fused[seq] = _count(build, seq, "none", batch, vocab, SDPBackend.FLASH_ATTENTION)[0][0]
    return kept, fused


def expected_saved_bytes(seq: int, batch: int, width: int, heads: int) -> dict:
    """Bytes one layer of chapter 09's GPT keeps in float32, per mode: none = Korthikanti's terms without dropout
    (4 (16 s b h + a s^2 b)) + the two layer norms' mean and 1/std per token; selective (save_matmul_outputs) =
    10 s b h (the input, q k v, the attention output, the MLP's 4h-wide fc output, its projection); full = the
    block's input, s b h."""
    sbh = seq * batch * width
    norms = 4 * 2 * 2 * seq * batch
    none = transformer_layer_activation_bytes(seq, batch, width, heads, bytes_per_element=4, dropout=False)
    return {"none": none + norms, "selective": 4 * 10 * sbh, "full": 4 * sbh}


def executed_flops(build, seqs, *, batch: int, vocab: int) -> dict:
    """{(seq, mode): FLOPs of one forward + backward as FlopCounterMode sees them executed, recomputation
    included}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    out = {}
    for seq in seqs:
        for mode in MODES:
            model = apply(build(seq), mode)
            with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
                model(*token_batch(vocab, batch, seq))[1].backward()
            out[seq, mode] = counter.get_total_flops()
    return out


def expected_flops(seq: int, mode: str, *, batch: int, layers: int, width: int, matmul_params: int,
                   block_matmul_params: int) -> int:
    """FLOPs of one step by the formula (costs.hardware_flops_per_token x tokens). For "full", less what is not
    rerun: the embeddings and output head lie outside the checkpointed blocks, and torch stops recomputing a
    block once it has every tensor backward needs, so the MLP's last projection (4h x h) is not run again."""
    per_token = costs.hardware_flops_per_token(matmul_params, layers, width, seq, recompute=mode)
    if mode == "full":
        per_token -= 2 * (matmul_params - block_matmul_params) + 2 * layers * 4 * width * width
    return per_token * batch * seq


def step_times(build, seqs, *, batch: int, vocab: int, repeats: int) -> dict:
    """{(seq, mode): [seconds of each of `repeats` forward + backward steps]}, after one warm-up step each; the
    modes (and the SAVE_ALL control) take turns, so a change in the machine's load touches them alike."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    out = {}
    for seq in seqs:
        models = {mode: apply(build(seq), mode) for mode in MODES}
        models[SAVE_ALL] = apply(build(seq), "selective", save_everything)
        x, y = token_batch(vocab, batch, seq)
        times = {mode: [] for mode in models}
        with sdpa_kernel(SDPBackend.MATH):
            for _ in range(repeats + 1):
                for mode, model in models.items():
                    start = time.perf_counter()
                    model(x, y)[1].backward()
                    times[mode].append(time.perf_counter() - start)
                    model.zero_grad(set_to_none=True)
        out.update({(seq, mode): t[1:] for mode, t in times.items()})
    return out
