"""Runs the ring on a flattened copy and returns the copy: the caller's tensor is left unchanged.

The returned tensor holds the right sum, so every value test passes; only the in-place test sees that the
caller's own tensor (2-4 ranks) does not hold the sum and is not what came back.

A copy of solutions/ex01_ring_allreduce.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_in_place',
)
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
    flat = tensor.flatten().clone()  # MUTANT: a copy, never written back into `tensor`
    chunks = torch.tensor_split(flat, world)  # MUTANT: (continued)
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
    return flat.view_as(tensor)  # MUTANT: the copy, not the caller's tensor
    ### END SOLUTION
