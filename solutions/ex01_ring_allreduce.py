"""Exercise 01: ring all-reduce, built from point-to-point messages only.

Task
----
Write `ring_all_reduce(tensor)`: the SUM all-reduce that `dist.all_reduce(tensor)` performs, over the
default process group, using only point-to-point operations. Every rank calls it with a tensor of the
same shape and dtype; when it returns, every rank's tensor holds the element-wise sum of all ranks'.

Rules
-----
- Point-to-point only: `dist.send`, `dist.recv`, `dist.isend`, `dist.irecv`, `dist.P2POp` with
  `dist.batch_isend_irecv`. No collective (all_reduce, reduce, broadcast, all_gather, reduce_scatter,
  all_to_all, barrier, scatter, gather, ...): the grader records every call and scores zero if it sees one.
- Ring algorithm: cut the flattened tensor into world_size chunks. Reduce-scatter phase: N-1 steps in
  which each rank sends one chunk to its right neighbour, receives one from its left neighbour and adds
  it in; afterwards each rank owns one fully reduced chunk. All-gather phase: N-1 more steps passing
  the reduced chunks around the ring. Each rank then sends 2(N-1)/N of the tensor's bytes: that is
  bandwidth-optimal, and the grader checks it by counting the bytes you send.
- Any world size >= 1, any length (not only multiples of the world size; empty too), any float dtype
  (float16, bfloat16, float32, float64), any shape.
- In place: the caller's tensor object holds the result (work on `tensor.view(-1)`, never on a copy
  you forget to write back); return that same tensor.
- No deadlock: if every rank first does a blocking `send` and then a `recv`, the ring can wait on
  itself. Post the send and the receive together (`isend` + `irecv`, or `batch_isend_irecv`).
- Reasonably fast: chunks are views (`torch.tensor_split`), additions are whole-chunk tensor ops; no
  Python loop over elements. The grader asks for at least a quarter of gloo's own bus bandwidth.

Check your work: `gpucourse grade ex01` (in a notebook: `gpucourse.grading.grade("ex01")`).
"""
import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks of the default process group, in place, with a ring of send/recv.

    Returns `tensor` itself, which now holds the sum on every rank.
    """
    ### BEGIN SOLUTION
    ### HINT: split tensor.view(-1) into world_size chunks; N-1 reduce-scatter steps, then N-1 all-gather steps
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1 or tensor.numel() == 0:
        return tensor
    chunks = torch.tensor_split(tensor.view(-1), world)  # views; sizes differ by at most one element
    right, left = (rank + 1) % world, (rank - 1) % world
    inbox = torch.empty_like(chunks[0])  # chunk 0 is the largest

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        # Send and receive posted together, so no rank waits on a neighbour that is itself waiting.
        # Empty chunks (length < world size) are skipped on both sides: sender and receiver agree on sizes.
        ops = [dist.P2POp(dist.isend, send, right)] if send.numel() else []
        ops += [dist.P2POp(dist.irecv, recv, left)] if recv.numel() else []
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()

    # Reduce-scatter: at step s, pass on chunk (rank - s), which holds s + 1 ranks' contributions,
    # and add the left neighbour's partial sum into chunk (rank - s - 1).
    for step in range(world - 1):
        mine = chunks[(rank - step - 1) % world]
        received = inbox[: mine.numel()]
        exchange(chunks[(rank - step) % world], received)
        mine.add_(received)
    # Rank r now owns the full sum of chunk (r + 1). All-gather: pass the finished chunks around.
    for step in range(world - 1):
        exchange(chunks[(rank + 1 - step) % world], chunks[(rank - step) % world])
    return tensor
    ### END SOLUTION
