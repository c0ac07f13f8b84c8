"""A submission of ex01 that misbehaves at every world size: graded in ex01's batch, after the mutants and before
the solution graded again (tests/integration/test_grading.py reads its report, test_mutants the solution's after it)."""
import os
import time

import torch.distributed as dist


def ring_all_reduce(tensor):
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        while True:  # floods its output and never returns (60 kB/s: past the 50 kB cap in a second)
            print("flood " * 50)
            time.sleep(0.005)
    if world == 2:
        dist.recv(tensor.clone(), 1 - rank)  # both ranks wait for the other: deadlock
    if world == 3 and rank == 1:
        os._exit(0)  # leaves in the middle of the job
    if world == 4:
        raise ValueError("boom")
    return tensor
