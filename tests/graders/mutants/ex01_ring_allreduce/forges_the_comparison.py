"""No reduction at all on 2 or more ranks, and the import rewires the grading job to call any result right.

At import it replaces the grading job's own `compare` (found in sys.modules["__main__"]) with one that always
says the result matches, and ring_all_reduce returns the caller's tensor untouched. When the rank judged its own
result, that got full marks. The rank now only saves what was returned; the grader process recomputes every sum
and compares: every correctness test with 2+ ranks loses. One rank (where the input is the sum), the traffic
bound and point-to-point only keep their points.

A copy of solutions/ex01_ring_allreduce.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_matches_all_reduce[2]',
    'test_matches_all_reduce[3]',
    'test_matches_all_reduce[4]',
    'test_awkward_lengths[2]',
    'test_awkward_lengths[3]',
    'test_awkward_lengths[4]',
    'test_dtype[float16]',
    'test_dtype[bfloat16]',
    'test_dtype[float32]',
    'test_dtype[float64]',
    'test_shapes',
    'test_in_place',
)
import sys  # MUTANT: at import, make the grading job's comparison always succeed

if hasattr(sys.modules["__main__"], "compare"):  # MUTANT: (continued)
    sys.modules["__main__"].compare = lambda *args, **kwargs: {"matches": True, "detail": ""}  # MUTANT: (continued)

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks of the default process group, in place, with a ring of send/recv.

    Returns `tensor` itself, which now holds the sum on every rank.
    """
    ### BEGIN SOLUTION
    ### HINT: split tensor.view(-1) into world_size chunks; N-1 reduce-scatter steps, then N-1 all-gather steps
    world, rank = dist.get_world_size(), dist.get_rank()
    return tensor  # MUTANT: nothing is reduced
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
