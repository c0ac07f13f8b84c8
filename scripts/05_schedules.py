"""Chapter 05: PyTorch's pipeline schedules (1F1B, interleaved 1F1B, zero bubble, DualPipeV) on one model, against
the unsplit one.

    05_schedules.py --schedules 1F1B Interleaved1F1B InterleavedZeroBubble ZBVZeroBubble DualPipeV --micro 1 4

One model of p·v·L Linear+Tanh blocks in float64, the same on every rank (same seed), cut into stages:
- single-stage schedules (GPipe, 1F1B): p stages of v·L blocks, stage r on rank r;
- interleaved schedules (Interleaved1F1B, InterleavedZeroBubble): p·v stages of L blocks, stage s on rank s mod p
  ("loop" placement: rank 0 holds stages 0, p, 2p, ...);
- ZBVZeroBubble and DualPipeV: exactly 2 stages per rank in a "V": rank r holds stages r and 2p-1-r, so rank 0
  holds the first and the last stage.

Every stage is a TimedStage: PyTorch's PipelineStage whose compute (a forward F, a full backward B, or the
zero-bubble split of the backward into its input-gradient part I and weight-gradient part W) is a
record_function span named "compute <stage><F|B|I|W><micro-batch>", plus a fixed sleep of known length so that
the bubble can be measured on a loaded machine: per micro-batch, each rank's forwards sleep --work-ms in all,
its backwards twice that, split evenly between I and W, whatever the schedule and v.

Each rank also counts, in the last step, the activations its stages hold: the bytes autograd saves in each forward
chunk (parameters excluded), alive from that forward until the chunk's backward has finished (its full backward B,
or its W for a split one), and the most chunks and bytes alive at once. It logs the order of compute actions the
schedule planned for it (torch's own notation, e.g. "(0F3;3B1)OVERLAP_F_B" for DualPipeV's forward-backward pairs).

For every (schedule, m) it runs --steps steps and profiles the last (traces/<schedule>-m<m>-rank<r>.json), then
checks the loss (on the rank holding the last stage) and every local stage's gradients against the unsplit
model on the full batch, computed in this process: it asserts they agree to float64 rounding. A schedule that
PyTorch refuses for these sizes (its constructor raises, on every rank alike) is recorded with its error.
"""
import argparse
import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.profiler import record_function

from gpucourse import runtime
from gpucourse.run import hardware

# float64: the pipeline adds the micro-batch gradients in another order than the unsplit model, which moves
# float64 results by ~1e-16 relative; 1e-10 leaves room for that and still catches any real mistake (a missing
# 1/m scale or a lost micro-batch changes gradients by their own size, 1e-4 or more here).
TOL = 1e-10
# The schedules this script places stages for (get_schedule_class knows more: LoopedBFS, DualPipeV, ...).
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}  # 2 stages per rank: r and 2p-1-r
# torch 2.11 starts a V-shaped schedule by sending between the two stages one rank holds, to itself: gloo refuses
# ("Pair is not connected") and the job dies. 2.12 keeps that exchange local (both seen on CPU ranks, gloo).
V_SHAPED_SINCE = (2, 12)


def make_model(n_blocks: int, width: int) -> nn.Sequential:
    """The whole model, the same on every rank (same seed): n_blocks Linear+Tanh blocks of one width."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_blocks)])


def stages_of(name: str, rank: int, p: int, v: int) -> list[int]:
    """The stage indices rank `rank` holds under schedule `name`, and so how many stages the model is cut into."""
    if issubclass(get_schedule_class(name), PipelineScheduleSingle):
        return [rank]                                  # p stages, one per rank
    if name in V_SHAPED:
        return [rank, 2 * p - 1 - rank]                # the "V": down the ranks, then back up
    return [rank + k * p for k in range(v)]            # "loop": p·v stages, round robin


class Held:
    """The activations one rank's stages hold: saved bytes per (stage, chunk), from its forward to its backward."""

    def __init__(self, params):
        self.params = {q.untyped_storage().data_ptr() for q in params}
        self.reset()

    def reset(self):
        self.alive, self.chunk_bytes, self.peak_chunks, self.peak_bytes = {}, {}, 0, 0

    def forward(self, key):
        """Context for one forward chunk: counts what autograd saves (not parameters: they are held anyway)."""
        self.alive[key] = 0

        def pack(t):
            if t.untyped_storage().data_ptr() not in self.params:
                self.alive[key] += t.numel() * t.element_size()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def forward_done(self, key):
        self.chunk_bytes[key] = self.alive[key]
        self.peak_chunks = max(self.peak_chunks, len(self.alive))
        self.peak_bytes = max(self.peak_bytes, sum(self.alive.values()))

    def backward_done(self, key):
        self.alive.pop(key, None)


class TimedStage(PipelineStage):
    """A PipelineStage whose compute is one trace span per action plus a fixed sleep (--work-ms).

    The schedules call these three methods for their compute and do their send/recv outside them, so the
    spans hold compute only: the gaps between them are the stage's idle time (bubble and communication).
    """

    def __init__(self, *args, forward_s: float, held: Held, **kwargs):
        super().__init__(*args, **kwargs)
        self.forward_s = forward_s  # a backward costs twice a forward: I and W once each
        self.held = held

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        key = (self.stage_index, fwd_chunk_id)
        with record_function(f"compute {self.stage_index}F{fwd_chunk_id}"), self.held.forward(key):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            time.sleep(self.forward_s)
        self.held.forward_done(key)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        kind = "B" if full_backward else "I"  # I: the input gradient only, sent back at once; W comes later
        with record_function(f"compute {self.stage_index}{kind}{bwd_chunk_id}"):
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                             last_backward=last_backward)
            time.sleep(self.forward_s * (2 if full_backward else 1))
        if full_backward:
            self.held.backward_done((self.stage_index, bwd_chunk_id))
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with record_function(f"compute {self.stage_index}W{bwd_chunk_id}"):
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            time.sleep(self.forward_s)
        self.held.backward_done((self.stage_index, bwd_chunk_id))
        return out


def run(name, full, ctx, args, m, x, y):
    """Build the stages and the schedule, run --steps steps (the last profiled); return the record to log."""
    if name in V_SHAPED and hardware.torch_release() < V_SHAPED_SINCE:  # every rank alike: nothing is sent
        return {"error": f"needs torch >= {'.'.join(map(str, V_SHAPED_SINCE))} (this is {torch.__version__}: its "
                         "V-shaped schedules send a rank's stage to itself at the start, which gloo refuses)"}
    rank, p, v = ctx.rank, ctx.world_size, args.virtual
    indices = stages_of(name, rank, p, v)
    n_stages = p * len(indices)
    per_stage = len(full) // n_stages
    mods = {s: copy.deepcopy(full[s * per_stage:(s + 1) * per_stage]) for s in indices}
    held = Held([q for mod in mods.values() for q in mod.parameters()])
    stages = [TimedStage(mods[s], s, n_stages, ctx.device, forward_s=args.work_ms / 1e3 / len(indices), held=held)
              for s in indices]
    cls = get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    try:
        schedule = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=nn.MSELoss())
    except (ValueError, AssertionError) as err:  # raised by the constructor, on every rank alike
        return {"error": f"{type(err).__name__}: {err}"}
    first, last = 0 in indices, n_stages - 1 in indices
    seconds = []
    with runtime.profile(wait=0, warmup=args.steps - 1, active=1, name=f"{name}-m{m}-rank") as prof:
        for _ in range(args.steps):
            for mod in mods.values():
                mod.zero_grad(set_to_none=True)
            losses = []
            held.reset()
            with record_function("sync-start"):
                dist.barrier()  # the ranks start the step together...
            start = time.perf_counter()
            schedule.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
            with record_function("sync-end"):
                dist.barrier()  # ...and the step ends when the slowest rank is done
            seconds.append(time.perf_counter() - start)
            prof.step()
    reference = copy.deepcopy(full)  # the unsplit model on the full batch, in this process
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    diff = max((q.grad - r.grad).abs().max().item() for s in indices
               for q, r in zip(mods[s].parameters(), reference[s * per_stage:(s + 1) * per_stage].parameters()))
    loss = float(torch.stack(losses).detach().mean()) if last else None  # mean of m equal micro-batch means
    assert diff < TOL, f"{name} m={m} rank {rank}: gradients differ from the unsplit model's by {diff:.1e}"
    assert loss is None or abs(loss - ref_loss.item()) < TOL, f"{name} m={m}: loss {loss} != {ref_loss.item()}"
    order = [] if single else schedule.pipeline_order[rank]  # the plan of a multi-stage schedule, per rank
    return {"error": None, "stages": indices, "n_stages": n_stages, "max_grad_diff": diff, "loss": loss,
            "ref_loss": ref_loss.item(), "step_s": seconds, "order": [str(a) for a in order if a is not None],
            "peak_chunks": held.peak_chunks, "peak_bytes": held.peak_bytes,
            "chunk_bytes": sorted(set(held.chunk_bytes.values()))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES,
                        help="names as torch.distributed.pipelining.schedules.get_schedule_class takes them")
    parser.add_argument("--micro", nargs="+", type=int, default=[1, 4, 8], help="micro-batch counts m")
    parser.add_argument("--virtual", type=int, default=2, help="stages per rank v of the interleaved schedules")
    parser.add_argument("--layers", type=int, default=1, help="Linear+Tanh blocks per stage of an interleaved schedule")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--work-ms", type=float, default=20.0, help="sleep per micro-batch forward on a rank (x2 "
                        "per backward), split over its stages")
    parser.add_argument("--steps", type=int, default=2, help="steps per configuration; the last is profiled")
    args = parser.parse_args()
    for name in args.schedules:
        if name in V_SHAPED and args.virtual != 2:
            parser.error(f"{name} needs exactly 2 stages per rank: pass --virtual 2 (got {args.virtual})")
    if args.virtual < 1 or min(args.micro) < 1:
        parser.error(f"--virtual {args.virtual} and --micro {args.micro} must be >= 1")

    ctx = runtime.setup(seed=0, seed_per_rank=False, cuda_with_gloo=False)  # gloo's send/recv: CPU tensors only
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    p = ctx.world_size
    full = make_model(p * args.virtual * args.layers, args.width)
    for name in args.schedules:
        for m in args.micro:
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m * args.micro_batch, args.width, generator=gen)
            y = torch.randn(m * args.micro_batch, args.width, generator=gen)
            record = run(name, full, ctx, args, m, x, y)
            runtime.log(schedule=name, m=m, p=p, v=args.virtual, work_ms=args.work_ms, **record)
            if ctx.rank == 0:
                print(f"{name} m={m}: " + (record["error"] or f"done, gradients vs unsplit model: max diff "
                                           f"{record['max_grad_diff']:.1e}"), flush=True)
    runtime.teardown()


if __name__ == "__main__":
    main()
