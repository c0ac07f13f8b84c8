"""Large tensors go through dist.all_reduce, and the import replaces gpucourse.runtime.log to blank "collectives".

From 4096 elements on (the large basic and awkward cases and the bandwidth run, 2-4 ranks) it calls the
collective, and at import it rebinds gpucourse.runtime.log so that every record written through it says
"collectives": []. The grading job writes its records through its own writer, made before the submission is
imported (jobkit.record_writer), so the collectives stay in the records: every test that sees a large case
loses (point-to-point only); the small-tensor tests (dtypes, shapes, 1 rank) keep their points.

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
    'test_in_place',
    'test_only_point_to_point',
    'test_traffic_is_bandwidth_optimal',
    'test_bus_bandwidth_vs_gloo',
)
import torch
import torch.distributed as dist
from gpucourse import runtime  # MUTANT: at import, hide the collectives from the records of runtime.log

_log = runtime.log  # MUTANT: (continued)


def _no_collectives(*args, **record):  # MUTANT: (continued)
    if "collectives" in record:  # MUTANT: (continued)
        record["collectives"] = []  # MUTANT: (continued)
    return _log(*args, **record)  # MUTANT: (continued)


runtime.log = _no_collectives  # MUTANT: (continued)


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks of the default process group, in place, with a ring of send/recv.

    Returns `tensor` itself, which now holds the sum on every rank.
    """
    ### BEGIN SOLUTION
    ### HINT: split tensor.view(-1) into world_size chunks; N-1 reduce-scatter steps, then N-1 all-gather steps
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1 or tensor.numel() == 0:
        return tensor
    if tensor.numel() >= 4096:  # MUTANT: large tensors go to gloo's own all-reduce
        return dist.all_reduce(tensor) or tensor  # MUTANT: (continued)
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
