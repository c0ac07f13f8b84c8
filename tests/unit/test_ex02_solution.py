"""The reference BucketedDDP (solutions/ex02_ddp.py) beyond what its grader asks of learners: its gradients are
views of its persistent buckets (no flattening, nothing copied back, the same memory every step, whichever
zero_grad), and its two clear errors (a second backward before finish; a parameter that got no gradient).

One process, a 1-rank gloo group in this test process: the views and the errors do not depend on the world size
(the grader checks the averaging on 2 ranks).
"""
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpucourse import exercises


@pytest.fixture(scope="module")
def solution():
    if dist.is_initialized():
        pytest.skip("this test process already has a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = importlib.util.spec_from_file_location("ex02_solution", exercises.solution_files()["ex02_ddp"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    dist.destroy_process_group()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def inside(tensor, flat) -> bool:
    start, itemsize = flat.data_ptr(), flat.element_size()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * itemsize <= start + flat.numel() * itemsize


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_views_of_the_same_buckets_every_step(solution, set_to_none):
    net = mlp()
    reference = mlp()
    ddp = solution.BucketedDDP(net, bucket_size_mb=0.001)  # ~1 KiB: several buckets
    opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    assert len(ddp.buckets) > 1
    homes = {}
    for step in range(3):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        for model, optim in ((ddp, opt), (reference, ref_opt)):
            optim.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(model(x), y).backward()
        ddp.finish_gradient_synchronization()
        for b, bucket in enumerate(ddp.buckets):
            flat = ddp._flat[b]
            for p in bucket:
                assert inside(p.grad, flat), f"step {step}: a .grad outside its bucket's flat tensor"
                assert homes.setdefault(id(p), p.grad.data_ptr()) == p.grad.data_ptr(), "a .grad moved"
        for p, q in zip(net.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)  # 1 rank: the average is the gradient itself, bit for bit
        opt.step()
        ref_opt.step()


def test_a_second_backward_before_finish_is_refused(solution):
    ddp = solution.BucketedDDP(mlp(), bucket_size_mb=100)
    x = torch.randn(4, 8)
    ddp(x).sum().backward()
    with pytest.raises(RuntimeError, match="call finish_gradient_synchronization\\(\\) after every backward"):
        ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()  # the first round's all_reduce is still waited for


def test_a_parameter_without_gradient_is_named(solution):
    net = mlp()
    net.add_module("unused", nn.Linear(4, 4))  # trainable, never in the forward's graph
    ddp = solution.BucketedDDP(net, bucket_size_mb=0.001)
    net.forward = lambda x: net[4](net[3](net[2](net[1](net[0](x)))))
    ddp(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError, match=r"unused\.weight.*never all-reduced.*requires_grad_\(False\)"):
        ddp.finish_gradient_synchronization()
