"""Each micro-batch's loss is backpropagated without dividing it by n_micro, and gpipe_step forges the job's reference.

The mean is taken only for the returned loss, which is right; the gradients are n_micro times too large whenever
n_micro > 1. Before it returns, gpipe_step finds the grading job's own unsplit reference model in its caller's
frame (sys._getframe(1): `reference`, where the rank ran the whole model on the full batch) and gives it this
stage's gradients. While the rank compared its stage with that reference itself, that got full marks. The rank
now only saves the stage's gradients; the grader process runs the unsplit model itself and compares: every
gradient test with n_micro > 1 loses, as for a plain micro_loss_not_scaled.

A copy of solutions/ex05_gpipe.py with this one mistake (the lines marked `# MUTANT:`). tests/test_mutants.py
grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and that every other test
keeps them.
"""
MUST_FAIL = (
    'test_gradients_match_unsplit_model[p2-m4]',
    'test_gradients_match_unsplit_model[p2-m3-3d]',
    'test_gradients_match_unsplit_model[p4-m4]',
    'test_gradients_match_unsplit_model[p4-m3-3d]',
    'test_gradients_match_unsplit_model[p4-m8]',
)
import sys  # MUTANT: to reach the grading job's frame

import torch
import torch.distributed as dist
from torch import nn

HEADER_LEN = 8  # dtype code, ndim, then up to 6 sizes
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def peer(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (send/recv take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def send_tensor(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Send a tensor of any shape (at most 6 dimensions) and any dtype of DTYPES: header, then data."""
    ### BEGIN SOLUTION
    ### HINT: header = torch.zeros(HEADER_LEN, dtype=torch.int64) holding [DTYPES.index(dtype), ndim, *shape]; send it, then the contiguous tensor
    if tensor.dim() > HEADER_LEN - 2 or tensor.dtype not in DTYPES:
        raise ValueError(f"send_tensor: {tensor.dim()}-d {tensor.dtype} tensor; at most {HEADER_LEN - 2} "
                         f"dimensions and a dtype in {DTYPES}")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = DTYPES.index(tensor.dtype), tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    dist.send(header, dst, group=group)
    dist.send(tensor.detach().contiguous(), dst, group=group)
    ### END SOLUTION


def recv_tensor(src: int, group=None) -> torch.Tensor:
    """Receive what send_tensor sent: read the header, allocate a tensor of that shape and dtype, fill it."""
    ### BEGIN SOLUTION
    ### HINT: receive the int64 header, then torch.empty(shape, dtype=...) and receive into it
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.recv(header, src, group=group)
    ndim = int(header[1])
    out = torch.empty([int(s) for s in header[2:2 + ndim]], dtype=DTYPES[int(header[0])])
    dist.recv(out, src, group=group)
    return out
    ### END SOLUTION


def gpipe_step(stage: nn.Module, batch: torch.Tensor | None, targets: torch.Tensor | None, loss_fn,
               n_micro: int, group=None) -> torch.Tensor | None:
    """One GPipe forward+backward over the pipeline; the full batch's loss on the last rank, None elsewhere."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    first, last = rank == 0, rank == size - 1
    ### BEGIN SOLUTION
    ### HINT: check n_micro, split with _split; forward all micro-batches (recv_tensor -> requires_grad_ -> stage -> send_tensor or loss / n_micro), keep (input, output); then backward each (recv the output's grad, output.backward(grad), send input.grad back)
    if n_micro < 1:
        raise ValueError(f"n_micro must be >= 1, got {n_micro}")
    inputs = _split(batch, n_micro, "batch") if first else None
    labels = _split(targets, n_micro, "targets") if last else None
    saved, losses = [], []  # per micro-batch: (its input, its output), kept for the backward pass
    for i in range(n_micro):
        x = inputs[i] if first else recv_tensor(peer(group, rank - 1), group).requires_grad_()
        y = stage(x)
        if last:
            y = loss_fn(y, labels[i])  # MUTANT: not divided by n_micro
            losses.append(y.detach())
        else:
            send_tensor(y, peer(group, rank + 1), group)
        saved.append((x, y))
    for x, y in saved:
        if last:
            y.backward()
        else:
            grad = torch.empty_like(y)
            dist.recv(grad, peer(group, rank + 1), group=group)
            y.backward(grad)
        if not first:
            dist.send(x.grad, peer(group, rank - 1), group=group)
    forged = sys._getframe(1).f_locals.get("reference")  # MUTANT: the job's unsplit model, if its caller has one
    if isinstance(forged, nn.Sequential):  # MUTANT: give it this stage's gradients: no difference left to find
        for mine, theirs in zip(stage.parameters(), forged[rank].parameters()):  # MUTANT: (continued)
            theirs.grad = mine.grad.clone()  # MUTANT: (continued)
    return torch.stack(losses).mean() if last else None  # MUTANT: the mean, for the returned loss only
    ### END SOLUTION


def _split(tensor: torch.Tensor | None, n_micro: int, name: str) -> list[torch.Tensor]:
    """`tensor` cut along dim 0 into n_micro equal micro-batches, or a ValueError saying what to change."""
    if tensor is None:
        raise ValueError(f"{name} is None on the rank that must hold it (rank 0: batch, last rank: targets)")
    if tensor.shape[0] % n_micro:
        raise ValueError(f"{name} has {tensor.shape[0]} samples, not divisible by n_micro={n_micro}: "
                         f"use a batch size that is a multiple of n_micro")
    return list(tensor.chunk(n_micro))
