"""An lr changed through param_groups never reaches the inner optimizer, and the import loosens the job's tolerance.

step() no longer copies the hyper-parameters of self.param_groups into the inner groups, so the lr halved before
step 3 (as a scheduler would) is ignored. At import the module also sets the grading job's own TOLERANCE (found in
sys.modules["__main__"]) to infinity. When the rank measured its distance from the torch optimizer and reported it
with its tolerance, that got full marks. The rank now saves the parameters, the grader process steps torch's
optimizer itself and compares with its own tolerance: every test that checks the parameters of a case whose lr is
halved loses; add_param_group (whose new group starts with its own lr, and no lr is changed) keeps its point.

A copy of solutions/ex07_sharded_optimizer.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_matches_unsharded_optimizer[adamw]',
    'test_matches_unsharded_optimizer[sgd]',
    'test_tied_parameter_given_twice',
    'test_state_is_sharded[adamw]',
    'test_state_is_sharded[sgd]',
    'test_broadcast_only',
    'test_no_zero_redundancy_optimizer',
)
import sys  # MUTANT: at import, make the grading job accept any distance from the torch optimizer

if hasattr(sys.modules["__main__"], "TOLERANCE"):  # MUTANT: (continued)
    sys.modules["__main__"].TOLERANCE = float("inf")  # MUTANT: (continued)

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
        for group, local in self._local_groups[:0]:  # MUTANT: lr changes never reach the inner optimizer
            local.update({k: v for k, v in group.items() if k != "params"})
        self.optim.step()
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.data, src=self.owner[p])
        ### END SOLUTION
        return loss
