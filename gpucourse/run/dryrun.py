"""The cluster on a laptop: a script's own code run as rank r of a world of N, with a fake process group.

    gpucourse dryrun scripts/09_gpt_2d.py --world 1024 -- --dp 256 --tp 4 --batch 256
    gpucourse dryrun scripts/09_gpt_2d.py --world 1024 --fake-tensors -- --dp 128 --tp 8 --batch 128 --d-model 4096 \
        --layers 32 --heads 32 --context 2048 --steps 2 --eval-batches 0 --sample 0    # 7 B-class, no memory behind
    report = gpucourse.dryrun("scripts/09_gpt_2d.py", world=1024, args=["--dp", "256", "--tp", "4", "--batch", "256"])
    costs.dryrun_step_time(report["ranks"][0])       # a step time and MFU on a named system: modelled

Each asked rank (default: the first and the last) runs the script in a process of its own with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE = min(8, N), GROUP_RANK, ...) and DRYRUN_ENV set:
`runtime.setup()` then joins torch's fake process group (`dist.init_process_group("fake", store=FakeStore())`),
where every collective returns at once and moves nothing, and counts (`StepCounter`) instead of talking to peers.
By default tensors stay real, at the sizes the script asks for. With `--fake-tensors` (fake_tensors=True) every
tensor the rank makes from runtime.setup() on is a FakeTensor (torch's FakeTensorMode: shape, dtype, device, no
storage), the model's parameters included, so a model larger than this machine (a 7 B model's fp32 training states
are 103 GB) is dry-run in a few hundred MB. The counts are the same as with real tensors
(tests/integration/test_dryrun.py: comms, FLOPs, model states and the params/grads/optimizer parts equal; the
activations part, and so the peak, can differ where an op's real CPU kernel makes a tensor its fake implementation
does not: 8-16 B in the scripts tested, not traced to the op; F.mse_loss's 124 B of 672 on a 4 x 8 batch). What makes it work (prepare_fake_tensors): device
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
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .contract import COUNT_FILE_ENV, DRYRUN_ENV, FAKE_TENSORS_ENV, RUN_DIR_ENV

MAX_WORLD = 1_048_576  # 2^20 ranks: beyond any cluster built so far, and the fake group's own tables stay small
NODE_SIZE = 8  # LOCAL_WORLD_SIZE of a simulated node: one process per GPU of an 8-GPU node
PARTS = ("params", "grads", "optimizer", "activations", "other")
STEP_BOUNDARY = ("step s = what the rank did after the last runtime.log(step=...) of another step number (or "
                 "setup()) up to the last runtime.log(step=s); the report shows the last step logged")


class DryRunError(ValueError):
    """A dry run that cannot be carried out as asked (bad world, rank, script): says what and what to do."""


class DryRunFailed(RuntimeError):
    """The script raised in a simulated rank: names the rank, the exception and the script's line."""


class NoValueError(RuntimeError):
    """A fake-tensor dry run was asked for a tensor's values (print(tensor), .item(), .tolist(), `if tensor:`)."""


NO_VALUE = ("a fake-tensor dry run has no values: the script reads or prints one (.item(), .tolist(), print(tensor), "
            "`if tensor`); read values through runtime.value() (None in a dry run), or leave the read out when "
            "runtime.fake_tensors()")


# What fake tensors cannot do, by a sign in the rank's last line: (sign, why). The script runs without them.
FAKE_LIMITS = (
    ("Caffe2 uses a lazy allocation", "fake tensors cannot run DDP: its C++ reducer needs real memory for its "
                                      "buckets"),
    ("DynamicOutputShapeException", "fake tensors cannot know a shape that depends on values, such as the tokens an "
                                    "expert receives"),
    ("Couldn't swap", "fake tensors cannot convert a built module's parameters to another dtype or device"),
)


# --- in the rank: fake tensors (--fake-tensors) ------------------------------------------------------------------
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
    `_run_rank`) and again by runtime.setup() before it enters the FakeTensorMode; idempotent.

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


def _run_rank() -> None:
    """The entry point of a --fake-tensors rank: `python -c ... SCRIPT ARGS` runs SCRIPT as `python SCRIPT ARGS`
    would, after prepare_fake_tensors() (a script binds init_device_mesh by name on import, before setup())."""
    import runpy

    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    prepare_fake_tensors()
    runpy.run_path(script, run_name="__main__")


# --- in the rank: counting one step ----------------------------------------------------------------------------
def _nccl_tests_bytes(event: dict, group_size: int) -> int:
    """The bytes nccl-tests reports for this call (its busbw factors then apply)."""
    op, via, sizes = event["op"], event["via"], event["tensor_bytes"]
    functional = via.startswith("functional_collectives.")
    if op.startswith("all_to_all"):  # the send buffer: (output, input) through dist, (input, ...) functionally
        return sizes[0] if functional else sizes[1] if len(sizes) > 1 else event["bytes"]
    if functional and op.startswith("all_gather"):  # funcol takes the shard only and makes the full output
        return event["bytes"] * group_size
    return event["bytes"]  # the largest tensor argument: the buffer, the full all_gather/reduce_scatter buffer


def summarise_comms(events: list[dict]) -> list[dict]:
    """Recorder events -> [{"op", "group_size", "group", "calls", "bytes"(, "peers")}], one per op, group (and
    point-to-point peer), in order of first call."""
    table: dict[tuple, dict] = {}
    for e in events:
        if e["kind"] not in ("collective", "p2p"):
            continue
        group = next((g for g in e["groups"] if g is not None), None)
        size = len(group) if group is not None else 0
        peers = tuple(e["peers"]) if e["kind"] == "p2p" else ()
        row = table.setdefault((e["op"], tuple(group or ()), peers), {
            "op": e["op"], "group_size": size, "group": group, "calls": 0, "bytes": 0,
            **({"peers": list(peers)} if e["kind"] == "p2p" else {})})
        row["calls"] += 1
        row["bytes"] += _nccl_tests_bytes(e, size)
    return list(table.values())


class StepCounter:
    """In one rank, from runtime.setup() to the end: the recorder, a memory tracker and a FLOP counter, with a
    mark at every runtime.log(step=...). `report()` reads the last step out of the marks."""

    def __init__(self, path: str, rank: int, world_size: int, dry: bool):
        import torch
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
        from torch.distributed._tools.mod_tracker import ModTracker
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_map
        from torch.utils.flop_counter import FlopCounterMode

        from . import comm_recorder

        self.path, self.rank, self.world_size, self.dry = path, rank, world_size, dry
        self.recorder = comm_recorder.install()
        self._recording = self.recorder.recording()
        self._recording.__enter__()
        aten = torch.ops.aten
        registry = dict(FlopCounterMode(display=False).flop_registry)
        registry[aten._scaled_dot_product_flash_attention_for_cpu] = registry[aten._scaled_dot_product_flash_attention]
        registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = registry[
            aten._scaled_dot_product_flash_attention_backward]
        counter = self

        class LocalFlops(TorchDispatchMode):
            """FlopCounterMode's formulas on local tensors: a DTensor op runs first, and its shards' ops count."""

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if any(t is not torch.Tensor and hasattr(t, "__tensor_flatten__") for t in types):
                    return NotImplemented
                if func._overloadpacket not in registry and func is not torch.ops.prim.device.default:
                    with self:
                        out = func.decompose(*args, **kwargs)
                    if out is not NotImplemented:
                        return out
                out = func(*args, **kwargs)
                formula = registry.get(func._overloadpacket)
                if formula is not None:
                    counter.flops += formula(*args, **kwargs, out_val=out)
                return out

        class LeafSafeModTracker(ModTracker):
            """ModTracker that puts no multi-grad hook on a module's leaf inputs. torch 2.13: such a hook raises
            ("A leaf node was passed to _will_engine_execute_node ...") when backward runs as autograd.grad, which
            is how a pipeline stage (torch.distributed.pipelining) computes its received activation's gradient:
            Linear(4, 4) on a leaf x needing its gradient, under ModTracker, then autograd.grad(y, [x]) raises.
            A module whose only grad-needing inputs are leaves is then marked done at the end of backward, as
            ModTracker does for a module with no grad-needing input (scripts/13_gpt_3d.py's later stages)."""

            def _fw_pre_hook(self, mod, input):
                leaf = lambda a: isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf  # noqa: E731
                super()._fw_pre_hook(mod, tree_map(lambda a: a.detach() if leaf(a) else a, input))

        class StepMemory(MemTracker):
            """MemTracker over many steps: a module's second forward starts its stats afresh instead of raising."""

            def __init__(self):
                super().__init__()
                self._mod_tracker = LeafSafeModTracker()

            def _pre_fw_hook(self, module, inputs):
                if module in self.memory_tracking and not self._mod_tracker.is_bw:
                    self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

            def _update_peak_stats(self, peak_state) -> None:
                """The rank's peak only. MemTracker (2.13) also updates every tracked module's own peak after every
                op, walking all of them (a weak dictionary): a quarter of a fake-tensor dry run's time at Llama 3
                405B's stage of 7 blocks (py-spy), for per-module figures the report never reads."""
                for dev, snap in self._curr_mem_snap.items():
                    if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                        self._peak_mem[dev] = snap[_TOTAL_KEY]
                        self._peak_mem_snap[dev] = dict(snap)  # a flat {kind: bytes}: a shallow copy is a copy

        _count_ddp_in_python()
        self.flops = 0
        self.model_states = dict.fromkeys(("params", "grads", "optimizer"), 0)
        self._hooks = (register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step))
        self.memory = StepMemory()
        self.memory.__enter__()
        self._flop_mode = LocalFlops()
        self._flop_mode.__enter__()
        self.marks: list[dict] = []  # one per runtime.log(step=...): where the records stood
        self.assumptions: list[str] = []  # runtime.assume(): what the script supplied in place of the fake group
        self._open = self._now()
        self.finished = False

    def _before_step(self, opt, args, kwargs) -> None:
        """Each optimizer step: its parameters and their gradients (this rank's shards), tagged for the tracker."""
        from torch.distributed._tools.mem_tracker import _MemRefType

        params = [p for g in opt.param_groups for p in g["params"]]
        for p in params:  # FSDP's sharded parameters and gradients are made outside any module hook
            self.memory._update_and_maybe_create_winfos(p, _MemRefType.PARAM)
            if p.grad is not None:
                self.memory._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)
        self.model_states.update(params=_local_bytes(params),
                                 grads=_local_bytes(p.grad for p in params if p.grad is not None))

    def _after_step(self, opt, args, kwargs) -> None:
        self.model_states["optimizer"] = _local_bytes(v for s in opt.state.values() for v in s.values()
                                                      if hasattr(v, "dim") and v.dim() > 0)

    def _now(self) -> dict:
        """Where the counts stand, and the memory peak since the last mark (then the peak starts again here)."""
        import copy

        mem = self.memory
        peak_snap = {dev: dict(snap) for dev, snap in mem.get_tracker_snapshot("peak").items()}
        current = mem.get_tracker_snapshot("current")
        mem._peak_mem_snap = copy.deepcopy(current)  # MemTracker has no public reset: restart its peak from now
        mem._peak_mem = {dev: snap.get("Total", 0) for dev, snap in current.items()}
        return {"events": len(self.recorder.events), "flops": self.flops, "peak": peak_snap,
                "model_states": dict(self.model_states)}

    def mark(self, step: int) -> None:
        if not self.finished:
            self.marks.append({"step": int(step), **self._now()})

    def report(self) -> dict:
        """This rank's counts for its last logged step (or its whole run when it logged none)."""
        end = self.marks[-1] if self.marks else self._now()
        step = end.get("step")
        first = len(self.marks)
        while first > 0 and self.marks[first - 1]["step"] == step:
            first -= 1
        start = self.marks[first - 1] if first > 0 else self._open
        window = self.marks[first:] or [end]
        peak = max(window, key=lambda m: _total(m["peak"]))["peak"]
        return {"rank": self.rank, "world_size": self.world_size, "dry": self.dry, "step": step,
                "steps_logged": len({m["step"] for m in self.marks}),
                "peak_bytes": _total(peak), "memory": _parts(peak), "model_states": end["model_states"],
                "comms": summarise_comms(self.recorder.events[start["events"]:end["events"]]),
                "flops": end["flops"] - start["flops"], "assumptions": list(self.assumptions)}

    def finish(self) -> None:
        """Write the report (once), then stop counting."""
        if self.finished:
            return
        report = self.report()
        self.finished = True
        for hook in self._hooks:
            hook.remove()
        self._flop_mode.__exit__(None, None, None)
        self.memory.__exit__(None, None, None)
        self._recording.__exit__(None, None, None)
        path = Path(self.path.replace("{rank}", str(self.rank)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report))
        tmp.replace(path)


def _count_ddp_in_python() -> None:
    """DDP all-reduces its buckets from C++, below every layer the recorder wraps. While counting, a DDP model
    that has no communication hook of its own by its first forward gets one that does what DDP's default does,
    an averaging all-reduce of each bucket, through dist.all_reduce, where the recorder sees it. It waits for
    each bucket (counts, not overlap, are what a counting run is for); torch's `allreduce_hook` would read the
    value of a future that the fake process group leaves empty."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def allreduce_hook(group, bucket):
        grads = bucket.buffer()
        grads.div_(group.size())
        dist.all_reduce(grads, group=group)
        done = torch.futures.Future()
        done.set_result(grads)
        return done

    forward = DDP.forward

    def counted_forward(self, *args, **kwargs):
        if not self._comm_hooks and not getattr(self, "_gpucourse_counted", False):
            self._gpucourse_counted = True
            self.register_comm_hook(self.process_group, allreduce_hook)
        return forward(self, *args, **kwargs)

    DDP.forward = counted_forward


def _local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard), each tensor once."""
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def _total(snapshot: dict) -> int:
    return sum(s.get("Total", 0) for s in snapshot.values())


def _parts(snapshot: dict) -> dict:
    """MemTracker's categories -> the report's parts."""
    names = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations"}
    parts = dict.fromkeys(PARTS, 0)
    for snap in snapshot.values():
        for key, value in snap.items():
            key = getattr(key, "value", key)
            if key != "Total":
                parts[names.get(key, "other")] += value
    return parts


# --- the driver: one process per asked rank -----------------------------------------------------------------
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
    stderr = (work / f"rank{rank}.stderr").read_text(errors="replace")
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
    started = time.monotonic()
    pending, running, reports = list(ranks), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                r = pending.pop(0)
                env = {**os.environ, **rank_env(r, world), DRYRUN_ENV: "1", RUN_DIR_ENV: str(work / "run"),
                       COUNT_FILE_ENV: str(work / "rank{rank}.json"), FAKE_TENSORS_ENV: "1" if fake_tensors else "0",
                       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                entry = ["-c", "from gpucourse.run.dryrun import _run_rank; _run_rank()"] if fake_tensors else []
                with open(work / f"rank{r}.stdout", "wb") as out, open(work / f"rank{r}.stderr", "wb") as err:
                    running[r] = subprocess.Popen([sys.executable, *entry, str(path), *args], env=env, stdout=out,
                                                  stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
            time.sleep(0.05)
            for r, proc in list(running.items()):
                if time.monotonic() - started > timeout:
                    raise DryRunFailed(f"the dry run of {path.name} took over {timeout:.0f} s (rank {r} still running)")
                code = proc.poll()
                if code is None:
                    continue
                del running[r]
                if code != 0:
                    raise _failure(r, work, path, code)
                found = work / f"rank{r}.json"
                if not found.is_file():
                    raise DryRunError(f"{path.name} ran as rank {r} but never called runtime.setup(): a dry run "
                                      "needs the course runtime (from gpucourse import runtime; runtime.setup())")
                reports[r] = json.loads(found.read_text())
    finally:
        for proc in running.values():
            _kill(proc)
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
    """End a rank's process group (it runs in a session of its own), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
