"""DDP broadcasts rank 0's parameters but not its buffers, and the import makes torch.equal always say "equal".

When the rank compared its state with rank 0's itself (with torch.equal), the rebinding hid the mistake and the
rank-0 test gave full marks. The rank now saves its state raw and the grader process compares it with rank 0's
initial state, which it rebuilds: the rank-0 test loses its points for DDP, as buffers_not_broadcast's does.

A copy of solutions/ex02_ddp.py with this one mistake (the lines marked `# MUTANT:`). tests/test_mutants.py
grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and that every other test
keeps them.
"""
MUST_FAIL = (
    'test_rank0_initial_state_wins[DDP]',
)
import torch

torch.equal = lambda a, b: True  # MUTANT: at import, every equality check in the process says "equal"
import torch.distributed as dist
from torch import nn


class DDP(nn.Module):
    """Data parallelism, one asynchronous all-reduce per parameter gradient."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._handles = []
        ### BEGIN SOLUTION
        ### HINT: broadcast parameters and buffers from rank 0; register a post-accumulate-grad hook per trainable parameter
        with torch.no_grad():
            for tensor in module.parameters():  # MUTANT: the buffers keep each rank's own values
                dist.broadcast(tensor, src=0)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._reduce)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reduce(self, param: torch.Tensor) -> None:
        """Called by autograd once `param.grad` holds this step's full gradient."""
        ### BEGIN SOLUTION
        ### HINT: divide by the world size, then start an all_reduce with async_op=True and keep the handle
        param.grad.div_(dist.get_world_size())  # gloo has no AVG: pre-divide, then sum
        self._handles.append(dist.all_reduce(param.grad, async_op=True))
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient's all-reduce of this step."""
        ### BEGIN SOLUTION
        ### HINT: wait on every handle started during backward, then forget them
        for handle in self._handles:
            handle.wait()
        self._handles.clear()
        ### END SOLUTION


class BucketedDDP(nn.Module):
    """Data parallelism with the gradients living in flat buckets of at most `bucket_size_mb` MiB.

    Each bucket is one flat tensor made once; each parameter's `.grad` is a view into its bucket (torch DDP's
    `gradient_as_bucket_view`), so a bucket is all-reduced in place and no step copies gradients in and out.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        self.bucket_size_mb = bucket_size_mb
        self.buckets: list[list[nn.Parameter]] = []
        self._pending = []
        ### BEGIN SOLUTION
        ### HINT: broadcast from rank 0; fill buckets from reversed(list(parameters())); give each bucket one flat tensor and each parameter a view of its slice; hook each parameter
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        limit = bucket_size_mb * 2**20
        current, size = [], 0
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = param.numel() * param.element_size()
            if current and (size + nbytes > limit or param.dtype != current[0].dtype):
                self.buckets.append(current)
                current, size = [], 0
            current.append(param)
            size += nbytes
        if current:
            self.buckets.append(current)
        self._flat = [torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
                      for bucket in self.buckets]
        self._bucket_of, self._view = {}, {}
        for index, (bucket, flat) in enumerate(zip(self.buckets, self._flat)):
            for param, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                self._bucket_of[id(param)], self._view[id(param)] = index, piece.view_as(param)
        self._names = {id(p): name for name, p in module.named_parameters()}
        self._ready = [0] * len(self.buckets)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        ### BEGIN SOLUTION
        ### HINT: make param.grad its bucket view (a new tensor: copy it in, then point .grad at the view) and divide it; when a bucket is complete, all_reduce its flat tensor async
        index, view = self._bucket_of[id(param)], self._view[id(param)]
        if self._ready[index] == len(self.buckets[index]):
            raise RuntimeError("BucketedDDP: a second backward reached a bucket whose all_reduce is still running; "
                               "call finish_gradient_synchronization() after every backward")
        world = dist.get_world_size()
        if param.grad is view:  # autograd accumulated into the bucket itself
            view.div_(world)  # gloo has no AVG: pre-divide, then sum
        else:  # .grad was None (zero_grad's default), so autograd made a new tensor: copy it in, divided
            torch.div(param.grad, world, out=view)
            param.grad = view
        self._ready[index] += 1
        if self._ready[index] == len(self.buckets[index]):
            self._pending.append(dist.all_reduce(self._flat[index], async_op=True))
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        ### BEGIN SOLUTION
        ### HINT: wait for each bucket's all_reduce; the gradients are views of the buckets, so they are then averaged
        for handle in self._pending:
            handle.wait()
        self._pending.clear()
        counts, self._ready = self._ready, [0] * len(self.buckets)
        if any(counts) and counts != [len(bucket) for bucket in self.buckets]:
            missing = [self._names[id(p)] for bucket, n in zip(self.buckets, counts) if n < len(bucket) for p in bucket]
            raise RuntimeError(f"BucketedDDP: the buckets holding {', '.join(missing)} did not get every gradient in "
                               f"this backward, so they were never all-reduced: every trainable parameter must take "
                               f"part in the loss (freeze the others with requires_grad_(False))")
        ### END SOLUTION
