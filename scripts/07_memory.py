"""Chapter 07: bytes of parameters, gradients and optimizer states per rank under DDP, ZeRO-1 and FSDP.

    --modes ddp zero1 sharded fsdp2 fsdp    trained one after the other, each from the same initial weights
      ddp      DistributedDataParallel + AdamW (everything replicated)
      zero1    DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)          (ZeRO-1)
      sharded  DDP + ShardedOptimizer from --sharded-impl (exercise ex07 part 1)      (ZeRO-1)
      fsdp2    torch.distributed.fsdp.fully_shard on every layer and the root         (ZeRO-3)
      fsdp     FSDP from --fsdp-impl (exercise ex07 part 2)                           (ZeRO-3)

Each rank trains on its own slice of the same batches for --steps AdamW steps, then logs per mode: the bytes
of its parameters, gradients and optimizer states (tensor bytes; a DTensor counts its local shard), and, on
rank 0, the largest difference of the full parameters from the ddp run's. An exercise file that is not written
yet (NotImplementedError) is replaced by its solution, and the record says so; in a student release, which has
no solutions, its mode is left out and rank 0 says so.

    gpucourse dryrun scripts/07_memory.py --world 1024 -- --modes fsdp2 --width 1024 --batch 1024
runs it as ranks 0 and 1023 of 1,024 (FSDP2 over all of them) with a fake process group: each training step's
collectives, memory and FLOPs counted (steps are numbered across the modes), values read as None.
"""
import argparse
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from gpucourse import runtime

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"  # absent from a student release
EXERCISES = Path(__file__).resolve().parents[1] / "exercises"
LR = 1e-3


def make_model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights for every mode
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nbytes(t) -> int:
    """Bytes this rank holds for tensor t: a DTensor (FSDP2) holds only its local shard."""
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def held_tensors(obj, exclude, seen=None) -> list:
    """Every tensor reachable from an optimizer object (its state, an inner optimizer's...), except `exclude`."""
    seen = set() if seen is None else seen
    if id(obj) in seen or id(obj) in exclude:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not callable(obj):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in held_tensors(item, exclude, seen)]


def build(mode: str, args, impls, device):
    """(model to call, optimizer, parameters this rank holds, function returning the full parameters)."""
    net = make_model(args.width, args.depth).to(device)
    if mode in ("ddp", "zero1", "sharded"):
        model = DDP(net)
        params = list(net.parameters())
        if mode == "ddp":
            opt = torch.optim.AdamW(params, lr=LR)
        elif mode == "zero1":
            opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            opt = impls["sharded"].ShardedOptimizer(params, torch.optim.AdamW, lr=LR)
        return model, opt, params, lambda: [p.detach() for p in net.parameters()]
    if mode == "fsdp2":  # the mesh on the rank's device: fully_shard's default is CUDA's whenever a GPU exists
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        params = list(net.parameters())
        return model, torch.optim.AdamW(params, lr=LR), params, lambda: [p.full_tensor() for p in net.parameters()]
    model = impls["fsdp"].FSDP(net)
    params = list(model.parameters())
    return model, torch.optim.AdamW(params, lr=LR), params, lambda: list(model.gather_full_params().values())


def train(mode: str, args, impls, ctx, reference):
    cuda = ctx.device.type == "cuda"
    if cuda:  # on a GPU, also the allocator's own count: the peak this mode adds to what was already held
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held_before = torch.cuda.memory_allocated()
    model, opt, params, full = build(mode, args, impls, ctx.device)
    gen = torch.Generator().manual_seed(1)
    per_rank = args.batch // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    for i in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=gen).to(ctx.device)
        loss = model(x[mine]).square().mean()
        opt.zero_grad()
        loss.backward()
        if mode == "fsdp":
            model.finish_gradient_synchronization()
        opt.step()
        runtime.log(step=args.modes.index(mode) * args.steps + i)  # one step: what a dry run reports
    peak = torch.cuda.max_memory_allocated() - held_before if cuda else None  # before the checks copy anything
    exclude = {id(p) for p in params} | {id(p.grad) for p in params if p.grad is not None}
    state = held_tensors(opt, exclude)
    final = [t.detach().clone() for t in full()]
    diffs = [] if reference is None else [runtime.value((a - b).abs().max()) for a, b in zip(final, reference)]
    diff = None if not diffs or None in diffs else max(diffs)  # None in a dry run: no value means anything
    numel = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    runtime.log(mode=mode, num_params=numel, params=sum(nbytes(p) for p in params),
                grads=sum(nbytes(p.grad) for p in params), optimizer=sum(nbytes(t) for t in state),
                max_diff_vs_ddp=diff, impl=impls.get(f"{mode}_path"),
                cuda_peak=peak)
    return final


def load_impls(args) -> dict:
    """The exercise files, or their solutions where they are not written yet."""
    impls = {}
    for key, path, solution in (("sharded", args.sharded_impl, "ex07_sharded_optimizer.py"),
                                ("fsdp", args.fsdp_impl, "ex07_fsdp.py")):
        module = load(path, f"ex07_{key}")
        impls[key], impls[f"{key}_path"] = module, path
        impls[f"{key}_fallback"] = SOLUTIONS / solution
    return impls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", nargs="+", default=["ddp", "zero1", "sharded", "fsdp2", "fsdp"],
                        choices=["ddp", "zero1", "sharded", "fsdp2", "fsdp"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="global batch (divisible by the world size)")
    parser.add_argument("--sharded-impl", default=str(EXERCISES / "ex07_sharded_optimizer.py"))
    parser.add_argument("--fsdp-impl", default=str(EXERCISES / "ex07_fsdp.py"))
    parser.add_argument("--cuda-with-gloo", action="store_true",
                        help="diagnosis only: gloo ranks sharing a GPU hold CUDA tensors (crashed with SIGSEGV on "
                             "an H100; see gpucourse gpu-check --only gloo_cuda_segv)")
    args = parser.parse_args()
    # sharing a GPU through gloo crashed (SIGSEGV) on an H100: CPU tensors unless asked
    ctx = runtime.setup(seed=0, cuda_with_gloo=args.cuda_with_gloo)
    impls = load_impls(args)
    reference = None
    for mode in args.modes:
        try:
            final = train(mode, args, impls, ctx, reference)
        except NotImplementedError as err:  # the exercise is not written yet: measure the solution instead
            if mode not in ("sharded", "fsdp"):
                raise
            if not impls[f"{mode}_fallback"].is_file():  # a student release (`gpucourse release`)
                if ctx.rank == 0:
                    print(f"{impls[f'{mode}_path']} is not written yet ({err}) and solutions are not part of "
                          f"this release: mode {mode} is left out. Write it, then run again", flush=True)
                continue
            if ctx.rank == 0:
                print(f"{impls[f'{mode}_path']} is not written yet ({err}): using the solution", flush=True)
            impls[mode] = load(str(impls[f"{mode}_fallback"]), f"ex07_{mode}_solution")
            impls[f"{mode}_path"] = str(impls[f"{mode}_fallback"])
            final = train(mode, args, impls, ctx, reference)
        if mode == "ddp":
            reference = final
    runtime.teardown()


if __name__ == "__main__":
    main()
