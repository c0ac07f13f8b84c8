# Generated from solutions/ex11_expert_parallel.py by `gpucourse make-exercises`: course authors edit the
# solution, not this file. Learners: fill in every `# YOUR CODE HERE`, then `gpucourse grade ex11`.
"""Exercise 11: expert parallelism by hand: the dispatch and the combine of a mixture-of-experts layer.

Task
----
A mixture-of-experts (MoE) layer has E experts (small MLPs); a router picks k of them for every token. With
expert parallelism the E experts are spread over the N ranks of a group, E/N each (rank r owns the global
experts r*E/N ... (r+1)*E/N - 1), and every rank routes its own tokens. Each token must travel to the rank
that owns each of its experts, be processed there, and come back: one all-to-all out (dispatch), one back
(combine). How many rows each rank sends to each other rank depends on the routing, so the splits are
uneven and change every step: the ranks exchange the counts first, then the tokens.

- `dispatch(tokens, expert_ids, num_experts, capacity=None, group=None) -> (local_tokens, local_expert_ids, state)`
  tokens: (T, H), this rank's tokens (autograd flows through). expert_ids: (T, k) int64, the global expert
  of each token's k choices (top-k: distinct within a row). capacity: the most assignments (token, choice)
  ONE expert accepts from THIS rank's tokens, or None for no limit. Assignments are taken in row-major
  order of expert_ids (token 0's choices, then token 1's, ...); those beyond an expert's capacity are dropped.
  Returns
    local_tokens      (M, H): the rows this rank's experts must process, in the order they arrive: by
                      source rank; within a source rank by local expert; within an expert in that source's
                      row-major order;
    local_expert_ids  (M,) int64: the LOCAL index (0 ... E/N - 1) of the expert each row is for;
    state             a DispatchState (below): what combine needs, and the dropped-token accounting.
- `combine(expert_out, state, group=None) -> (T, k, H)`: expert_out (M, H) is the experts' output for
  local_tokens, row for row. Sends every row back to the rank it came from and returns, for this rank's
  tokens, out[t, j] = the output of token t's j-th expert, and zeros where that assignment was dropped. The
  caller weights and sums: y = (out * weights[..., None]).sum(1).
- `DispatchState`: `kept` (T, k) bool (False where an assignment was dropped); `dropped` (int, the number of
  this rank's assignments dropped); `tokens_per_expert` (E,) int64 (this rank's assignments to each global
  expert, before the capacity: what a load-balancing loss and a histogram read); plus whatever combine needs.
- `AllToAll`: an autograd Function around `dist.all_to_all_single` with split sizes: forward sends rows
  by `input_splits` and receives by `output_splits`; backward sends the gradient back the same way
  reversed (the splits swapped).

Rules
-----
- Equal to the same layer run in one process with the same weights and routing (the grader's reference: each
  rank's tokens, its own capacity): outputs, the gradients of the tokens, of the routing weights and of
  every expert's weights, and the dropped-token accounting (kept, dropped, tokens_per_expert).
- Communicate only with `all_to_all_single`, inside `group` (None: every rank): the counts first, then the
  tokens; no all_gather / all_reduce / broadcast of tokens, no point-to-point. Forward: one small exchange
  of counts and one all-to-all of the tokens each way; backward: one all-to-all each way.
- Send exactly the kept rows: no padding to the capacity, no rows for experts a token did not choose.
- Use the group's size and this process's rank in it (`dist.get_world_size(group)`, `dist.get_rank(group)`).
  With one rank there is nothing to send: no collective is needed.
- num_experts that the group size does not divide raises ValueError naming both, e.g.
  "num_experts=6 is not divisible by the expert-parallel group size 4", before anything is sent.

Check your work: `gpucourse grade ex11`.
"""
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
    # YOUR CODE HERE
    raise NotImplementedError("n = group size; if num_experts % n: raise ValueError(f\"num_experts={num_experts} is not divisible by ... {n}\")")


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
        # YOUR CODE HERE
        raise NotImplementedError("out = x.new_empty((sum(output_splits), *x.shape[1:])); dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)")

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        # YOUR CODE HERE
        raise NotImplementedError("the same all-to-all with the splits swapped: what arrived from rank s goes back to rank s")


def kept_assignments(expert_ids: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """(T, k) bool: an assignment is kept when fewer than `capacity` earlier ones (row-major) chose its expert."""
    # YOUR CODE HERE
    raise NotImplementedError("one_hot(expert_ids.flatten(), E).cumsum(0) gives each assignment its 1-based place in its expert's queue")


def dispatch(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, capacity: int | None = None,
             group=None):
    """Send each kept (token, choice) to the rank of its expert. See the module docstring."""
    n, _ = group_size_and_rank(group)
    per_rank = experts_per_rank(num_experts, group)
    T, k = expert_ids.shape
    # YOUR CODE HERE
    raise NotImplementedError("kept mask; sort the kept flat indices by expert (stable); count per expert; exchange the counts (all_to_all_single of E int64); then AllToAll the rows")


def combine(expert_out: torch.Tensor, state: DispatchState, group=None) -> torch.Tensor:
    """Send every processed row back to its source rank and put it at its (token, choice). See the docstring."""
    n, _ = group_size_and_rank(group)
    # YOUR CODE HERE
    raise NotImplementedError("AllToAll with the splits swapped; then scatter the rows to state.order's places in a zero (T*k, H) tensor")
