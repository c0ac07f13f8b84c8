"""What both ex07 grading jobs share: a record of every collective the submission starts, a refusal of
torch's own sharding classes, and a count of the tensor bytes an object holds.

Imported by the graders ex07_sharded_optimizer.py and ex07_fsdp.py, on every rank.
"""
import contextlib

import torch

from gpucourse.tools.grading import jobkit


class CollectiveGuard(jobkit.Guard):
    """{"op", "bytes"} of each outermost collective or point-to-point call while watching (comm_recorder: any
    layer, ProcessGroup called directly included); refuses the classes of `banned` (jobkit.ban: each must bind)."""

    def __init__(self, comm, banned: dict):
        super().__init__(comm)
        self.forbidden_used: list[str] = []
        jobkit.ban(banned, self.forbidden_used)

    @property
    def calls(self) -> list[dict]:
        return [{"op": e["op"], "bytes": e["bytes"]} for e in self.comm.events if e["kind"] != "wait"]

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
