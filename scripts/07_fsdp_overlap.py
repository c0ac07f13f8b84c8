"""Chapter 07, section 7: FSDP2's prefetching seen in the trace, HSDP on a 2D mesh against FSDP and DDP, and gradient
accumulation with and without gradient sync.

    --mode prefetch    the same MLP under fully_shard three ways, one after the other, each profiled
                       (traces/<variant>-rank<r>.json):
      defaults   fully_shard on every Linear and on the root, FSDP2's defaults (implicit prefetching)
      prefetch   the same, plus explicit prefetching: layer i starts layer i+1's all-gather in forward (i-1's in
                 backward), issued asynchronously so that it runs while layer i computes
      root-only  the common mistake: fully_shard on the root only, so the whole model is one all-gather
    Logged per variant: the all-gathers of one step (count, bytes), the most unsharded parameter bytes a layer's
    forward saw at once, this rank's loss of every step. Asserted: the three train to the same parameters. A first,
    unlogged pass of the first variant warms the process up, so that no variant pays its first-time costs.
    --mode hsdp --replicate R   DDP, FSDP over all N ranks, and HSDP on an (R, N/R) mesh ("replicate", "shard"):
    logged per variant: bytes of parameters, gradients and optimizer states this rank holds, every collective of
    one step (op, process group, bytes), the global loss of every step. Asserted: losses and final parameters
    equal a one-process run on the whole batch (each rank runs it locally, without communication).
    --mode accumulate --micro K   FSDP2 over all N ranks, each step accumulating K micro-batches, three ways:
      sync        every micro-batch's backward reduce-scatters its gradients (FSDP2's default)
      no-sync     set_requires_gradient_sync(False) before the first K-1 backwards, True before the last: one
                  reduce-scatter per step; FSDP2 keeps the unsharded gradients between micro-batches
      no-reshard  no-sync, plus set_reshard_after_backward(False) on the first K-1: the gathered parameters stay
                  unsharded between micro-batches, so the next forward needs no all-gather
    In float64. Logged per variant: every collective of the last step (op, bytes), the global loss of every step, and
    the first Linear's weight as FSDP2 holds it (global and local shape, placements). Asserted: losses and final
    parameters equal a one-process run on the whole batch.
"""
import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

LR = 1e-3
COUNTED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_reduce")


class CommCounter:
    """Counts the collectives FSDP2 and DDP issue through torch.distributed while `on`: op, group, bytes.

    fully_shard calls dist.all_gather_single / dist.reduce_scatter_single (and, for HSDP, dist.all_reduce)
    through the module, and DDP with `allreduce_hook` (the Python twin of its default hook) calls
    dist.all_reduce: wrapping those names sees every collective of a step. Bytes are the payload: an
    all-gather's gathered output, a reduce-scatter's full input, an all-reduce's buffer.
    """

    def __init__(self):
        self.calls, self.on = [], False
        for name in COUNTED:
            if hasattr(dist, name):  # torch 2.11 has no *_single names: its fully_shard calls the older ones
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, real):
        def counted(*args, **kwargs):
            if self.on:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                group = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
                self.calls.append({"op": name.replace("_single", "").replace("_into_tensor", "")
                                   .replace("_tensor", ""), "ranks": ranks,
                                   "bytes": max(t.numel() * t.element_size() for t in tensors),
                                   "async": bool(kwargs.get("async_op"))})
            return real(*args, **kwargs)

        return counted

    def take(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


def make_model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights for every variant and the reference
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])


def linears(net: nn.Module) -> list[nn.Linear]:
    return [m for m in net if isinstance(m, nn.Linear)]


def nbytes(t) -> int:
    """Bytes this rank holds for t (as 07_memory.py counts): a DTensor only its local shard."""
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def full(params) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in params]


# --- prefetching --------------------------------------------------------------------------------------------
def shard_for(variant: str, net: nn.Sequential) -> nn.Module:
    layers = linears(net)
    if variant != "root-only":
        for layer in layers:
            fully_shard(layer)
    fully_shard(net)
    if variant == "prefetch":
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])  # the next layer, in forward
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])  # the previous one, in backward
        # Issue the prefetched all-gathers with async_op=True: the caller does not wait for them. FSDP2's
        # implicit prefetching overlaps through CUDA streams, which a CPU does not have; this (private) switch
        # is the one FSDP2 offers for overlap without them.
        net._set_unshard_async_op(True)
    return net


class UnshardedWatch:
    """At every Linear's forward (after FSDP2's own pre-forward hook has gathered it), the bytes of the model's
    parameters that are unsharded at that moment: plain tensors instead of DTensor shards. (FSDP2 prepends its
    hook, so it runs first wherever this one is registered.)"""

    def __init__(self, net: nn.Module):
        self.peak, self.on = 0, False
        self.layers = linears(net)
        for layer in self.layers:
            layer.register_forward_pre_hook(self.look)

    def look(self, module, args):
        if self.on:
            held = sum(p.numel() * p.element_size() for layer in self.layers for p in layer.parameters(recurse=False)
                       if not isinstance(p, DTensor))
            self.peak = max(self.peak, held)


def run_prefetch(variant: str, args, ctx, counter: CommCounter, record: bool = True) -> list[torch.Tensor]:
    """Train `variant` for the profiler's wait and warm-up steps and --profile-steps more, profiled; with
    record=False (a warm-up of the process: lazy imports, the first optimizer, the profiler), unprofiled and
    unlogged."""
    net = make_model(args.width, args.depth)
    watch = UnshardedWatch(net)
    model = shard_for(variant, net)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    per_rank = args.batch // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    steps = args.profile_steps + 2  # the profiler's wait and warm-up steps, then the profiled ones
    losses = []
    profile = runtime.profile(wait=1, warmup=1, active=args.profile_steps, name=f"{variant}-rank") if record else None
    with profile or contextlib.nullcontext() as prof:
        for step in range(steps):
            x = torch.randn(args.batch, args.width, generator=gen)[mine]
            counter.on = watch.on = step == steps - 1  # count one step: every step issues the same
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            counter.on = watch.on = False
            if prof is not None:
                prof.step()
            losses.append(loss.item())
    calls = counter.take()
    if not record:
        return []
    gathers = [c for c in calls if c["op"] == "all_gather"]
    runtime.log(mode="prefetch", variant=variant, losses=losses, all_gathers=len(gathers),
                all_gather_bytes=[c["bytes"] for c in gathers], async_all_gathers=sum(c["async"] for c in gathers),
                reduce_scatters=sum(c["op"] == "reduce_scatter" for c in calls), peak_unsharded_bytes=watch.peak,
                model_bytes=sum(p.numel() * p.element_size() for p in make_model(args.width, args.depth).parameters()),
                layer_bytes=sum(p.numel() * p.element_size() for p in nn.Linear(args.width, args.width).parameters()))
    return full(model.parameters())


def check_against_one_process(variant, losses, params, reference) -> float:
    """Assert the losses and final parameters equal one process's on the whole batch; return the largest difference."""
    ref_losses, ref_params = reference
    final = full(params)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7,
                               msg=lambda m: f"{variant}: losses differ from one process on the whole batch: {m}")
    for got, want in zip(final, ref_params):
        # atol 1e-5, 1 % of one step's lr: AdamW divides by sqrt(v), so a near-zero gradient summed in another order
        # (4 gloo ranks, fp32) moves its weight by a few 1e-6 more or less; a wrong average would be off by ~lr
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{variant}: parameters differ from one process: {m}")
    return max((a - b).abs().max().item() for a, b in zip(final, ref_params))


# --- HSDP against FSDP and DDP ------------------------------------------------------------------------------
def build(variant: str, args, ctx):
    """(model, the mesh's groups as {name: ranks of this rank's group})."""
    net = make_model(args.width, args.depth)
    if variant == "ddp":
        model = DDP(net)
        model.register_comm_hook(None, allreduce_hook)  # the default all-reduce, through dist.all_reduce
        return model, {"replicate": tuple(range(ctx.world_size))}
    if variant == "fsdp":  # a 1D mesh: shard over every rank (a (1, N) 2D mesh would add 1-rank all-reduces)
        mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("shard",))
    else:  # HSDP: dimension 0 replicates, dimension 1 shards (fully_shard reads them by position)
        mesh = init_device_mesh("cpu", (args.replicate, ctx.world_size // args.replicate),
                                mesh_dim_names=("replicate", "shard"))
    for layer in linears(net):
        fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    return model, {name: tuple(dist.get_process_group_ranks(mesh.get_group(name))) for name in mesh.mesh_dim_names}


def run_hsdp(variant: str, args, ctx, counter: CommCounter, reference) -> None:
    model, groups = build(variant, args, ctx)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    gen = torch.Generator().manual_seed(1)
    per_rank = args.batch // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=gen)[mine]
        counter.on = step == args.steps - 1
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        counter.on = False
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # the mean over ranks of equal slices is the whole batch's loss
        losses.append(global_loss.item() / ctx.world_size)
        if step < args.steps - 1:
            opt.zero_grad()
    calls = counter.take()
    names = {ranks: name for name, ranks in groups.items()}
    for c in calls:
        c["group"] = names.get(c["ranks"], "world" if len(c["ranks"]) == ctx.world_size else "other")
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    ref_losses = reference[0]
    diff = check_against_one_process(variant, losses, params, reference)
    runtime.log(mode="hsdp", variant=variant, groups={k: list(v) for k, v in groups.items()}, losses=losses,
                ref_losses=ref_losses, max_param_diff=diff, params=sum(nbytes(p) for p in params),
                grads=sum(nbytes(p.grad) for p in params),
                optimizer=sum(nbytes(t) for t in state if t.dim() > 0), step_counters=sum(nbytes(t) for t in state
                                                                                          if t.dim() == 0),
                num_params=sum(p.numel() for p in make_model(args.width, args.depth).parameters()),
                calls=[{k: (list(v) if k == "ranks" else v) for k, v in c.items()} for c in calls])


# --- gradient accumulation ------------------------------------------------------------------------------------
ACCUMULATE = ["sync", "no-sync", "no-reshard"]


def run_accumulate(variant: str, args, ctx, counter: CommCounter, reference) -> None:
    net = make_model(args.width, args.depth)
    for layer in linears(net):
        fully_shard(layer)
    model = fully_shard(net)
    weight = linears(net)[0].weight  # what FSDP2 made of one parameter: a DTensor, this rank's rows local
    shard = {"global": list(weight.shape), "local": list(weight.to_local().shape),
             "placements": [repr(pl) for pl in weight.placements]}
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    gen = torch.Generator().manual_seed(1)
    per_rank = args.batch // ctx.world_size
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=gen)[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        counter.on = step == args.steps - 1
        total = torch.zeros(())
        for k, chunk in enumerate(x.chunk(args.micro)):
            last = k == args.micro - 1
            if variant != "sync":
                model.set_requires_gradient_sync(last)  # reduce-scatter only after the last micro-batch
            if variant == "no-reshard":
                model.set_reshard_after_backward(last)  # keep the gathered parameters for the next forward
            loss = model(chunk).square().mean() / args.micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        counter.on = False
        dist.all_reduce(total)  # the mean over ranks of equal slices is the whole batch's loss
        losses.append(total.item() / ctx.world_size)
    calls = counter.take()
    ref_losses = reference[0]
    diff = check_against_one_process(variant, losses, params, reference)
    runtime.log(mode="accumulate", variant=variant, micro=args.micro, losses=losses, ref_losses=ref_losses,
                max_param_diff=diff,
                param_bytes=sum(p.numel() * p.element_size() for p in make_model(args.width, args.depth).parameters()),
                calls=[{"op": c["op"], "bytes": c["bytes"]} for c in calls], shard=shard)


def one_process(args):
    """The reference: the unsharded model trained on the whole batch in this process alone."""
    net = make_model(args.width, args.depth)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        loss = net(torch.randn(args.batch, args.width, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full(net.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["prefetch", "hsdp", "accumulate"], required=True)
    parser.add_argument("--variants", nargs="+", help="default: every variant of the mode")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256, help="global batch (divisible by the world size)")
    parser.add_argument("--profile-steps", type=int, default=3, help="prefetch: profiled steps per variant")
    parser.add_argument("--steps", type=int, default=3, help="hsdp, accumulate: AdamW steps per variant")
    parser.add_argument("--micro", type=int, default=4, help="accumulate: micro-batches per step")
    parser.add_argument("--replicate", type=int, default=2, help="hsdp: the mesh's replicate dimension")
    args = parser.parse_args()
    ctx = runtime.setup(seed=0, cuda_with_gloo=False)  # CPU tensors: gloo on GPUs is not what this measures
    n = ctx.world_size
    problems = [f"--batch {args.batch} is not divisible by the world size {n}"] * (args.batch % n != 0)
    problems += [f"--width {args.width} is not divisible by the world size {n} (FSDP would pad the shards, and the "
                 "byte counts would not match the formulas)"] * (args.width % n != 0)
    if args.mode == "hsdp" and (args.replicate < 1 or n % args.replicate):
        problems.append(f"--replicate {args.replicate} does not divide the world size {n}: the mesh is replicate x "
                        f"shard = {n} ranks; pick a divisor of {n}")
    if args.mode == "accumulate" and (args.micro < 1 or (args.batch // n) % args.micro):
        problems.append(f"--micro {args.micro} does not divide the {args.batch // n} samples per rank: pick a divisor")
    if problems:
        raise SystemExit("07_fsdp_overlap.py: " + "; ".join(problems))
    counter = CommCounter()
    if args.mode == "prefetch":
        variants = args.variants or ["defaults", "prefetch", "root-only"]
        run_prefetch(variants[0], args, ctx, counter, record=False)  # so that the first variant pays no first-time costs
        finals = {}
        for variant in variants:
            finals[variant] = run_prefetch(variant, args, ctx, counter)
        first, *others = finals.items()
        for variant, params in others:  # prefetching moves communication in time, never the arithmetic
            assert all(torch.equal(a, b) for a, b in zip(params, first[1])), (variant, first[0])
    elif args.mode == "hsdp":
        reference = one_process(args)
        for variant in args.variants or ["ddp", "fsdp", "hsdp"]:
            run_hsdp(variant, args, ctx, counter, reference)
    else:
        # float64: K micro-batches add their gradients in another order than one batch, and AdamW turns a rounding
        # difference in a near-zero gradient into a visible one; in float64 it stays far below the tolerance
        torch.set_default_dtype(torch.float64)
        reference = one_process(args)
        for variant in args.variants or ACCUMULATE:
            run_accumulate(variant, args, ctx, counter, reference)
    runtime.teardown()


if __name__ == "__main__":
    main()
