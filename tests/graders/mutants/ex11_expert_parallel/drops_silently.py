"""Assignments over capacity are dropped, but silently: state.kept says all were kept and state.dropped is 0.

The rows sent and the outputs are right; only the accounting (what a training loop would log) is wrong:
the dropped-tokens test, and the subgroups' (which check the accounting too).

A copy of solutions/ex11_expert_parallel.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_dropped_tokens_accounted[1]',
    'test_dropped_tokens_accounted[2]',
    'test_dropped_tokens_accounted[3]',
    'test_dropped_tokens_accounted[4]',
    'test_subgroups_equal_single_process',
)
from dataclasses import dataclass

import torch
import torch.distributed as dist


def group_size_and_rank(group=None) -> tuple[int, int]:
    """(size of the expert-parallel group, this process's rank in it); (1, 0) without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def experts_per_rank(num_experts: int, group=None) -> int:
    """num_experts / group size, or ValueError naming both when it does not divide."""
    ### BEGIN SOLUTION
    ### HINT: n = group size; if num_experts % n: raise ValueError(f"num_experts={num_experts} is not divisible by ... {n}")
    n, _ = group_size_and_rank(group)
    if num_experts % n:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel group size {n}: "
                         f"choose a multiple of {n}")
    return num_experts // n
    ### END SOLUTION


@dataclass
class DispatchState:
    """What dispatch hands to combine, and the dropped-token accounting."""
    kept: torch.Tensor               # (T, k) bool: False where the assignment was dropped (over capacity)
    dropped: int                     # this rank's dropped assignments
    tokens_per_expert: torch.Tensor  # (E,) int64: this rank's assignments to each expert, before the capacity
    order: torch.Tensor              # (K,) int64: flat (t*k + j) index of each kept assignment, in the order sent
    send_splits: list                # rows sent to each rank of the group
    recv_splits: list                # rows received from each rank of the group
    shape: tuple                     # (T, k, H) of combine's result


class AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends the gradient back the way it came."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        ### BEGIN SOLUTION
        ### HINT: out = x.new_empty((sum(output_splits), *x.shape[1:])); dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        ### BEGIN SOLUTION
        ### HINT: the same all-to-all with the splits swapped: what arrived from rank s goes back to rank s
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), list(input_splits), list(output_splits), group=ctx.group)
        return out, None, None, None
        ### END SOLUTION


def kept_assignments(expert_ids: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """(T, k) bool: an assignment is kept when fewer than `capacity` earlier ones (row-major) chose its expert."""
    ### BEGIN SOLUTION
    ### HINT: one_hot(expert_ids.flatten(), E).cumsum(0) gives each assignment its 1-based place in its expert's queue
    flat = expert_ids.reshape(-1)
    if capacity is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    place = torch.nn.functional.one_hot(flat, num_experts).cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
    return (place < capacity).reshape(expert_ids.shape)
    ### END SOLUTION


def dispatch(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, capacity: int | None = None,
             group=None):
    """Send each kept (token, choice) to the rank of its expert. See the module docstring."""
    n, _ = group_size_and_rank(group)
    per_rank = experts_per_rank(num_experts, group)
    T, k = expert_ids.shape
    ### BEGIN SOLUTION
    ### HINT: kept mask; sort the kept flat indices by expert (stable); count per expert; exchange the counts (all_to_all_single of E int64); then AllToAll the rows
    flat = expert_ids.reshape(-1)
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)
    kept = kept_assignments(expert_ids, num_experts, capacity)
    kept_idx = kept.reshape(-1).nonzero().squeeze(1)                 # flat t*k + j, row-major
    order = kept_idx[torch.sort(flat[kept_idx], stable=True).indices]  # grouped by expert (so by rank)
    sent_per_expert = torch.bincount(flat[order], minlength=num_experts)
    # The counts first: from every source rank, how many rows for each of MY local experts.
    if n > 1:
        recv_per_expert = torch.empty_like(sent_per_expert)
        dist.all_to_all_single(recv_per_expert, sent_per_expert, group=group)
    else:
        recv_per_expert = sent_per_expert
    send_splits = sent_per_expert.view(n, per_rank).sum(1).tolist()
    recv_splits = recv_per_expert.view(n, per_rank).sum(1).tolist()
    rows = tokens[order // k]
    local_tokens = AllToAll.apply(rows, recv_splits, send_splits, group) if n > 1 else rows
    local_expert_ids = torch.repeat_interleave(torch.arange(per_rank).repeat(n), recv_per_expert)
    kept = torch.ones_like(kept)  # MUTANT: the drops are not reported
    state = DispatchState(kept=kept, dropped=int((~kept).sum()), tokens_per_expert=tokens_per_expert,
                          order=order, send_splits=send_splits, recv_splits=recv_splits,
                          shape=(T, k, tokens.shape[-1]))
    return local_tokens, local_expert_ids, state
    ### END SOLUTION


def combine(expert_out: torch.Tensor, state: DispatchState, group=None) -> torch.Tensor:
    """Send every processed row back to its source rank and put it at its (token, choice). See the docstring."""
    n, _ = group_size_and_rank(group)
    ### BEGIN SOLUTION
    ### HINT: AllToAll with the splits swapped; then scatter the rows to state.order's places in a zero (T*k, H) tensor
    back = AllToAll.apply(expert_out, state.send_splits, state.recv_splits, group) if n > 1 else expert_out
    T, k, H = state.shape
    out = back.new_zeros((T * k, H)).index_copy(0, state.order, back)
    return out.view(T, k, H)
    ### END SOLUTION
