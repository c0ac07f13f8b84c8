"""Cuts the tensor with view(world, -1): works only when the length is a multiple of the world size.

Every length the world size divides is summed right (the basic cases, the bandwidth case); the others raise.
Those are the awkward lengths (2, 3, 4 ranks), the dtype cases (10N+3 elements: every dtype test has a world
size that does not divide it) and the shapes (3x5x7 on 2 ranks, a scalar). The in-place, point-to-point and
traffic tests judge only the cases that ran, so they keep their points.

A copy of solutions/ex01_ring_allreduce.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_awkward_lengths[2]',
    'test_awkward_lengths[3]',
    'test_awkward_lengths[4]',
    'test_dtype[float16]',
    'test_dtype[bfloat16]',
    'test_dtype[float32]',
    'test_dtype[float64]',
    'test_shapes',
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
    chunks = tensor.view(world, -1)  # MUTANT: one row per rank: only when world divides the length
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
