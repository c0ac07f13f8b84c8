"""Chapter 01: every point-to-point operation and collective on small tensors, logged on every rank.

Rank r starts with 10*r + [0, 1, ..., N-1] (N = world size): the tens digit says which rank a value
came from, the units digit its position. For each operation every rank logs its tensor before and
after with runtime.log, so the notebook can draw what moved where. Each operation is tried, not
assumed: one the backend does not support is logged with its error, and the run goes on.
"""
import time

import torch
import torch.distributed as dist

from gpucourse import runtime

ctx = runtime.setup()
rank, world = ctx.rank, ctx.world_size


def start(device):
    """This rank's tensor: tens digit = rank, units digit = position."""
    return 10 * rank + torch.arange(world, dtype=torch.float32, device=device)


def flat(x):
    return [v for t in x for v in flat(t)] if isinstance(x, (list, tuple)) else x.flatten().tolist()


def send_recv(group, device):
    """Blocking send/recv: rank 0 sends its tensor to rank 1; everyone else does nothing."""
    x = start(device)
    before = flat(x)
    if rank == 0:
        dist.send(x, dst=1, group=group)
    elif rank == 1:
        dist.recv(x, src=0, group=group)
    return before, flat(x)


def isend_irecv(group, device):
    """Non-blocking: every rank sends to its right neighbour and receives from its left, at once."""
    x, got = start(device), torch.zeros(world, device=device)
    requests = [dist.isend(x, dst=(rank + 1) % world, group=group),
                dist.irecv(got, src=(rank - 1) % world, group=group)]
    for request in requests:
        request.wait()  # isend/irecv return at once; the data is only there after wait()
    return flat(x), flat(got)


def broadcast(group, device):
    x = start(device)
    before = flat(x)
    dist.broadcast(x, src=0, group=group)  # rank 0's tensor overwrites everyone's
    return before, flat(x)


def reduce(group, device):
    x = start(device)
    before = flat(x)
    dist.reduce(x, dst=0, group=group)  # the sum arrives on rank 0 only
    return before, flat(x)


def all_reduce(group, device):
    x = start(device)
    before = flat(x)
    dist.all_reduce(x, group=group)  # op=SUM by default; every rank gets the sum
    return before, flat(x)


def all_gather(group, device):
    x = start(device)
    out = [torch.zeros(world, device=device) for _ in range(world)]
    dist.all_gather(out, x, group=group)  # every rank gets every rank's tensor, in rank order
    return flat(x), flat(out)


def reduce_scatter(group, device):
    x, out = start(device), torch.zeros(1, device=device)
    dist.reduce_scatter(out, list(x.chunk(world)), group=group)  # rank r gets the sum of everyone's chunk r
    return flat(x), flat(out)


def all_to_all(group, device):
    x = start(device)
    out = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_to_all(out, list(x.chunk(world)), group=group)  # rank r's chunk j goes to rank j, slot r
    return flat(x), flat(out)


def gather(group, device):
    x = start(device)
    out = [torch.zeros(world, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(x, out, dst=0, group=group)  # like all_gather, but only rank 0 receives
    return flat(x), flat(out) if out else []


def scatter(group, device):
    out = torch.zeros(1, device=device)
    chunks = list(start(device).chunk(world)) if rank == 0 else None
    dist.scatter(out, chunks, src=0, group=group)  # rank 0's chunk r goes to rank r
    return flat(start(device)) if rank == 0 else [], flat(out)


def barrier(group, device):
    """Ranks arrive 100 ms apart; none leaves before the last one has arrived. Times in ms from a common start."""
    t0 = torch.tensor([time.time()], dtype=torch.float64, device=device)
    dist.broadcast(t0, src=0, group=group)  # one clock for all ranks (they share this machine's clock)
    t0 = t0.item() + 0.05  # a common start, a little in the future
    time.sleep(max(0.0, t0 + 0.1 * rank - time.time()))
    arrived = time.time() - t0
    dist.barrier(group=group)
    return [round(arrived * 1e3)], [round((time.time() - t0) * 1e3)]


OPS = [send_recv, isend_irecv, broadcast, reduce, all_reduce, all_gather, reduce_scatter, all_to_all,
       gather, scatter, barrier]
UNDEFINED_OFF_ROOT = {"reduce"}  # results on ranks other than the root are unspecified
NEEDS_TWO = {"send_recv", "isend_irecv"}  # a rank cannot message itself


def try_all(backend, group, device):
    failed = []
    for op in OPS:
        name = op.__name__
        record = {"op": name, "backend": backend, "device": str(device)}
        if world < 2 and name in NEEDS_TWO:
            runtime.log(**record, ok=False, error="needs at least 2 ranks")
            failed.append(name)
            continue
        try:
            before, after = op(group, device)
            runtime.log(**record, ok=True, error=None, before=before, after=after,
                        defined=rank == 0 or name not in UNDEFINED_OFF_ROOT, unit="ms" if name == "barrier" else "")
        except Exception as err:  # noqa: BLE001 - whatever the backend raises is the finding: log it, go on
            runtime.log(**record, ok=False, error=str(err).splitlines()[0][:200])
            failed.append(name)
    print(f"rank {rank}: {backend}: {len(OPS) - len(failed)} of {len(OPS)} operations ran"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)


if rank == 0:  # which backends this PyTorch was built with
    runtime.log(available={"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                           "mpi": dist.is_mpi_available()})
try_all(ctx.backend, None, ctx.device)
if ctx.backend != "gloo":  # on GPUs: what gloo can do too, on CPU tensors, in a group of its own
    try_all("gloo", dist.new_group(backend="gloo"), torch.device("cpu"))
runtime.teardown()
