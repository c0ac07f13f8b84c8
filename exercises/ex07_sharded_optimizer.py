# Generated from solutions/ex07_sharded_optimizer.py by `gpucourse make-exercises`: course authors edit the
# solution, not this file. Learners: fill in every `# YOUR CODE HERE`, then `gpucourse grade ex07`.
"""Exercise 07, part 1: a sharded optimizer (ZeRO stage 1), like torch's ZeroRedundancyOptimizer.

Task
----
`ShardedOptimizer(params, optimizer_cls, **kwargs)` is a `torch.optim.Optimizer` that behaves like
`optimizer_cls(params, **kwargs)` — same parameters after every step, to float32 tolerance — while each of
the N ranks keeps optimizer state (Adam's m and v, SGD's momentum buffer) for only ITS shard of the
parameters: about 1/N of the state memory. Training loop (the grader's; the gradients are already the same
on every rank, e.g. averaged by DDP, as in ZeRO stage 1):

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    loss_fn(model(x), y).backward()
    opt.step()          # every rank updates its shard, then the updated parameters are broadcast
    opt.zero_grad()

Rules
-----
- Shard by parameter: each parameter belongs to exactly one rank, its owner. Balance the shards by size:
  take the parameters largest first (ties in their given order) and give each to the rank that holds the
  fewest elements so far (ties: the lowest rank). Every rank must compute the same assignment without
  communicating: it depends only on the parameters' sizes and order.
- Keep an inner `optimizer_cls(..., **kwargs)` built on this rank's parameters only; it holds the state.
  (Its state may be created lazily, at the first step, as torch's optimizers do.) Nothing else may hold a
  copy of another rank's optimizer state.
- `step()`: copy the hyper-parameters of `self.param_groups` (lr, weight_decay, ... which a scheduler may
  have changed) into the inner optimizer's groups, step it, then `dist.broadcast` every parameter from its
  owner. Parameters are broadcast, never all-reduced (the grader counts the collectives: each parameter's
  bytes are broadcast exactly once per step).
- The same Parameter given twice (tied weights) is one parameter: owned once, updated once, broadcast once.
- `add_param_group(group)` works after construction, as for any torch optimizer: the new group's parameters
  are shared out among the ranks (continuing from the current loads) and get their own options
  (e.g. another lr). torch.optim.Optimizer.__init__ calls add_param_group for the initial groups too.
- Do not use torch.distributed.optim.ZeroRedundancyOptimizer (the grader checks).

Check your work: `gpucourse grade ex07_sharded_optimizer`.
"""
import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    """Optimizer state for this rank's shard of the parameters only; updated parameters broadcast by their owner."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owner: dict[torch.Tensor, int] = {}  # parameter -> the rank that updates it
        self.loads = [0] * self.world_size        # elements owned by each rank so far
        self.optim = None                          # the inner optimizer, on this rank's parameters
        self._local_groups = []                    # (group of self.param_groups, the inner group) pairs
        super().__init__(params, defaults=kwargs)  # calls self.add_param_group for every initial group

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (all ranks alike), assign its new parameters to ranks, give the inner optimizer ours."""
        # YOUR CODE HERE
        raise NotImplementedError("drop duplicates, call super().add_param_group, assign owners (largest first, least-loaded rank), then add this rank's part to self.optim")

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard, then broadcast every parameter from its owner."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # YOUR CODE HERE
        raise NotImplementedError("copy hyper-parameters into the inner groups, self.optim.step(), then broadcast each parameter from its owner")
        return loss
