"""Chapter 03: what does running an all-reduce *beside* compute cost? A property of the machine, measured alone.

Three trials, in rotating order, --repeats times each, every one started right after a barrier:
    compute   forward + backward of the chapter's MLP, no DDP and no communication
    comm      one all-reduce per size in --bucket-bytes (a DDP run's buckets), one after the other
    both      the same all-reduces started asynchronously (gloo runs them on its own thread), the same compute
              at once on this thread, then a wait for the all-reduces: what overlap does in a DDP step
Each trial's seconds on this rank are logged (trial, seconds). The notebook reads, from the medians,

    overlap cost = (both - max(compute, comm)) / min(compute, comm)

0 when the two run side by side for free (as NCCL kernels beside compute on a GPU are expected to), 1 when side by
side takes as long as one after the other (here: gloo's thread and compute share the same CPU cores).
No DDP step time goes into it: it is measured on its own, and the model of section 5 takes it as an input.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=15, help="timed trials of each kind")
parser.add_argument("--warmup", type=int, default=2, help="untimed rounds of the three trials first")
parser.add_argument("--batch", type=int, default=64, help="samples per rank")
parser.add_argument("--hidden", type=int, default=512, help="width of every layer")
parser.add_argument("--layers", type=int, default=6, help="hidden x hidden Linear layers")
parser.add_argument("--bucket-bytes", type=int, nargs="+", default=[2**20] * 6,
                    help="bytes of each all-reduce (float32), one per DDP bucket")
args = parser.parse_args()
if args.repeats < 1 or min(args.bucket_bytes) < 4:
    parser.error("--repeats must be >= 1 and every --bucket-bytes >= 4 (one float32)")

ctx = runtime.setup(seed=0)
net = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.ReLU())])
net = net.to(ctx.device)
x = torch.randn(args.batch, args.hidden, device=ctx.device)
y = torch.randn(args.batch, args.hidden, device=ctx.device)
buffers = [torch.zeros(size // 4, device=ctx.device) for size in args.bucket_bytes]  # zeros: sums stay finite


def compute():
    net.zero_grad(set_to_none=True)
    nn.functional.mse_loss(net(x), y).backward()


def comm():
    for b in buffers:
        dist.all_reduce(b)


def both():
    works = [dist.all_reduce(b, async_op=True) for b in buffers]  # queued on gloo's thread, run one by one
    compute()  # meanwhile, on this thread
    for w in works:
        w.wait()


TRIALS = {"compute": compute, "comm": comm, "both": both}


def timed(fn):
    dist.barrier()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


names = list(TRIALS)
for _ in range(args.warmup):
    for name in names:
        timed(TRIALS[name])
runtime.log(bucket_bytes=args.bucket_bytes, batch=args.batch, hidden=args.hidden,
            layers=args.layers, threads=torch.get_num_threads())
for i in range(args.repeats):
    for k in range(len(names)):
        name = names[(i + k) % len(names)]  # rotate the order: no trial always runs first
        runtime.log(step=i, total=args.repeats, trial=name, seconds=timed(TRIALS[name]))
runtime.teardown()
