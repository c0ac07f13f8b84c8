"""What both ex07 grading jobs share: a record of every collective the submission starts, a refusal of
torch's own sharding classes, and a count of the tensor bytes an object holds.

Imported by ex07_sharded_optimizer_job.py and ex07_fsdp_job.py (beside it), on every rank.
"""
import contextlib

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

import jobkit

# The collectives a submission could reach for, by the name the records use.
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "scatter", "gather",
               "send", "recv", "isend", "irecv", "all_reduce_coalesced", "all_gather_object",
               "broadcast_object_list", "all_gather_coalesced", "_reduce_scatter_base", "_all_gather_base",
               "all_gather_single", "reduce_scatter_single")
# The process group called directly (what dist.* calls inside): recorded only when called directly.
GROUP_METHODS = {"allreduce": "all_reduce", "broadcast": "broadcast", "allgather": "all_gather",
                 "reduce_scatter": "reduce_scatter", "_allgather_base": "all_gather_into_tensor",
                 "_reduce_scatter_base": "reduce_scatter_tensor", "allreduce_coalesced": "all_reduce_coalesced"}


class CollectiveGuard(jobkit.Guard):
    """Records {"op", "bytes"} for each outermost collective call while watching; refuses forbidden classes."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []
        self.forbidden_used: list[str] = []

    def reset(self) -> None:
        self.calls = []  # a fresh list each watch: summary() is of the last one

    def install(self, forbid: dict) -> None:
        """Wrap the collectives; forbid = {"module.path:Name": why} are replaced by classes that refuse to run."""
        from torch.distributed import distributed_c10d as c10d

        for module in (dist, c10d):
            for name in COLLECTIVES:
                if hasattr(module, name):
                    setattr(module, name, self._recorder(getattr(module, name), name))
        for method, name in GROUP_METHODS.items():
            if hasattr(ProcessGroup, method):
                setattr(ProcessGroup, method, self._recorder(getattr(ProcessGroup, method), name, skip_self=True))
        for where, why in forbid.items():
            self._forbid(where, why)

    def _forbid(self, where: str, why: str) -> None:
        import importlib

        module_name, name = where.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return
        guard = self

        def refuse(*args, **kwargs):
            guard.forbidden_used.append(name)
            raise RuntimeError(f"{name} is not allowed here: {why}")

        setattr(module, name, refuse)

    def _recorder(self, fn, name, skip_self=False):
        def note(*args, **kwargs):
            given = args[1:] if skip_self else args
            first = given[0] if given else next(iter(kwargs.values()), None)
            # reduce_scatter_tensor(output, input): the input is the full buffer; record that
            if name.startswith(("reduce_scatter", "_reduce_scatter")) and len(given) > 1:
                first = given[1]
            self.calls.append({"op": name, "bytes": jobkit.nbytes(first)})

        return self.wrap(fn, note)

    def summary(self) -> dict:
        """{op: [calls, bytes]} of the last watch."""
        out = {}
        for call in self.calls:
            entry = out.setdefault(call["op"], [0, 0])
            entry[0] += 1
            entry[1] += call["bytes"]
        return out


def held_tensor_bytes(root, exclude=(), max_nodes=200_000) -> int:
    """Bytes of every tensor reachable from `root` through attributes, dicts, lists, tuples and sets,
    except the tensors in `exclude` (the model's parameters and gradients); each storage counted once.

    This is how the grader weighs an optimizer's state without knowing where the submission keeps it.
    """
    skip = {id(t) for t in exclude}
    seen_objects, seen_storage, total, stack = set(), set(), 0, [root]
    while stack and len(seen_objects) < max_nodes:
        obj = stack.pop()
        if id(obj) in seen_objects or id(obj) in skip:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                local = obj.to_local() if hasattr(obj, "to_local") else obj
                key = (local.untyped_storage().data_ptr(), local.storage_offset())
                if key not in seen_storage:
                    seen_storage.add(key)
                    total += local.numel() * local.element_size()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif callable(obj) or isinstance(obj, type(contextlib)):  # classes, functions, modules: not state
            continue
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total
