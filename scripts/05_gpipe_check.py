"""Chapter 05: your gpipe_step (exercise ex05) and PyTorch's torch.distributed.pipelining, against the unsplit model.

    05_gpipe_check.py --impl ../exercises/ex05_gpipe.py --micro 4

Every rank builds the same model (same seed) and keeps its slice as its stage. Three pipelines run one step
each on the same batch: gpipe_step from --impl, PyTorch's ScheduleGPipe and Schedule1F1B (PipelineStage
around the same slice). Each rank records how far its stage's gradients, and the last rank how far the loss,
are from the unsplit model's on the full batch (computed in this process).
"""
import argparse
import copy
import time

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from gpucourse import exercises, runtime


def make_model(n_layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)])


def mine(module, stage, ctx, x, y, m):
    """(loss on the last rank or None, seconds) of one gpipe_step."""
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
    start = time.perf_counter()
    loss = module.gpipe_step(stage, x if first else None, y if last else None, nn.MSELoss(), m)
    return (None if loss is None else float(loss)), time.perf_counter() - start


def torch_schedule(cls, stage, ctx, x, y, m):
    """The same step with PyTorch's schedule `cls`: it scales each micro-batch loss by 1/m itself."""
    pipe_stage = PipelineStage(stage, ctx.rank, ctx.world_size, ctx.device)
    schedule = cls(pipe_stage, n_microbatches=m, loss_fn=nn.MSELoss())
    losses, start = [], time.perf_counter()
    if ctx.rank == 0:
        schedule.step(x)
    elif ctx.rank == ctx.world_size - 1:
        schedule.step(target=y, losses=losses)  # the m micro-batch losses (unscaled)
    else:
        schedule.step()
    seconds = time.perf_counter() - start
    return (float(torch.stack(losses).detach().mean()) if losses else None), seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", required=True, help="the file defining gpipe_step (exercise ex05)")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2, help="blocks per stage")
    args = parser.parse_args()
    ctx = runtime.setup(seed=0, seed_per_rank=False, cuda_with_gloo=False)  # gloo's send/recv: CPU tensors only
    torch.set_num_threads(1)
    rank, p, L, m = ctx.rank, ctx.world_size, args.layers, args.micro
    full = make_model(p * L, args.width)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m * args.micro_batch, args.width, generator=gen)
    y = torch.randn(m * args.micro_batch, args.width, generator=gen)
    reference = copy.deepcopy(full)
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()  # the unsplit model on the full batch
    ref_grads = [q.grad for q in reference[rank * L:(rank + 1) * L].parameters()]
    module = exercises.load_file(args.impl, "ex05_gpipe")
    runs = {"gpipe_step": lambda s: mine(module, s, ctx, x, y, m),
            "torch ScheduleGPipe": lambda s: torch_schedule(ScheduleGPipe, s, ctx, x, y, m),
            "torch Schedule1F1B": lambda s: torch_schedule(Schedule1F1B, s, ctx, x, y, m)}
    for name, run in runs.items():
        stage = copy.deepcopy(full[rank * L:(rank + 1) * L])
        try:
            loss, seconds = run(stage)
        except NotImplementedError as err:  # every rank raises it at once: nobody is left waiting
            runtime.log(pipeline=name, error=f"not implemented: {err}")
            continue
        diff = max((q.grad - g).abs().max().item() for q, g in zip(stage.parameters(), ref_grads))
        runtime.log(pipeline=name, error=None, max_grad_diff=diff, loss=loss, ref_loss=ref_loss.item(),
                    seconds=seconds)
    runtime.teardown()


if __name__ == "__main__":
    main()
