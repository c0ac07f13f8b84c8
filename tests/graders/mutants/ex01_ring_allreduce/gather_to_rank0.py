"""A "ring" that gathers every rank's whole tensor on rank 0, sums there and sends the sum back.

The sums are right, in place, point-to-point only; but rank 0 sends (N-1) whole tensors instead of 2(N-1)/N of
one, which the traffic count catches (3 and 4 ranks). (Its bus bandwidth is also low, but that criterion is
timed, and not scored under GPUCOURSE_GRADE_TIMING=report.)

A copy of solutions/ex01_ring_allreduce.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_traffic_is_bandwidth_optimal',
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
    flat = tensor.view(-1)  # MUTANT: no ring: rank 0 collects every whole tensor, adds, and sends the sum back
    if rank == 0:  # MUTANT: (continued)
        inbox = torch.empty_like(flat)  # MUTANT: (continued)
        for src in range(1, world):  # MUTANT: (continued)
            dist.recv(inbox, src)  # MUTANT: (continued)
            flat.add_(inbox)  # MUTANT: (continued)
        for dst in range(1, world):  # MUTANT: (continued)
            dist.send(flat, dst)  # MUTANT: (continued)
    else:  # MUTANT: (continued)
        dist.send(flat, 0)  # MUTANT: (continued)
        dist.recv(flat, 0)  # MUTANT: (continued)
    return tensor
    ### END SOLUTION
