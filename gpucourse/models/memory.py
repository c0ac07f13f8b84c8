"""Memory per device, counted: model states under ZeRO stages 0-3 (chapter 07) and what autograd keeps for backward.

    from gpucourse.models.memory import model_states
    model_states(7.5e9, 64, stage=2)          # per device, in bytes; the calculator widget: viz.widgets.memory_calculator

`model_states` splits `costs.zero_memory_bytes` into its three parts — parameters, gradients, optimizer states
(for mixed precision the fp32 master copy counts as optimizer state, as in the ZeRO paper) — and adds what
offload keeps in CPU memory and the bytes each rank communicates per step (`costs.zero_comm_volume`).
Activations, temporary buffers and fragmentation are not modelled there: `SavedTensorBytes` counts activations.
"""
from __future__ import annotations

import math
import numbers

from . import costs
from .units import human_bytes

PARTS = ("parameters", "gradients", "optimizer states")
STAGE_NAMES = {0: "DDP (no sharding)", 1: "ZeRO-1: optimizer states", 2: "ZeRO-2: + gradients",
               3: "ZeRO-3 / FSDP: + parameters"}
OPTIMIZER_LABELS = {"adam": "Adam / AdamW (m, v)", "sgd_momentum": "SGD with momentum", "sgd": "plain SGD"}
PRECISION_LABELS = {"mixed": "bf16/fp16 + fp32 master", "fp32": "fp32"}


def model_states(num_params, world_size, stage, *, optimizer="adam", precision="mixed", offload=False) -> dict:
    """Bytes per device of each model state under a ZeRO stage, and what offload keeps in CPU memory.

    Returns {"parameters", "gradients", "optimizer states", "total"} (device bytes per rank: total ==
    costs.zero_memory_bytes), "cpu" (bytes per rank held in CPU memory by offload), "bytes_per_param" (the
    per-element sizes used) and "comm" (bytes each rank sends and receives per step, ZeRO paper's count).
    Stage s shards the first s of (optimizer states, gradients, parameters) over world_size ranks.
    """
    if isinstance(num_params, bool) or not isinstance(num_params, numbers.Real) or not 0 <= num_params < math.inf:
        raise ValueError(f"num_params must be a number >= 0 (the model's parameter count, e.g. 7.5e9), "
                         f"got {num_params!r}")
    if not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1 (data-parallel ranks), got {world_size!r}")
    sizes = costs.state_bytes_per_param(optimizer, precision)  # validates optimizer and precision
    total = costs.zero_memory_bytes(num_params, world_size, stage, offload=offload, **sizes)  # validates stage
    P, G, O = sizes["param_bytes"], sizes["grad_bytes"], sizes["optimizer_bytes"]
    n = world_size
    params = num_params * P / (n if stage >= 3 else 1)
    grads = num_params * G / (n if stage >= 2 else 1)
    optim = num_params * O / (n if stage >= 1 else 1)
    cpu = 0.0
    if offload:  # ZeRO-Offload: the optimizer shard (and from stage 2 the gradient shard) live in CPU memory
        cpu, optim = optim, 0.0
        if stage >= 2:
            cpu, grads = cpu + grads, 0.0
    return {"parameters": params, "gradients": grads, "optimizer states": optim, "total": total, "cpu": cpu,
            "bytes_per_param": sizes, "comm": costs.zero_comm_volume(num_params, stage, bytes_per_elem=P)}


def largest_model(device_bytes, world_size, stage, **kwargs) -> float:
    """The most parameters whose model states fit in device_bytes per device (activations not counted)."""
    if not device_bytes > 0:
        raise ValueError(f"device_bytes must be > 0 (memory per device, e.g. 80e9), got {device_bytes!r}")
    per_param = model_states(1, world_size, stage, **kwargs)["total"]
    return math.inf if per_param == 0 else device_bytes / per_param


def gb(num_bytes) -> str:
    """'31.4 GB', '512 MB': model memory in decimal units, as the ZeRO paper (units.human_bytes)."""
    return human_bytes(num_bytes, decimal=True)


def stages_table(num_params, world_size, **kwargs) -> list[dict]:
    """model_states for stages 0-3 (offload only where it applies: stages 1-3)."""
    offload = kwargs.pop("offload", False)
    return [{"stage": s, **model_states(num_params, world_size, s, offload=offload and s >= 1, **kwargs)}
            for s in range(4)]


# --- activations: what autograd keeps for backward, counted ---------------------------------------------------

class SavedTensorBytes:
    """Bytes of the tensors autograd keeps for backward during a forward pass, counted exactly, per layer.

        with SavedTensorBytes(exclude=model.parameters(), layers=model.blocks) as saved:
            loss = model(x, y)[1]          # count during forward; run backward after the block
        saved.per_layer, saved.outside, saved.total

    Every tensor an op saves for backward passes through torch.autograd.graph.saved_tensors_hooks; this counts the
    bytes of its storage once (several ops saving one tensor, or views of it, hold that memory once). Parameters
    are model states, not activations: their storages are excluded. Bytes are attributed to the layer whose
    forward was running when the storage was first saved; `outside` is everything saved outside `layers`.
    It works the same on CPU and GPU: it counts tensors, not an allocator.

    Checkpointed layers (torch.utils.checkpoint, non-reentrant) save only their inputs through these hooks.
    Selective checkpointing keeps the outputs its policy chose in a cache of its own, out of the hooks' sight: wrap
    the policy with `recording(policy)` and those outputs are counted too.
    """

    def __init__(self, exclude=(), layers=()):
        self._excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self._layers = list(layers)
        self._seen = {}        # storage address -> layer index (None: outside the layers)
        self._bytes = {}       # layer index -> bytes
        self._current = None
        self._handles = []
        self._hooks = None

    def _record(self, tensor):
        import torch

        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self._excluded or address in self._seen:
            return
        self._seen[address] = self._current
        self._bytes[self._current] = self._bytes.get(self._current, 0) + storage.nbytes()

    def _pack(self, tensor):
        self._record(tensor)
        return tensor

    def recording(self, policy):
        """A selective-checkpoint policy that does what `policy` does and counts the outputs it decides to keep."""
        from torch.utils.checkpoint import CheckpointPolicy

        def counted(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if isinstance(decision, bool):  # torch accepts True/False for save/recompute as well
                decision = CheckpointPolicy.MUST_SAVE if decision else CheckpointPolicy.PREFER_RECOMPUTE
            if not ctx.is_recompute and decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                if hasattr(ctx, "op_output"):
                    outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
                    for out in outputs:
                        self._record(out)
                else:
                    self._record_meta(op, args, kwargs)
            return decision

        return counted

    def _record_meta(self, op, args, kwargs):
        """Older torch (2.11) asks the policy before the op runs and shows it no output: run the op on meta
        tensors for the output's bytes (a view op keeps no memory of its own)."""
        import torch
        from torch.utils._pytree import tree_leaves, tree_map

        if op.is_view:
            return
        meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        for out in tree_leaves(op(*tree_map(meta, args), **tree_map(meta, kwargs))):
            if isinstance(out, torch.Tensor):
                self._bytes[self._current] = self._bytes.get(self._current, 0) + out.untyped_storage().nbytes()

    def _enter_layer(self, index):
        def hook(module, args):
            self._current = index
        return hook

    def _leave_layer(self, module, args, output):
        self._current = None

    def __enter__(self):
        import torch

        for i, layer in enumerate(self._layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter_layer(i)))
            self._handles.append(layer.register_forward_hook(self._leave_layer))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._current = None
        return False

    @property
    def per_layer(self) -> list[int]:
        """Bytes saved while each of `layers` ran, in their order."""
        return [self._bytes.get(i, 0) for i in range(len(self._layers))]

    @property
    def outside(self) -> int:
        return self._bytes.get(None, 0)

    @property
    def total(self) -> int:
        return sum(self._bytes.values())


def transformer_layer_activation_bytes(s, b, h, a, *, bytes_per_element=2, dropout=True):
    """Korthikanti et al. 2022 (section 4.1): activation bytes one transformer layer keeps for backward, without
    recomputation or tensor parallelism, for sequence length s, micro-batch b, hidden size h and a heads.

    With 16-bit activations and dropout, as the paper has it: s b h (34 + 5 a s / h). Per element of 16-bit
    activations that is 16 s b h + a s^2 b (2 bytes each: layer norm inputs, q k v and output-projection inputs,
    q and k, v, the softmax output, the MLP's inputs, 4 h wide in its middle) plus dropout's 1-byte masks
    (2 s b h and a s^2 b) and the attention dropout's 16-bit output (a s^2 b). dropout=False keeps the first part
    only, in bytes_per_element bytes: for float32 training, 4 (16 s b h + a s^2 b). Layer norm's per-token
    statistics (a few s b) are left out, as in the paper.
    """
    elements = 16 * s * b * h + a * s * s * b
    if not dropout:
        return bytes_per_element * elements
    if bytes_per_element != 2:
        raise ValueError("Korthikanti's formula with dropout is for 16-bit activations (bytes_per_element=2); "
                         "for other widths pass dropout=False (dropout masks are 1 byte whatever the dtype)")
    return 2 * elements + (2 * s * b * h + a * s * s * b) + 2 * a * s * s * b


# --- model states, counted: what a run holds after an optimizer step ------------------------------------------

def _local_bytes(tensor):
    """(storage address, bytes) this process holds for `tensor`: a DTensor (FSDP2) holds only its local shard."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr(), local.numel() * local.element_size()


def model_state_bytes(params, optimizer, master=()) -> dict:
    """Bytes the model states hold right now, counted from the tensors themselves (CPU or GPU alike).

        model_state_bytes(model.parameters(), opt)                      # fp32, autocast, pure bf16
        model_state_bytes(model.parameters(), opt, master=fp32_copies)  # mixed precision by hand

    params: the parameters forward and backward use; master: fp32 copies the optimizer updates instead, if any;
    optimizer: a torch.optim.Optimizer, whose per-parameter state (Adam's m and v...) is counted.
    Returns bytes of {"parameters", "gradients" (of params and of master copies, where held), "master weights",
    "optimizer states" (state tensors of their parameter's shape), "step counters" (a state named "step", or
    of another shape: Adam keeps a one-element step per tensor - per tensor, not per parameter, so the
    formulas leave it out)}.
    Each storage is counted once, so a tensor that shows up twice (tied weights, a state aliasing a
    parameter) is not counted twice; the first part it appears in, in the order above, gets it.
    """
    import torch

    params, master = list(params), list(master)
    for name, group in (("params", params), ("master", master)):
        bad = [type(t).__name__ for t in group if not isinstance(t, torch.Tensor)]
        if bad:
            raise ValueError(f"{name} must hold tensors (e.g. model.parameters()), got {', '.join(bad)}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (its state is what is counted), "
                         f"got {type(optimizer).__name__}")
    seen = set()
    parts = dict.fromkeys(("parameters", "gradients", "master weights", "optimizer states", "step counters"), 0)

    def add(part, tensor):
        if tensor is None:
            return
        address, nbytes = _local_bytes(tensor)
        if address not in seen:  # a zero-size tensor has address 0 and no bytes: harmless either way
            seen.add(address)
            parts[part] += nbytes

    for p in params:
        add("parameters", p)
    for t in params + master:
        add("gradients", t.grad)
    for m in master:
        add("master weights", m)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                counter = key == "step" or value.shape != param.shape
                add("step counters" if counter else "optimizer states", value)
    return parts
