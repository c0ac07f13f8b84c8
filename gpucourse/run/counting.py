"""In each rank that counts (a dry run's, or a real job's with COUNT_FILE_ENV): one step's collectives, memory,
FLOPs.

runtime.setup() starts a StepCounter when $GPUCOURSE_COUNT_FILE is set, runtime.log(step=...) marks the steps, and
runtime.teardown() (or the end of the script) writes the report the driver (run/dryrun.py) reads back. What is
counted, and how a step is bounded, is told in run/dryrun.py's docstring.
"""
from __future__ import annotations

import json

from .contract import count_file

PARTS = ("params", "grads", "optimizer", "activations", "other")


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
        path = count_file(self.path, self.rank)
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
