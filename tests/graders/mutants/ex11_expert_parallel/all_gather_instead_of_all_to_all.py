"""dispatch all-gathers every rank's tokens and each rank picks its experts' rows; combine all-reduces the outputs.

The outputs and gradients are right, but every rank receives every rank's tokens (N times the traffic of an
all-to-all that sends each row only where it goes) and combine all-reduces a buffer of every rank's outputs.
A copy of solutions/ex11_expert_parallel.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_only_all_to_all',
    'test_bytes_moved_match_the_formula',
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


class AllGatherRows(torch.autograd.Function):  # MUTANT: all_gather of every rank's tokens
    @staticmethod  # MUTANT
    def forward(ctx, x, group):  # MUTANT
        ctx.group, ctx.rank = group, group_size_and_rank(group)[1]  # MUTANT
        parts = [torch.empty_like(x) for _ in range(group_size_and_rank(group)[0])]  # MUTANT
        dist.all_gather(parts, x.contiguous(), group=group)  # MUTANT
        return torch.stack(parts)  # MUTANT

    @staticmethod  # MUTANT
    def backward(ctx, grad):  # MUTANT
        grad = grad.contiguous().clone()  # MUTANT
        dist.all_reduce(grad, group=ctx.group)  # MUTANT
        return grad[ctx.rank], None  # MUTANT


class AllReduceSum(torch.autograd.Function):  # MUTANT
    @staticmethod  # MUTANT
    def forward(ctx, x, group):  # MUTANT
        ctx.group = group  # MUTANT
        out = x.contiguous().clone()  # MUTANT
        dist.all_reduce(out, group=group)  # MUTANT
        return out  # MUTANT

    @staticmethod  # MUTANT
    def backward(ctx, grad):  # MUTANT
        grad = grad.contiguous().clone()  # MUTANT
        dist.all_reduce(grad, group=ctx.group)  # MUTANT
        return grad, None  # MUTANT


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
    flat = expert_ids.reshape(-1)  # MUTANT: everything below gathers every rank's tokens
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)  # MUTANT
    kept = kept_assignments(expert_ids, num_experts, capacity)  # MUTANT
    all_tokens = AllGatherRows.apply(tokens, group) if n > 1 else tokens[None]  # MUTANT
    all_ids = [torch.empty_like(expert_ids) for _ in range(n)]  # MUTANT
    if n > 1:  # MUTANT
        dist.all_gather(all_ids, expert_ids.contiguous(), group=group)  # MUTANT
    else:  # MUTANT
        all_ids = [expert_ids]  # MUTANT
    _, rank = group_size_and_rank(group)  # MUTANT
    rows, ids, places = [], [], []  # MUTANT
    for s in range(n):  # MUTANT
        f = all_ids[s].reshape(-1)  # MUTANT
        idx = kept_assignments(all_ids[s], num_experts, capacity).reshape(-1).nonzero().squeeze(1)  # MUTANT
        idx = idx[torch.sort(f[idx], stable=True).indices]  # MUTANT
        idx = idx[(f[idx] // per_rank) == rank]  # MUTANT: my experts' rows from source s
        rows.append(all_tokens[s][idx // k])  # MUTANT
        ids.append(f[idx] - rank * per_rank)  # MUTANT
        places.append(s * T * k + idx)  # MUTANT
    local_tokens, local_expert_ids = torch.cat(rows), torch.cat(ids)  # MUTANT
    state = DispatchState(kept=kept, dropped=int((~kept).sum()), tokens_per_expert=tokens_per_expert,  # MUTANT
                          order=torch.cat(places), send_splits=[], recv_splits=[],  # MUTANT
                          shape=(T, k, tokens.shape[-1]))  # MUTANT
    return local_tokens, local_expert_ids, state
    ### END SOLUTION


def combine(expert_out: torch.Tensor, state: DispatchState, group=None) -> torch.Tensor:
    """Send every processed row back to its source rank and put it at its (token, choice). See the docstring."""
    n, _ = group_size_and_rank(group)
    ### BEGIN SOLUTION
    ### HINT: AllToAll with the splits swapped; then scatter the rows to state.order's places in a zero (T*k, H) tensor
    _, rank = group_size_and_rank(group)  # MUTANT: every rank's outputs in one buffer, all-reduced
    T, k, H = state.shape  # MUTANT
    buf = expert_out.new_zeros((n * T * k, H)).index_copy(0, state.order, expert_out)  # MUTANT
    if n > 1:  # MUTANT
        buf = AllReduceSum.apply(buf, group)  # MUTANT
    return buf[rank * T * k:(rank + 1) * T * k].view(T, k, H)  # MUTANT
    ### END SOLUTION
