# Generated from solutions/ex02_ddp.py by `gpucourse make-exercises`: course authors edit the
# solution, not this file. Learners: fill in every `# YOUR CODE HERE`, then `gpucourse grade ex02`.
"""Exercise 02: build your own DistributedDataParallel, first per parameter, then with buckets.

Task
----
`DDP(module)` wraps a model so that N processes, each running forward/backward on its own slice of the
batch, end every step with the SAME averaged gradients, exactly as one process on the whole batch would
(with a mean-reduced loss). `BucketedDDP(module, bucket_size_mb)` does the same with fewer, larger
messages. Training loop (the grader's):

    model = DDP(net)                      # or BucketedDDP(net, bucket_size_mb=1)
    loss = loss_fn(model(x_local), y_local)
    loss.backward()
    model.finish_gradient_synchronization()
    optimizer.step()

Rules
-----
- On construction, broadcast rank 0's parameters AND buffers to every rank (rank 0's initial values win).
- Overlap communication with backward: start each gradient's all-reduce asynchronously (`async_op=True`)
  as soon as that gradient is ready — `param.register_post_accumulate_grad_hook` tells you — not after
  backward. `finish_gradient_synchronization()` waits for the outstanding work and leaves the AVERAGE
  gradient (sum / world size) in every `param.grad`. The grader checks that communication starts
  before backward ends.
- Parameters with `requires_grad=False` are never communicated; tied (shared) parameters are one
  parameter (`module.parameters()` yields each once) and must be reduced once.
- `.module` is the wrapped module; calling the wrapper runs the module's forward.
- BucketedDDP: group parameters (in reverse order of `module.parameters()`, roughly the order backward
  produces their gradients) into buckets of at most `bucket_size_mb` MiB of gradient (a parameter larger
  than that gets a bucket of its own); all-reduce a bucket — one flattened tensor — as soon as all its
  gradients are ready; expose the grouping as `self.buckets` (a list of lists of parameters).
- Keep it as fast as torch's DDP the way torch's `gradient_as_bucket_view=True` does: give each bucket one
  flat tensor, made once, and make each `param.grad` a view into it. Autograd then accumulates straight
  into the bucket, which is all-reduced in place: nothing is flattened or copied back. `optimizer.zero_grad()`
  sets `.grad` to None (its default, set_to_none=True), and autograd then hands over a new tensor: copy it
  into the view and point `.grad` back at the view. Both `zero_grad(set_to_none=False)` (the views kept and zeroed) and accumulating
  several backward + finish rounds before `optimizer.step()` must give the same gradients as one process.
- Do not use `torch.nn.parallel.DistributedDataParallel` (the grader checks).

Check your work: `gpucourse grade ex02`.
"""
import torch
import torch.distributed as dist
from torch import nn


class DDP(nn.Module):
    """Data parallelism, one asynchronous all-reduce per parameter gradient."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._handles = []
        # YOUR CODE HERE
        raise NotImplementedError("broadcast parameters and buffers from rank 0; register a post-accumulate-grad hook per trainable parameter")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _reduce(self, param: torch.Tensor) -> None:
        """Called by autograd once `param.grad` holds this step's full gradient."""
        # YOUR CODE HERE
        raise NotImplementedError("divide by the world size, then start an all_reduce with async_op=True and keep the handle")

    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient's all-reduce of this step."""
        # YOUR CODE HERE
        raise NotImplementedError("wait on every handle started during backward, then forget them")


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
        # YOUR CODE HERE
        raise NotImplementedError("broadcast from rank 0; fill buckets from reversed(list(parameters())); give each bucket one flat tensor and each parameter a view of its slice; hook each parameter")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # YOUR CODE HERE
        raise NotImplementedError("make param.grad its bucket view (a new tensor: copy it in, then point .grad at the view) and divide it; when a bucket is complete, all_reduce its flat tensor async")

    def finish_gradient_synchronization(self) -> None:
        # YOUR CODE HERE
        raise NotImplementedError("wait for each bucket's all_reduce; the gradients are views of the buckets, so they are then averaged")
