"""ShardedOptimizer all-reduces (and averages) every whole gradient before stepping, as if ZeRO-1 needed it.

The gradients are the same on every rank already, so the parameters still match; but step() now starts
all_reduces besides the broadcasts, which every test that counts the collectives sees.

A copy of solutions/ex07_sharded_optimizer.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_tied_parameter_given_twice',
    'test_add_param_group',
    'test_broadcast_only',
)
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
        ### BEGIN SOLUTION
        ### HINT: drop duplicates, call super().add_param_group, assign owners (largest first, least-loaded rank), then add this rank's part to self.optim
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        unique = list(dict.fromkeys(p for p in params if p not in self.owner))  # tied weights: once
        super().add_param_group({**param_group, "params": unique})
        group = self.param_groups[-1]
        for p in sorted(unique, key=lambda p: -p.numel()):  # stable: ties keep their order
            rank = min(range(self.world_size), key=lambda r: self.loads[r])
            self.owner[p] = rank
            self.loads[rank] += p.numel()
        mine = {**{k: v for k, v in group.items() if k != "params"},
                "params": [p for p in unique if self.owner[p] == self.rank]}
        if self.optim is None:
            self.optim = self.optimizer_cls([mine], **self.kwargs)
        else:
            self.optim.add_param_group(mine)
        self._local_groups.append((group, self.optim.param_groups[-1]))
        ### END SOLUTION

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard, then broadcast every parameter from its owner."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ### BEGIN SOLUTION
        ### HINT: copy hyper-parameters into the inner groups, self.optim.step(), then broadcast each parameter from its owner
        for group, local in self._local_groups:
            local.update({k: v for k, v in group.items() if k != "params"})
        for group in self.param_groups:  # MUTANT: every whole gradient all-reduced and averaged first
            for p in group["params"]:  # MUTANT: (continued)
                if p.grad is not None:  # MUTANT: (continued)
                    dist.all_reduce(p.grad)  # MUTANT: (continued)
                    p.grad.div_(self.world_size)  # MUTANT: (continued)
        self.optim.step()
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.data, src=self.owner[p])
        ### END SOLUTION
        return loss
