"""In each rank: what a submission communicates, the one recorder every grading job (and the dry run's counter)
installs in each rank.

A grader must know which collectives and point-to-point calls a submission makes, and how many bytes it sends,
however it reaches them. `install()` (once per rank, before the submission is imported) wraps every layer a
call can come through:

    torch.distributed (dist.*), torch.distributed.distributed_c10d, torch.distributed._functional_collectives,
    torch._C._distributed_c10d (ProcessGroup and Backend methods, and their subclasses; _broadcast_coalesced),
    and Work.wait.

The ProcessGroup/Backend methods are the bottleneck: every dist.* function, including ones from a reloaded or
re-imported torch.distributed, a `from torch.distributed import ...` taken at any time, or a process group
called directly, ends in them. Recorded are only the submission's own, outermost calls while `recording()`:
dist.all_reduce, not also the ProcessGroup.allreduce inside it. Bytes *sent* are counted where every send ends,
ProcessGroup.send / Backend.send, at any depth (send, isend, batch_isend_irecv, and the process group's own).

Names are classified in one place (`kind`): a collective, point-to-point, or neither.

Which process group each call ran on is recorded too, as that group's GLOBAL ranks (graders of `group=` ask
whether a submission stayed inside its group): where the call reaches a ProcessGroup/Backend method (every dist.*
path), the group is that method's own object, and a send's or receive's peer is mapped from the group's rank to
the global one; a call that reaches none (the functional collectives, which go to the dispatcher directly, or a
dist.* call that returns early) is placed by its `group` argument (None: the default group).

What it does not do, and why: the wrappers keep the originals in their closures, so code inside the same process
that digs through closures, `gc` or `torch.ops.c10d.*` / `torch.ops._c10d_functional.*` (the dispatcher ops
beneath the Python layers) can still reach gloo unrecorded. That is a deliberate attack, not a plausible
shortcut; docs/grading.md's "Threat model of the graders" says so. What the wrappers avoid is the easy handles:
no `__wrapped__` (no functools.wraps), no module-level table of originals, no module-level recorder object.
"""
import contextlib
import inspect
import re
import threading
import time
import warnings

import torch
import torch.distributed as dist

# --- one classification of names --------------------------------------------------------------------------------
# Collectives, as dist, the functional collectives, ProcessGroup and Backend spell them (allreduce, _allgather_base,
# alltoall_base, all_gather_object, reduce_scatter_tensor, monitored_barrier, _broadcast_coalesced, ...).
COLLECTIVE = re.compile(r"^_?(all_?(reduce|gather|to_?all)|reduce|gather|scatter|broadcast|(monitored_)?barrier)")
POINT_TO_POINT = re.compile(r"^(i?send|i?recv|recv_anysource|batch_isend_irecv|(send|recv)_object_list"
                            r"|(isend|irecv)_inplace)$")
# The functional collectives' meta kernels and autograd pieces: registered elsewhere, never called by a submission.
NOT_CALLS = re.compile(r"(_meta|_backward|_setup_context)$")
# ProcessGroup's and the deprecated spellings, to the name the records use (dist's).
CANONICAL = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "allgather": "all_gather",
             "_allgather_base": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor",
             "allgather_coalesced": "all_gather_coalesced",
             "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
             "_reduce_scatter_base": "reduce_scatter_tensor", "alltoall": "all_to_all",
             "alltoall_base": "all_to_all_single"}
SENDS_ONE = {"send", "isend", "send_object_list", "isend_inplace"}


def kind(name: str) -> str | None:
    """'collective', 'p2p' (point-to-point) or None (not communication) for a function or method name."""
    if NOT_CALLS.search(name):
        return None
    if POINT_TO_POINT.match(name):
        return "p2p"
    if COLLECTIVE.match(name):
        return "collective"
    return None


def canonical(name: str) -> str:
    return CANONICAL.get(name, name)


def nbytes(obj) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    return 0


def payload_bytes(args, kwargs) -> int:
    """The op's whole buffer: the largest tensor (or list of tensors) among its arguments. That is the tensor for
    all_reduce, broadcast and send, the full output of an all-gather and the full input of a reduce-scatter,
    whichever layer and argument order the call came through."""
    return max((nbytes(a) for a in (*args, *kwargs.values())), default=0)


def tensor_bytes(args, kwargs) -> list[int]:
    """The bytes of each argument that is a tensor or a list of tensors, in order (positional, then keyword)."""
    def is_tensors(a):
        return isinstance(a, torch.Tensor) or (isinstance(a, (list, tuple)) and a
                                               and all(isinstance(t, torch.Tensor) for t in a))
    return [nbytes(a) for a in (*args, *kwargs.values()) if is_tensors(a)]


def sends_in(name: str, args) -> int:
    """How many messages a point-to-point call sends: 1 for send/isend, the isends of a batch_isend_irecv."""
    if name in SENDS_ONE:
        return 1
    if name == "batch_isend_irecv" and args and isinstance(args[0], (list, tuple)):
        return sum(getattr(getattr(op, "op", None), "__name__", "") == "isend" for op in args[0])
    return 0


# --- the recorder ---------------------------------------------------------------------------------------------
class Recorder:
    """While `recording()`: `events`, one dict per outermost call, and `sent_bytes`.

    An event: {"op": canonical name, "kind": "collective" | "p2p" | "wait", "via": "dist.all_reduce" (the layer
    and name called), "bytes": payload_bytes, "sends": messages sent (point-to-point), "t": perf_counter at the
    call, "async": whether it returned a handle to wait on (a Work, or anything with .wait()), "tensor_bytes": the bytes
    of each tensor (or list of tensors) argument, in argument order (an all_to_all_single's output and input: what it
    receives and what it sends), "groups": the process groups it ran on, each as its global ranks in group-rank order
    (None for one the recorder could not place), "peers": the global ranks its sends and receives named (both filled
    in while the call runs)}.
    `on_event(event)`, if set, runs as each is noted (before the call), e.g. to stamp a phase or follow a hang.
    """

    def __init__(self, ranks_of=None, group_of_call=None):
        self.ranks_of = ranks_of or (lambda obj: None)  # a ProcessGroup/Backend -> its global ranks, or None
        self.group_of_call = group_of_call or (lambda fn, args, kwargs: None)  # a call's `group` argument's ranks
        self.active = False
        self.events: list[dict] = []
        self.sent_bytes = 0
        self.on_event = None
        self._local = threading.local()  # call depth per thread: only the outermost call is an event

    @contextlib.contextmanager
    def recording(self):
        """Record (from scratch) what runs inside; calls outside pass through unrecorded (the grader's own)."""
        self.events, self.sent_bytes, self.active = [], 0, True
        try:
            yield self
        finally:
            self.active = False

    def collectives(self) -> list[str]:
        """The collectives called, as 'layer.name' (e.g. 'dist.all_reduce', 'ProcessGroup.allreduce'), once each."""
        return list(dict.fromkeys(e["via"] for e in self.events if e["kind"] == "collective"))

    def _call(self, fn, via, op, what, method, args, kwargs):
        depth = getattr(self._local, "depth", 0)
        given = args[1:] if method else args
        event = None
        if self.active:
            if depth == 0:
                event = {"op": op, "kind": what, "via": via, "bytes": payload_bytes(given, kwargs),
                         "sends": sends_in(op, given) if what == "p2p" else 0, "t": time.perf_counter(),
                         "async": False, "tensor_bytes": tensor_bytes(given, kwargs), "groups": [], "peers": []}
                self.events.append(event)
                self._local.event = event
                if self.on_event is not None:
                    self.on_event(event)
            if method and op == "send" and given:  # ProcessGroup/Backend.send: where every send ends
                self.sent_bytes += nbytes(given[0])
            outer = getattr(self._local, "event", None)
            if method and what != "wait" and outer is not None:  # where every dist.* call ends: its group is self
                self._place(outer, args[0], op, given)
        self._local.depth = depth + 1
        try:
            result = fn(*args, **kwargs)
        finally:
            self._local.depth = depth
            if event is not None:
                self._local.event = None
        if event is not None:
            event["async"] = hasattr(result, "wait")
            if what != "wait" and not event["groups"]:  # it reached no process group's method: its argument
                event["groups"].append(self.group_of_call(fn, args, kwargs))
        return result

    def _place(self, event: dict, group, op: str, given) -> None:
        """Note on `event` the group a ProcessGroup/Backend method runs on, and the global peer of a send/recv."""
        ranks = self.ranks_of(group)
        if ranks not in event["groups"]:
            event["groups"].append(ranks)
        if op in ("send", "recv") and len(given) > 1 and isinstance(given[1], int):  # (tensors, group rank, tag)
            peer = ranks[given[1]] if ranks is not None and 0 <= given[1] < len(ranks) else None
            event["peers"].append(peer)


def _wrapper(recorder: Recorder, fn, via: str, name: str, what: str, method: bool):
    """fn, recorded. Deliberately not functools.wraps: that would hand out the original as `__wrapped__`."""
    op = canonical(name)

    def wrapper(*args, **kwargs):
        return recorder._call(fn, via, op, what, method, args, kwargs)

    wrapper.__name__ = wrapper.__qualname__ = getattr(fn, "__name__", name)  # P2POp and batch_isend_irecv read it
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    return wrapper


def _classes(base) -> list[type]:
    found = [base]
    for sub in base.__subclasses__():
        found += _classes(sub)
    return found


_INSTALLED = [False]


def install() -> Recorder:
    """Wrap every layer (once per process, before the submission is imported) and return the recorder.

    The job keeps the recorder in a local variable: no module attribute leads to it.
    """
    if _INSTALLED[0]:
        raise RuntimeError("comm_recorder.install() runs once per process")
    _INSTALLED[0] = True
    import torch._C._distributed_c10d as c10d_cpp
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    recorder = Recorder(*_group_resolvers(c10d, funcol))
    done: dict[int, object] = {}  # id(original) -> its wrapper: dist and c10d share function objects (P2POp
    # compares dist.isend with c10d's isend), so one original gets one wrapper everywhere. Local: gone after install.
    for label, module in (("dist", dist), ("dist", c10d), ("functional_collectives", funcol),
                          ("torch._C._distributed_c10d", c10d_cpp)):
        for name, fn in list(vars(module).items()):
            what = kind(name)
            if what is None or not callable(fn) or isinstance(fn, type):
                continue
            if id(fn) not in done:
                done[id(fn)] = _wrapper(recorder, fn, f"{label}.{name}", name, what, method=False)
            setattr(module, name, done[id(fn)])
    for cls in _classes(c10d_cpp.ProcessGroup) + _classes(c10d_cpp.Backend):
        for name, fn in list(vars(cls).items()):
            what = kind(name)
            if what is not None and callable(fn):
                setattr(cls, name, _wrapper(recorder, fn, f"{cls.__name__}.{name}", name, what, method=True))
    dist.Work.wait = _wrapper(recorder, dist.Work.wait, "Work.wait", "wait", "wait", method=True)
    return recorder


def _group_resolvers(c10d, funcol):
    """(ranks_of, group_of_call), with torch's functions taken now (before a submission could rebind them).

    ranks_of(a ProcessGroup or Backend) -> its global ranks in group-rank order, or None. group_of_call(fn, args,
    kwargs) -> the global ranks of the call's `group` argument (None: the default group; a ProcessGroup, a group
    name, a rank list or a mesh, as the functional collectives take them), or None when it cannot tell."""
    ranks_of_group, world, registry = c10d.get_process_group_ranks, c10d._get_default_group, c10d._world
    resolve_name, by_name = funcol._resolve_group_name, c10d._resolve_process_group
    process_group, backend_class = c10d.ProcessGroup, torch._C._distributed_c10d.Backend  # c10d.Backend: names
    devices = (torch.device("cpu"), torch.device("cuda"))

    def ranks_of(group):
        try:
            if isinstance(group, process_group):
                return list(ranks_of_group(group))
            if isinstance(group, backend_class):  # called directly: the process group whose backend it is
                for pg in list(registry.pg_group_ranks):
                    for device in devices:
                        try:
                            if pg._get_backend(device) is group:
                                return list(ranks_of_group(pg))
                        except Exception:  # noqa: BLE001 - no backend for that device
                            continue
        except Exception:  # noqa: BLE001 - a group the recorder cannot place is reported as None
            return None
        return None

    def group_of_call(fn, args, kwargs):
        try:
            sig = inspect.signature(fn)
            bound = sig.bind(*args, **kwargs)
        except (TypeError, ValueError):
            return None
        if "group" not in sig.parameters:
            return None
        group = bound.arguments.get("group")
        if group is None:
            return ranks_of(world())
        if isinstance(group, process_group):
            return ranks_of(group)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return ranks_of(by_name(resolve_name(group, bound.arguments.get("tag", ""))))
        except Exception:  # noqa: BLE001
            return None

    return ranks_of, group_of_call
