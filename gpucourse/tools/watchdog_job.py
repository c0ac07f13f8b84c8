"""The job of `gpu-check`'s nccl_watchdog: NCCL's watchdog catches a collective that cannot finish (one GPU).

An all-reduce is queued on the GPU behind `--sleep` seconds of torch.cuda._sleep, so its work cannot complete, and
the process group's timeout is `--timeout` seconds. NCCL's watchdog thread finds the work overdue, logs "Watchdog
caught collective operation timeout", dumps the Flight Recorder (TORCH_NCCL_DUMP_ON_TIMEOUT=1, to
TORCH_FR_DUMP_TEMP_FILE<rank>) and, under TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (torch's default), tears the process
down long before the sleep ends: the line "survived" is never printed.
"""
import argparse

import torch
import torch.distributed as dist

from gpucourse.run import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=10.0, help="the process group's timeout, seconds")
parser.add_argument("--sleep", type=float, default=120.0, help="GPU seconds the all-reduce waits behind")
args = parser.parse_args()

ctx = runtime.setup(timeout_s=args.timeout)
x = torch.ones(1, device=ctx.device)
dist.all_reduce(x)  # one that completes: the watchdog has seen a collective finish
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
torch.cuda._sleep(10**8)  # cycles: measure how many the GPU runs a second
end.record()
torch.cuda.synchronize()
cycles_per_s = 10**8 / (start.elapsed_time(end) / 1e3)
runtime.log(timeout_s=args.timeout, sleep_s=args.sleep, cycles_per_s=cycles_per_s)
print(f"all-reduce queued behind {args.sleep:g} s of GPU sleep; the group's timeout is {args.timeout:g} s", flush=True)
torch.cuda._sleep(int(args.sleep * cycles_per_s))
dist.all_reduce(x)  # waits for the sleep on the GPU: overdue after --timeout
torch.cuda.synchronize()  # the watchdog ends the process while this waits
print("survived: the watchdog did not end the process", flush=True)
runtime.teardown()
