"""Chapter 05: one model cut into p stages, one stage per rank, trained with GPipe or 1F1B over p2p send/recv.

    --schedules gpipe 1f1b  --micro 1 2 4 8  --micro-batch 16 --width 64 --layers 2 --work-ms 20
    gpucourse dryrun scripts/05_pipeline.py --world 1024 -- --schedules 1f1b --micro 8 --work-ms 0  # 1,024 stages

For every (schedule, m): --steps logged steps of m micro-batches of --micro-batch samples, the last one profiled
(spans F<i> / B<i> per micro-batch: traces/<schedule>-m<m>-rank<r>.json). --work-ms: a fixed sleep per forward (x2
per backward), "compute" of known length, so that the bubble can be measured on a loaded laptop.

Each rank records, per (schedule, m): the activation bytes autograd saved per micro-batch, the most bytes (and
micro-batches) it held at once, its gradients' largest difference from the unsplit model's (same seed, this process).
"""
import argparse
import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from gpucourse import runtime


def make_model(n_layers: int, width: int) -> nn.Sequential:
    """The whole model, the same on every rank (same seed): n_layers Linear+Tanh blocks of one width."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)])


def schedule(kind: str, stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """The actions of one stage, in order: ("F", i) forward of micro-batch i, ("B", i) its backward.

    gpipe: all m forwards, then all m backwards.
    1f1b:  p-1-stage forwards to fill the pipe (warmup), then one forward, one backward, ... (steady state),
           then the remaining backwards (cooldown). A stage never holds more than p-stage micro-batches.
    """
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - 1 - stage, m)
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]


class SavedBytes:
    """Counts the bytes autograd saves for backward (activations; parameters excluded: they are held anyway)."""

    def __init__(self, params):
        self.param_storage = {p.untyped_storage().data_ptr() for p in params}
        self.bytes = 0

    def pack(self, t):
        if t.untyped_storage().data_ptr() not in self.param_storage:
            self.bytes += t.numel() * t.element_size()
        return t

    def hooks(self):
        self.bytes = 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def run_step(kind, stage, ctx, m, x, y, work_s, mem):
    """One training step of the pipeline; returns {micro-batch: saved bytes}, peak bytes and peak count."""
    rank, p = ctx.rank, ctx.world_size
    first, last = rank == 0, rank == p - 1
    xs, ys = (x.chunk(m) if first else None), (y.chunk(m) if last else None)
    shape = (x.shape[0] // m, x.shape[1])
    held, saved_bytes, sends = {}, {}, []  # held: micro-batch -> (input, output or loss), until its backward
    live = peak = peak_count = 0
    for action, i in schedule(kind, rank, p, m):
        if action == "F":
            if first:
                inp = xs[i]
            else:
                inp = torch.empty(shape)
                dist.recv(inp, rank - 1)  # waiting for the previous stage: idle time, outside the F span
                inp.requires_grad_()
            with record_function(f"F{i}"), mem.hooks():
                out = stage(inp)
                if last:
                    out = nn.functional.mse_loss(out, ys[i]) / m  # mean over the full batch
                time.sleep(work_s)
            saved_bytes[i] = mem.bytes
            live += mem.bytes
            held[i] = (inp, out)
            peak, peak_count = max(peak, live), max(peak_count, len(held))
            if not last:
                sends.append(dist.isend(out.detach(), rank + 1))  # asynchronous: go on with the next action
        else:
            inp, out = held.pop(i)
            grad = None
            if not last:
                grad = torch.empty_like(out)
                dist.recv(grad, rank + 1)  # waiting for the next stage's backward: idle time
            with record_function(f"B{i}"):
                out.backward(grad)
                time.sleep(2 * work_s)  # a backward costs about twice a forward
            live -= saved_bytes[i]
            if not first:
                sends.append(dist.isend(inp.grad, rank - 1))
    for work in sends:
        work.wait()
    return saved_bytes, peak, peak_count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    parser.add_argument("--micro", nargs="+", type=int, default=[1, 2, 4, 8], help="micro-batch counts m")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2, help="Linear+Tanh blocks per stage")
    parser.add_argument("--work-ms", type=float, default=20.0, help="sleep per forward (x2 per backward); 0: none")
    parser.add_argument("--steps", type=int, default=2, help="steps per configuration; the last is profiled")
    args = parser.parse_args()

    ctx = runtime.setup(seed=0, seed_per_rank=False, cuda_with_gloo=False)  # gloo's send/recv: CPU tensors only
    torch.set_num_threads(1)
    # The first `tensor.backward(gradient)` of a process imports sympy (seconds here): not inside a step.
    torch.ones(2, requires_grad=True).mul(2).backward(torch.ones(2))
    rank, p, L = ctx.rank, ctx.world_size, args.layers
    full = make_model(p * L, args.width)
    stage = copy.deepcopy(full[rank * L:(rank + 1) * L])  # this rank's slice of the layers
    mem = SavedBytes(stage.parameters())
    steps_done = 0  # over every (schedule, m)
    for kind in args.schedules:
        for m in args.micro:
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m * args.micro_batch, args.width, generator=gen)
            y = torch.randn(m * args.micro_batch, args.width, generator=gen)
            with runtime.profile(wait=0, warmup=args.steps - 1, active=1, name=f"{kind}-m{m}-rank") as prof:
                for _ in range(args.steps):
                    stage.zero_grad(set_to_none=True)
                    with record_function("sync-start"):
                        dist.barrier()  # the stages start the step together...
                    saved, peak, peak_count = run_step(kind, stage, ctx, m, x, y, args.work_ms / 1e3, mem)
                    with record_function("sync-end"):
                        dist.barrier()  # ...and the step ends when the slowest stage is done
                    prof.step()
                    runtime.log(step=(steps_done := steps_done + 1))
            if not runtime.dry_run():  # a dry run has no values to compare (and p stages' reference is slow there)
                reference = copy.deepcopy(full)  # the unsplit model on the full batch, in this process
                nn.functional.mse_loss(reference(x), y).backward()
                pairs = zip(stage.parameters(), reference[rank * L:(rank + 1) * L].parameters())
            diff = None if runtime.dry_run() else max((a.grad - b.grad).abs().max().item() for a, b in pairs)
            runtime.log(schedule=kind, m=m, p=p, saved_bytes=list(saved.values()), peak_bytes=peak,
                        peak_micro=peak_count, max_grad_diff=diff, work_ms=args.work_ms)
            if rank == 0 and diff is not None:  # None in a dry run: no value means anything there
                print(f"{kind} m={m}: done (gradients vs unsplit model: max diff {diff:.1e})", flush=True)
    runtime.teardown()


if __name__ == "__main__":
    main()
