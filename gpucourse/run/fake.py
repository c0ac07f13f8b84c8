"""In each rank of a dry run: fake tensors (--fake-tensors) and the fake process group, made fit for torch.

runtime.setup() (in-rank) calls prepare_fake_group() in any dry run and enter_fake_tensors() with --fake-tensors; the
driver (run/dryrun.py) forks the ranks from one process that imported torch (`_host`), which runs
prepare_fake_tensors() in a --fake-tensors rank before the script imports anything. What fake tensors do and do not
allow is told in run/dryrun.py's docstring.
"""
from __future__ import annotations

import sys
from pathlib import Path


class NoValueError(RuntimeError):
    """A fake-tensor dry run was asked for a tensor's values (print(tensor), .item(), .tolist(), `if tensor:`)."""


NO_VALUE = ("a fake-tensor dry run has no values: the script reads or prints one (.item(), .tolist(), print(tensor), "
            "`if tensor`); read values through runtime.value() (None in a dry run), or leave the read out when "
            "runtime.fake_tensors()")


def _outside_fake_mode(fn):
    """fn, run with the fake mode set aside: a device mesh lists its ranks in a real (small) tensor."""
    def call(*args, **kwargs):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return fn(*args, **kwargs)
    call.__name__, call.__qualname__, call.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    call._gpucourse_outside_fake = True
    return call


def prepare_fake_tensors() -> None:
    """Make torch fit for a rank whose tensors are fake: called before the script runs (the rank's entry point,
    `_as_rank`) and again by runtime.setup() before it enters the FakeTensorMode; idempotent.

    - Device meshes are built outside the mode: init_device_mesh and every DeviceMesh method (slicing, flattening,
      concatenating for FSDP x TP) compute on a tensor of rank numbers, which inside the mode would have no values
      (`nonzero`, `.tolist()` raise). Meshes are tiny (one int per rank); parallelize_module and fully_shard then run
      inside the mode, on the fake parameters, as they would on real ones.
    - `module.to(device)` where nothing changes is the module itself: torch (2.13) cannot swap a parameter made in a
      FakeTensorMode (it holds a weak reference), and a move to where a tensor already is changes nothing anyway.
    - str(fake tensor) (print, f-strings) raises NoValueError instead of printing a value that does not exist.
    """
    import torch
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import FakeTensor

    if getattr(device_mesh.init_device_mesh, "_gpucourse_outside_fake", False):
        return
    device_mesh.init_device_mesh = _outside_fake_mode(device_mesh.init_device_mesh)
    if hasattr(torch.distributed, "init_device_mesh"):
        torch.distributed.init_device_mesh = device_mesh.init_device_mesh
    mesh = device_mesh.DeviceMesh
    for name, attr in list(vars(mesh).items()):
        if isinstance(attr, staticmethod):
            setattr(mesh, name, staticmethod(_outside_fake_mode(attr.__func__)))
        elif callable(attr) and not isinstance(attr, type) and name not in ("__repr__", "__hash__", "__eq__"):
            setattr(mesh, name, _outside_fake_mode(attr))
    to = torch.nn.Module.to

    def module_to(self, *args, **kwargs):
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if all((device is None or t.device == device)
               and (dtype is None or t.dtype == dtype or not t.is_floating_point())  # .to(dtype) casts floats only
               for t in (*self.parameters(), *self.buffers())):
            return self
        return to(self, *args, **kwargs)

    def no_value(self):
        raise NoValueError(NO_VALUE)

    torch.nn.Module.to = module_to
    FakeTensor.__str__ = no_value


def prepare_fake_group() -> None:
    """Make torch fit for a rank whose process group is fake (any dry run): called by runtime.setup(); idempotent.

    torch.distributed.pipelining's schedules (2.13) start with a vote between the stages: each sends the next one,
    then the previous one, an int saying whether every stage was given its shapes (PipelineStage's input_args and
    output_args), read with `.item()`. Under the fake group nothing arrives (the zeros of the receive buffer: "no",
    and the stages then send each other their shapes, which do not arrive either: the next stage allocates garbage
    sizes), and under fake tensors there is no value to read at all. In a dry run each stage decides alone: the
    shapes it was given (STATIC), or a clear error, since a dry run cannot find them by sending them.
    """
    try:
        from torch.distributed.pipelining import PipelineStage, schedules
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:  # another torch: nothing to prepare
        return
    base = schedules._PipelineSchedule
    original = getattr(base, "_warmup_p2p", None)
    if original is None or getattr(original, "_gpucourse_dry", False):
        return

    def warmup_p2p(self, stages, has_backward, p2p_done):
        if not all(isinstance(stage, PipelineStage) for stage in stages):
            return original(self, stages, has_backward, p2p_done)
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index}: a dry run needs its shapes up front: give "
                                   "PipelineStage input_args and output_args (the stages cannot send them)")
            stage._inference_mode = InferenceMode.STATIC

    warmup_p2p._gpucourse_dry = True
    base._warmup_p2p = warmup_p2p


def enter_fake_tensors():
    """runtime.setup()'s hook in a --fake-tensors dry run: from here on every tensor the rank makes is a FakeTensor
    (shape, dtype, device; no storage). Real tensors made before (module-level constants) mix in as fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    prepare_fake_tensors()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode.__enter__()
    return mode


def _host() -> None:
    """The dry run's ranks, forked from one process that imported torch once: `python -c ...` started by the driver
    (run/dryrun.py) in a session of its own. On stdin, one JSON line: {"parallel", "ranks": [{"rank", "env",
    "argv", "stdout", "stderr", "fake"}]}; on stdout, one JSON line a rank as it ends: {"rank", "code"} (the exit
    code as subprocess gives it, -9 for SIGKILL). Each rank runs its script as `python SCRIPT ARGS` would, in a
    child of this process (so the driver's SIGKILL of this session ends them all)."""
    import gc
    import json
    import os

    gc.disable()  # until the fork: no freed holes in the pages the ranks share (gc's documentation)
    # What every rank of a dry run imports (runtime.setup() imports pipelining, to prepare the fake group; a first
    # optimizer step, torch._dynamo): ~4-7 CPU-s a rank on a 2-core machine, paid once here
    import torch._dynamo  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    gc.freeze()  # a child's collections then leave the imported objects (and their shared pages) alone
    plan = json.loads(sys.stdin.readline())
    reply = os.fdopen(os.dup(1), "w")
    pending, running = list(plan["ranks"]), {}
    while pending or running:
        while pending and len(running) < plan["parallel"]:
            job = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                gc.enable()
                reply.close()
                _as_rank(job)  # returns when the script ends (or raises): this child then exits as python does
                return
            running[pid] = job["rank"]
        pid, status = os.wait()
        reply.write(json.dumps({"rank": running.pop(pid), "code": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


def _as_rank(job: dict) -> None:
    """In a child of _host: become rank job["rank"] (its environment, its log files, its argv) and run the script,
    after prepare_fake_tensors() in a --fake-tensors rank (a script binds init_device_mesh by name on import)."""
    import os
    import runpy

    os.environ.clear()
    os.environ.update(job["env"])
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, (path, flags) in enumerate([(os.devnull, os.O_RDONLY), (job["stdout"], write), (job["stderr"], write)]):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    script = job["argv"][0]
    sys.argv = list(job["argv"])
    sys.path[0] = str(Path(script).resolve().parent)
    if job["fake"]:
        prepare_fake_tensors()
    runpy.run_path(script, run_name="__main__")
