# Generated from solutions/ex05_gpipe.py by `gpucourse make-exercises`: course authors edit the
# solution, not this file. Learners: fill in every `# YOUR CODE HERE`, then `gpucourse grade ex05`.
"""Exercise 05: one GPipe training step over p stage processes, with m micro-batches.

Task
----
A model is cut into p consecutive stages; rank r of the group holds stage r (an `nn.Module` with its slice
of the layers). `gpipe_step` runs one forward and backward pass of the whole model over a batch, split into
`n_micro` micro-batches, on every rank at once (every rank calls it):

    loss = gpipe_step(stage, batch, targets, loss_fn, n_micro)
    # rank 0:      batch = the inputs (the full batch), targets = None
    # last rank:   batch = None, targets = the full batch's targets;  returns the loss
    # other ranks: batch = None, targets = None;  return None

Afterwards every stage's parameters hold in `.grad` exactly the gradients the unsplit model gets from
`loss_fn(model(batch), targets).backward()` on the full batch (added to whatever `.grad` held before, as
`backward()` does), and the last rank returns that loss (a 0-dim tensor, detached).

Rules
-----
- GPipe schedule: every stage runs the forward of all micro-batches, one after the other, sending each
  output on as soon as it is computed (so the next stage starts while this one goes on); then the backward
  of all micro-batches. Call `stage(x)` once per micro-batch, never on the full batch.
- `loss_fn` averages over the samples it is given (like `nn.MSELoss()`); the full batch's mean loss is the
  mean of the m micro-batch losses, so scale each micro-batch loss by 1/m before its backward.
- The batch is split along dim 0 into m equal micro-batches; a batch whose size is not divisible by
  `n_micro` raises ValueError on the ranks that hold it (rank 0: batch, last rank: targets) before any
  communication. `n_micro < 1` raises ValueError on every rank.
- Activation shapes: a stage does not know the shape of what it will receive, so every activation is sent
  with `send_tensor` (below): a fixed-size header (dtype, number of dimensions, sizes) followed by the data;
  `recv_tensor` reads the header, allocates, and receives. Gradients go back with plain send/recv: the
  receiving stage knows their shape (that of the activation it sent).
- Only point-to-point communication: `send`, `recv`, `isend`, `irecv`, `batch_isend_irecv`. No collective
  (all_reduce, broadcast, barrier, ...): the grader forbids them.
- `group`: the process group of the pipeline (None: the default group); stage r is rank r of it. Send and
  receive with the group's *global* ranks (`dist.get_global_rank(group, r)`).

Check your work: `gpucourse grade ex05`.
"""
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
    # YOUR CODE HERE
    raise NotImplementedError("header = torch.zeros(HEADER_LEN, dtype=torch.int64) holding [DTYPES.index(dtype), ndim, *shape]; send it, then the contiguous tensor")


def recv_tensor(src: int, group=None) -> torch.Tensor:
    """Receive what send_tensor sent: read the header, allocate a tensor of that shape and dtype, fill it."""
    # YOUR CODE HERE
    raise NotImplementedError("receive the int64 header, then torch.empty(shape, dtype=...) and receive into it")


def gpipe_step(stage: nn.Module, batch: torch.Tensor | None, targets: torch.Tensor | None, loss_fn,
               n_micro: int, group=None) -> torch.Tensor | None:
    """One GPipe forward+backward over the pipeline; the full batch's loss on the last rank, None elsewhere."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    first, last = rank == 0, rank == size - 1
    # YOUR CODE HERE
    raise NotImplementedError("check n_micro, split with _split; forward all micro-batches (recv_tensor -> requires_grad_ -> stage -> send_tensor or loss / n_micro), keep (input, output); then backward each (recv the output's grad, output.backward(grad), send input.grad back)")


def _split(tensor: torch.Tensor | None, n_micro: int, name: str) -> list[torch.Tensor]:
    """`tensor` cut along dim 0 into n_micro equal micro-batches, or a ValueError saying what to change."""
    if tensor is None:
        raise ValueError(f"{name} is None on the rank that must hold it (rank 0: batch, last rank: targets)")
    if tensor.shape[0] % n_micro:
        raise ValueError(f"{name} has {tensor.shape[0]} samples, not divisible by n_micro={n_micro}: "
                         f"use a batch size that is a multiple of n_micro")
    return list(tensor.chunk(n_micro))
