"""Chapter 06: one MLP block three ways on N ranks: dense, PyTorch's DTensor tensor parallelism, and yours (ex06).

    06_dtensor_tp.py --impl exercises/ex06_tensor_parallel.py
    gpucourse dryrun scripts/06_dtensor_tp.py --world 8 -- --hidden 1024   # one node of 8 (or --world 1024)

Every rank builds the same dense MLP (fc1, GELU, fc2) and input from a fixed seed. Then:
  dtensor  torch.distributed.tensor.parallel.parallelize_module with fc1 ColwiseParallel and fc2 RowwiseParallel
           on a 1-D DeviceMesh of all ranks; collectives counted by torch's CommDebugMode, forward and backward
  yours    ParallelMLP.from_dense(fc1, fc2) from --impl; when that file is not written yet (NotImplementedError),
           the reference solution stands in and the record says so (a student release has no solutions:
           there, the record says it is not written yet, with no comparison)
Each is compared with the dense block: output, input gradient, and the weight gradients (DTensor's gathered
with full_tensor(), yours against the matching slices). In a dry run (fake process group) every difference is None:
the collectives are counted, not carried out.
"""
import argparse
import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from gpucourse import exercises, runtime


class MLP(nn.Module):
    def __init__(self, h, ffn):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def max_diff(a, b) -> float | None:
    return runtime.value((a.detach().double() - b.detach().double()).abs().max())  # None in a dry run


def run(model, x, gy) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(output, input gradient, collectives counted by CommDebugMode in forward and in backward)."""
    x = x.clone().requires_grad_()
    with CommDebugMode() as fwd:
        y = model(x)
    with CommDebugMode() as bwd:
        y.backward(gy)
    counts = {phase: {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
              for phase, mode in (("forward", fwd), ("backward", bwd))}
    return y, x.grad, counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default=str(exercises.exercises_dir() / "ex06_tensor_parallel.py"),
                        help="the file defining ParallelMLP (exercise ex06)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    ctx = runtime.setup(seed=0)
    h, ffn = args.hidden, 4 * args.hidden
    torch.manual_seed(2)
    dense = MLP(h, ffn).to(ctx.device)
    gen = torch.Generator().manual_seed(1)
    x, gy = (torch.randn(args.batch, args.seq, h, generator=gen).to(ctx.device) for _ in range(2))
    y_dense, gx_dense, _ = run(dense, x, gy)

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    tp = parallelize_module(copy.deepcopy(dense), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    y_tp, gx_tp, tp_counts = run(tp, x, gy)
    runtime.log(case="dtensor", comms=tp_counts, local_fc1=list(tp.fc1.weight.to_local().shape),
                local_fc2=list(tp.fc2.weight.to_local().shape), weight_type=type(tp.fc1.weight).__name__,
                diffs={"Y": max_diff(y_tp, y_dense), "x.grad": max_diff(gx_tp, gx_dense),
                       "fc1.weight.grad": max_diff(tp.fc1.weight.grad.full_tensor(), dense.fc1.weight.grad),
                       "fc2.weight.grad": max_diff(tp.fc2.weight.grad.full_tensor(), dense.fc2.weight.grad)})

    impl, source = exercises.load_for_chapter(args.impl, "ex06_tensor_parallel",
                                              lambda m: m.ParallelMLP.from_dense(dense.fc1, dense.fc2))
    if impl is None:
        runtime.log(case="yours", source=source, comms={}, diffs={})
        if ctx.rank == 0:
            print(f"dense and DTensor compared on {ctx.world_size} rank(s); yours: {source}", flush=True)
        runtime.teardown()
        return
    mine = impl.ParallelMLP.from_dense(dense.fc1, dense.fc2)
    y_mine, gx_mine, mine_counts = run(mine, x, gy)
    part = slice(ctx.rank * ffn // ctx.world_size, (ctx.rank + 1) * ffn // ctx.world_size)
    runtime.log(case="yours", source=source, comms=mine_counts,
                diffs={"Y": max_diff(y_mine, y_dense), "x.grad": max_diff(gx_mine, gx_dense),
                       "fc1.weight.grad": max_diff(mine.fc1.weight.grad, dense.fc1.weight.grad[part]),
                       "fc2.weight.grad": max_diff(mine.fc2.weight.grad, dense.fc2.weight.grad[:, part]),
                       "Y vs DTensor": max_diff(y_mine, y_tp)})
    if ctx.rank == 0:
        print(f"dense, DTensor and yours ({source}) compared on {ctx.world_size} rank(s)", flush=True)
    runtime.teardown()


if __name__ == "__main__":
    main()
