"""In the launcher's process (a notebook, the CLI): the dry run's driver, the cluster on a laptop, a script's own
code run as rank r of a world of N, with a fake process group.

    gpucourse dryrun scripts/09_gpt_2d.py --world 1024 -- --dp 256 --tp 4 --batch 256
    gpucourse dryrun scripts/09_gpt_2d.py --world 1024 --fake-tensors -- --dp 128 --tp 8 --batch 128 --d-model 4096 \
        --layers 32 --heads 32 --context 2048 --steps 2 --eval-batches 0 --sample 0    # 7 B-class, no memory behind
    report = gpucourse.dryrun("scripts/09_gpt_2d.py", world=1024, args=["--dp", "256", "--tp", "4", "--batch", "256"])
    costs.dryrun_step_time(report["ranks"][0])       # a step time and MFU on a named system: modelled

Each asked rank (default: the first and the last) runs the script in a process of its own, forked from one that
imported torch once (run/fake.py's _host: ~30 % less CPU for two ranks), with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE = min(8, N), GROUP_RANK, ...) and DRYRUN_ENV set:
`runtime.setup()` then joins torch's fake process group (`dist.init_process_group("fake", store=FakeStore())`),
where every collective returns at once and moves nothing, and counts (`StepCounter`) instead of talking to peers.
By default tensors stay real, at the sizes the script asks for. With `--fake-tensors` (fake_tensors=True) every
tensor the rank makes from runtime.setup() on is a FakeTensor (torch's FakeTensorMode: shape, dtype, device, no
storage), the model's parameters included, so a model larger than this machine (a 7 B model's fp32 training states
are 103 GB) is dry-run in a few hundred MB. The counts are the same as with real tensors
(tests/integration/test_dryrun.py: comms, FLOPs, model states and the params/grads/optimizer parts equal; the
activations part, and so the peak, can differ where an op's real CPU kernel makes a tensor its fake implementation
does not: 8-16 B in the scripts tested, not traced to the op; F.mse_loss's 124 B of 672 on a 4 x 8 batch).
What makes it work (run/fake.py's prepare_fake_tensors): device
meshes are built outside the mode (their rank tables are read on the host: inside the mode `nonzero`/`.tolist()`
raise); parallelize_module and fully_shard run inside it, on the fake parameters. What a script must not do under
it: read a value (.item(), .tolist(), print(tensor), `if tensor:`): the rank stops with one line naming the script's
line; values go through runtime.value() (None in any dry run), and data is indexed on tensors, not on host numbers
(09_gpt_2d.py's CharData.batch). Not the default, at any size: the size that matters is the model's, which the
driver does not know before the script runs, and scripts that read values outside runtime.value() run with real
tensors but stop with fake ones; a real-tensor rank that runs out of memory says to use --fake-tensors.

What is counted, per rank, for ONE step, the last the script logged:
  the step boundary: `runtime.log(step=s)` closes step s. Step s is everything the rank did after the last
  `log(step=...)` call with another step number (or after setup(), for the first) up to the last `log(step=s)`
  call. A script that logs several records per step (one per mode, say) gets them all in one step; a script that
  logs no step is reported over its whole run (step None).
  comms: every collective and point-to-point call, through any layer (the graders' recorder,
  run/comm_recorder.py), by op and process group (global ranks), with calls and bytes in nccl-tests' convention:
  the buffer for all_reduce and broadcast, the full buffer for all_gather and reduce_scatter, the send buffer for
  all_to_all, the message for send/recv. The same counting runs in a real job (COUNT_FILE_ENV alone), which is how
  the tests hold the dry run's counts to a real gloo run's.
  memory: torch's MemTracker over the step: the peak (bytes of live tensors, not the allocator's reserve) and its
  parts at the peak: params (parameters; FSDP's all-gathered ones too, while they are registered), grads,
  optimizer (state), activations (made in forward or outside any module), other (buffers, backward's temporaries).
  flops: FlopCounterMode's formulas on each local op (a DTensor's shard, not its global shape); the CPU's fused
  attention kernel is counted with the flash kernel's formula (FlopCounterMode alone counts it as 0).
  assumptions: what the script stated (runtime.assume) where a size depends on values the fake group does not
  deliver (the counts an MoE layer receives before its all-to-all): reported beside the figures.
Not modelled: NCCL's own buffers, the allocator's fragmentation, the time anything takes.
"""
from __future__ import annotations

import ast
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .contract import COUNT_FILE_ENV, DRYRUN_ENV, FAKE_TENSORS_ENV, RANK_FIELD, RUN_DIR_ENV, count_file, rank_file
# The in-rank side, named here too: what the report's figures are (counting.py), what fake tensors refuse (fake.py).
from .counting import PARTS, StepCounter, summarise_comms  # noqa: F401
from .fake import (NO_VALUE, NoValueError, enter_fake_tensors, prepare_fake_group,  # noqa: F401
                   prepare_fake_tensors)

MAX_WORLD = 1_048_576  # 2^20 ranks: beyond any cluster built so far, and the fake group's own tables stay small
NODE_SIZE = 8  # LOCAL_WORLD_SIZE of a simulated node: one process per GPU of an 8-GPU node
RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # the host's too: torch reads them as it loads
STEP_BOUNDARY = ("step s = what the rank did after the last runtime.log(step=...) of another step number (or "
                 "setup()) up to the last runtime.log(step=s); the report shows the last step logged")


class DryRunError(ValueError):
    """A dry run that cannot be carried out as asked (bad world, rank, script): says what and what to do."""


class DryRunFailed(RuntimeError):
    """The script raised in a simulated rank: names the rank, the exception and the script's line."""


# What fake tensors cannot do, by a sign in the rank's last line: (sign, why). The script runs without them.
FAKE_LIMITS = (
    ("Caffe2 uses a lazy allocation", "fake tensors cannot run DDP: its C++ reducer needs real memory for its "
                                      "buckets"),
    ("DynamicOutputShapeException", "fake tensors cannot know a shape that depends on values, such as the tokens an "
                                    "expert receives"),
    ("Couldn't swap", "fake tensors cannot convert a built module's parameters to another dtype or device"),
)


def _check(script, world, ranks) -> tuple[Path, int, list[int]]:
    path = Path(script).expanduser()
    if not path.is_file():
        raise DryRunError(f"{script}: no such script: give the path of a course script (scripts/NN_name.py)")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise DryRunError(f"--world {world!r}: give a number of ranks from 1 to {MAX_WORLD:,}")
    ranks = [0, world - 1] if ranks is None or len(ranks) == 0 else list(ranks)
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
            raise DryRunError(f"--rank {r!r} is outside a world of {world}: ranks go from 0 to {world - 1}")
    if not _calls_setup(path):
        raise DryRunError(f"{path} never calls runtime.setup() (or runtime.session()): a dry run needs the "
                          "course runtime to join its fake process group; see gpucourse/run/runtime.py")
    return path, world, list(dict.fromkeys(ranks))


def _calls_setup(path: Path) -> bool:
    """Whether the script's text calls a `setup` or `session` attribute (runtime.setup(), runtime.session())."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return True  # let the rank say what is wrong with it
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("setup", "session")
               for n in ast.walk(tree))


def rank_env(rank: int, world: int, *, node_size: int = NODE_SIZE) -> dict:
    """torchrun's variables for rank `rank` of `world`, on nodes of min(node_size, world) processes."""
    local = min(node_size, world)
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local), "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(math.ceil(world / local)),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "dryrun"}


def _failure(rank: int, work: Path, path: Path, code: int) -> Exception:
    """The rank's exception, as one line naming the script's line; a ValueError or usage error is bad input."""
    stderr = rank_file(work, rank, "stderr").read_text(errors="replace")
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in stderr.splitlines()]  # torch's rank prefix
    lines = [ln for ln in lines if ln.strip()]
    where = [m for m in re.finditer(rf'File "({re.escape(str(path.resolve()))}|{re.escape(str(path))})", line (\d+)',
                                    stderr)]
    at = f" (line {where[-1].group(2)} of {path.name})" if where else ""
    last = lines[-1].strip() if lines else f"exit code {code}"
    if code == 2 and "error:" in last:  # argparse's usage error
        return DryRunError(f"rank {rank}: {last}")
    if "DataDependentOutputException" in last or "NoValueError" in last:  # a value read from a fake tensor
        last = NO_VALUE
    elif hint := next((why for sign, why in FAKE_LIMITS if sign in last), None):
        detail = f" ({last.split(': ', 1)[1]})" if last.split(":")[0].endswith(("Error", "Exception")) else ""
        last = f"{hint}{detail}: dry-run it without --fake-tensors"
    elif code == -signal.SIGKILL or "MemoryError" in last or "can't allocate memory" in last:
        last += " (out of memory? --fake-tensors dry-runs a model without its memory)"
    message = f"rank {rank} of the dry run failed{at}: {last}"
    return DryRunError(message) if last.startswith("ValueError") else DryRunFailed(message)


def dryrun(script, *, world: int, ranks=None, args=(), timeout: float = 600.0, json_path=None,
           parallel: int | None = None, fake_tensors: bool = False) -> dict:
    """Run `script` as each of `ranks` (default: the first and the last) of a world of `world` ranks, with a fake
    process group, and return {"world", "ranks": [each rank's report], "step_boundary", ...} (module docstring).

    args: the script's own arguments. json_path: also write the report there (only once every rank succeeded).
    fake_tensors: the rank's tensors are FakeTensors from runtime.setup() on (module docstring).
    Raises DryRunError for bad input (a one-line message), DryRunFailed when the script fails in a rank."""
    path, world, ranks = _check(script, world, ranks)
    args = [str(a) for a in args]
    if json_path is not None and (Path(json_path).is_dir() or not Path(json_path).resolve().parent.is_dir()):
        raise DryRunError(f"json_path {json_path}: give a file name in a folder that exists")
    parallel = parallel or max(1, min(len(ranks), os.cpu_count() or 1))
    work = Path(tempfile.mkdtemp(prefix="gpucourse-dryrun-"))
    counts = rank_file(work, RANK_FIELD, "json")  # each rank's report: rank<r>.json, beside its logs
    plan = {"parallel": parallel, "ranks": [
        {"rank": r, "fake": fake_tensors, "argv": [str(path), *args],
         "stdout": str(rank_file(work, r, "stdout")), "stderr": str(rank_file(work, r, "stderr")),
         "env": {**os.environ, **rank_env(r, world), DRYRUN_ENV: "1", RUN_DIR_ENV: str(work / "run"),
                 COUNT_FILE_ENV: str(counts), FAKE_TENSORS_ENV: "1" if fake_tensors else "0", **RANK_ENV}}
        for r in ranks]}
    started, reports = time.monotonic(), {}
    # One process imports torch and forks every rank (fake.py's _host): a rank's imports cost ~3 CPU-s here
    with open(work / "host.stderr", "wb") as err:
        host = subprocess.Popen([sys.executable, "-c", "from gpucourse.run.fake import _host; _host()"],
                                env={**os.environ, **RANK_ENV}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True, text=True)
    replies = queue.Queue()  # the host's lines, read in a thread so that the wait below can time out
    threading.Thread(target=lambda: [*map(replies.put, host.stdout), replies.put("")], daemon=True).start()
    try:
        host.stdin.write(json.dumps(plan) + "\n")
        host.stdin.close()
        while len(reports) < len(ranks):
            left = timeout - (time.monotonic() - started)
            if left <= 0:
                running = sorted(set(ranks) - set(reports))
                raise DryRunFailed(f"the dry run of {path.name} took over {timeout:.0f} s (rank {running[0]} "
                                   "still running)")
            try:
                line = replies.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if not line:  # the host ended before every rank did: it could not start them
                why = (work / "host.stderr").read_text(errors="replace").strip().splitlines() or ["no message"]
                raise DryRunFailed(f"the dry run of {path.name} could not start its ranks: {why[-1]}")
            done = json.loads(line)
            r, code = done["rank"], done["code"]
            if code != 0:
                raise _failure(r, work, path, code)
            found = count_file(counts, r)
            if not found.is_file():
                raise DryRunError(f"{path.name} ran as rank {r} but never called runtime.setup(): a dry run "
                                  "needs the course runtime (from gpucourse import runtime; runtime.setup())")
            reports[r] = json.loads(found.read_text())
    finally:
        _kill(host)
        shutil.rmtree(work, ignore_errors=True)
    result = {"world": world, "script": str(path), "args": args, "fake_tensors": fake_tensors,
              "step_boundary": STEP_BOUNDARY,
              "ranks": [reports[r] for r in ranks]}
    if json_path is not None:
        out = Path(json_path)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
    return result


def _kill(proc: subprocess.Popen) -> None:
    """End the host's process group (its session: the host and every rank it forked), and reap the host."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
