"""Plan a training job at scale: memory per GPU and a step time for a transformer on dp x tp x pp x cp GPUs, MODELLED.

    plan = planner.plan_parallelism("llama3-405b", gpus=16384, dp=128, tp=8, pp=16, seq=8192, global_batch=2048)
    plan["fits"], plan["peak_bytes"], plan["step_s"], plan["mfu"]      # every figure modelled, never measured

Chapter 12's planner (viz/widgets.py, `parallelism_planner`) draws what this returns. Nothing here runs a model:
the sizes come from a model's published shape (SHAPES) and the cost models of gpucourse.models.costs.

Ranks are laid out as Llama 3 lays them out, [tp, cp, pp, dp] from the innermost: the tp ranks of a group are
neighbours (one node when tp <= 8), cp groups take the next stride, then pipeline stages, then data-parallel
replicas. Expert parallelism (MoE shapes only) splits each layer's experts over `ep` ranks of the data-parallel
group, as Megatron-LM folds it; the tokens then travel by all-to-all.

Memory per GPU, for the first and the last pipeline stage (the heaviest two: the embedding on the first, the
output head and its logits on the last):
  model states: bf16 parameters (2 bytes), bf16 gradients (2) and fp32 master weights + Adam's two moments (12),
    of the parameters the rank holds (its stage's layers / tp, its experts / ep), with ZeRO stage `zero` over the
    dp x cp ranks that hold the same parameters (costs.zero_memory_bytes);
  activations: Korthikanti et al. 2022's bytes per layer with tensor and sequence parallelism (s b h (34 + 5 a s /
    h) / t; selective recomputation keeps 34 s b h / t, full keeps the layer's input, 2 s b h / t), for the
    micro-batches 1F1B keeps in flight on that stage (costs.pipeline_peak_activations), the sequence split over
    cp; the last stage adds its fp32 logits (s b V / t x 4). A GPT layer's formula, an approximation for SwiGLU
    and grouped-query layers;
  not modelled: NCCL's buffers, the allocator's fragmentation, temporary buffers of the kernels.
Step time: the FLOPs of one GPU (6 N + 12 L d T per token, costs.model_flops_per_token, plus what recomputation
runs again) at the device's dense peak (an upper bound: real kernels reach a fraction of it), the pipeline's bubble
((p - 1) / m of the step), and each dimension's communication, ring alpha-beta on the link its group spans, not
overlapped with compute except the data-parallel gradient reduction, hidden behind the last micro-batch's backward
where it fits. Not modelled in time: ZeRO-3's extra all-gathers of the parameters, interleaved or zero-bubble
schedules, kernels slower than the peak, stragglers.
"""
from __future__ import annotations

from . import costs

# Published shapes. Llama 3: "The Llama 3 Herd of Models", Grattafiori et al. 2024 (arXiv 2407.21783), Table 3;
# SwiGLU MLPs (three matrices) and grouped-query attention (8 key/value heads). Megatron 1T: Narayanan et al.
# 2021 (arXiv 2104.04473), Table 1's last row: GPT layers (a 4h GELU MLP, two matrices), vocabulary 51,200.
# Mixtral 8x7B: Jiang et al. 2024 (arXiv 2401.04088), 8 experts, top-2.
SHAPES = {
    "gpt-1.3b": {"layers": 24, "d_model": 2048, "ffn": 8192, "heads": 16, "kv_heads": 16, "vocab": 51200,
                 "mlp_matrices": 2},
    "llama3-8b": {"layers": 32, "d_model": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256,
                  "mlp_matrices": 3},
    "llama3-70b": {"layers": 80, "d_model": 8192, "ffn": 28672, "heads": 64, "kv_heads": 8, "vocab": 128256,
                   "mlp_matrices": 3},
    "llama3-405b": {"layers": 126, "d_model": 16384, "ffn": 53248, "heads": 128, "kv_heads": 8, "vocab": 128256,
                    "mlp_matrices": 3},
    "megatron-1t": {"layers": 128, "d_model": 25600, "ffn": 102400, "heads": 160, "kv_heads": 160, "vocab": 51200,
                    "mlp_matrices": 2},
    "mixtral-8x7b": {"layers": 32, "d_model": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 32000,
                     "mlp_matrices": 3, "experts": 8, "top_k": 2},
}
BYTES = {"param": 2, "grad": 2, "optimizer": 12}  # bf16 weights and gradients; fp32 master, Adam's m and v
RECOMPUTE = ("none", "selective", "full")


def _whole(value, name, low=1):
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")


def shape_of(model) -> dict:
    """A SHAPES name, or a dict with layers, d_model, ffn, heads, kv_heads, vocab, mlp_matrices (experts, top_k)."""
    if isinstance(model, str):
        if model not in SHAPES:
            raise ValueError(f"unknown model {model!r}: one of {', '.join(SHAPES)}, or a dict of its shape")
        return dict(SHAPES[model])
    need = ("layers", "d_model", "ffn", "heads", "kv_heads", "vocab", "mlp_matrices")
    missing = [k for k in need if k not in model]
    if missing:
        raise ValueError(f"a model shape needs {', '.join(need)}; missing {', '.join(missing)}")
    return dict(model)


def shape_params(model) -> dict:
    """Parameters of a shape: {"layer_dense" (attention, and the MLP of a dense model), "layer_experts" (all the
    experts of one MoE layer), "embedding", "head", "total", "matmul" (what takes part in matrix products: every
    layer weight an average token meets, and the head; costs.model_flops_per_token's N)}. Norms and biases: left
    out (a few d_model per layer)."""
    s = shape_of(model)
    d, head_dim = s["d_model"], s["d_model"] // s["heads"]
    attention = 2 * d * d + 2 * d * s["kv_heads"] * head_dim  # q and out; k and v, kv_heads wide
    mlp = s["mlp_matrices"] * d * s["ffn"]
    experts, top_k = s.get("experts", 0), s.get("top_k", 0)
    layer_dense = attention + (0 if experts else mlp)
    layer_experts = experts * mlp + (d * experts if experts else 0)  # the router: d x E
    embedding = head = s["vocab"] * d
    total = s["layers"] * (layer_dense + layer_experts) + embedding + head
    active = s["layers"] * (attention + (top_k * mlp if experts else mlp)) + head
    return {"layer_dense": layer_dense, "layer_experts": layer_experts, "embedding": embedding, "head": head,
            "total": total, "matmul": active}


def _link(system, spans_nodes):
    spec = costs.SYSTEMS[system]
    return costs.INTERCONNECTS[spec["between"] if spans_nodes else spec["inside"]]


def _time(kind, size, n, system, spans_nodes):
    link = _link(system, spans_nodes)
    return costs.collective_time(kind, size, n, link.alpha, link.beta) if n > 1 else 0.0


def plan_parallelism(model, *, gpus, dp, tp=1, pp=1, cp=1, ep=1, seq=4096, global_batch=None, micro_batch=1,
                     zero=1, recompute="selective", system="h100-sxm", dtype="bf16", device_bytes=80e9):
    """Memory per GPU and a step time for `model` (a SHAPES name or a shape dict) trained on `gpus` GPUs split
    dp x tp x pp x cp (ep inside dp, MoE only), all MODELLED (module docstring).

    global_batch: sequences per step (default: one micro-batch per pipeline stage and replica, dp x pp x
    micro_batch). zero: the ZeRO stage over the dp x cp replicas (0-3; 1 is Megatron-LM's distributed optimizer).
    Returns {"label": "modelled", "fits", "device_bytes", "peak_bytes", "stages": [first, last] each {"stage",
    "layers", "params", "memory": {"params", "grads", "optimizer", "activations"}, "total"}, "micro_batches",
    "compute_s", "bubble_s", "comm_s": {"tp", "cp", "pp", "dp", "ep"}, "step_s", "mfu", "tokens_per_s",
    "spans_nodes": {dim: bool}, "warnings": [...], "assumes"}. Raises ValueError on a plan that cannot be laid
    out (dp x tp x pp x cp != gpus, a degree that does not divide what it splits)."""
    s = shape_of(model)
    for value, name in ((gpus, "gpus"), (dp, "dp"), (tp, "tp"), (pp, "pp"), (cp, "cp"), (ep, "ep"), (seq, "seq"),
                        (micro_batch, "micro_batch")):
        _whole(value, name)
    if dp * tp * pp * cp != gpus:
        raise ValueError(f"dp x tp x pp x cp = {dp} x {tp} x {pp} x {cp} = {dp * tp * pp * cp}, not the {gpus:,} "
                         "GPUs: every GPU holds one place in the grid, so the product must equal the GPU count")
    if system not in costs.SYSTEMS:
        raise ValueError(f"system must be one of {sorted(costs.SYSTEMS)}, got {system!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage, 0 to 3, got {zero!r}")
    if s["heads"] % tp or s["kv_heads"] % tp and tp % s["kv_heads"]:
        raise ValueError(f"tp={tp} must divide the {s['heads']} attention heads (and the {s['kv_heads']} key/value "
                         "heads, or be a multiple of them)")
    if pp > s["layers"]:
        raise ValueError(f"pp={pp} stages for {s['layers']} layers: at most one stage per layer")
    if seq % cp:
        raise ValueError(f"cp={cp} must divide the sequence length {seq}")
    experts = s.get("experts", 0)
    if ep > 1 and not experts:
        raise ValueError(f"ep={ep}: this model has no experts to split; ep must be 1 for a dense model")
    if dp % ep or experts and experts % ep:
        raise ValueError(f"ep={ep} must divide dp={dp} (the experts are split inside the data-parallel group) "
                         f"and the {experts} experts")
    global_batch = dp * pp * micro_batch if global_batch is None else global_batch
    _whole(global_batch, "global_batch")
    if global_batch % (dp * micro_batch):
        raise ValueError(f"global_batch={global_batch} must split into micro-batches of {micro_batch} over "
                         f"dp={dp} replicas (a multiple of {dp * micro_batch})")
    m = global_batch // (dp * micro_batch)
    spec = costs.SYSTEMS[system]
    node = spec["node_size"]
    p = shape_params(s)
    d, L, b = s["d_model"], s["layers"], micro_batch
    tokens = seq // cp  # of one micro-batch's sequence on this rank
    span = {"tp": tp > node, "cp": tp * cp > node, "pp": tp * cp * pp > node,
            "dp": gpus > node, "ep": ep > 1 and tp * cp * pp * ep > node}
    warnings = []
    if span["tp"]:
        warnings.append(f"tp={tp} spans nodes of {node}: its all-reduces, on every layer, ride the slower link")
    if pp > 1 and m < pp:
        warnings.append(f"{m} micro-batch(es) for {pp} stages: the pipeline never fills (bubble {pp - 1}/{m})")

    # --- memory, first and last stage
    per_stage = [L // pp + (1 if i < L % pp else 0) for i in range(pp)]
    per_layer_act = {"none": tokens * b * d * (34 + 5 * s["heads"] * tokens / d),
                     "selective": 34 * tokens * b * d, "full": 2 * tokens * b * d}[recompute] / tp
    stages = []
    for name, index in (("first", 0), ("last", pp - 1)):
        layers = per_stage[index]
        held = layers * (p["layer_dense"] / tp + p["layer_experts"] / (tp * ep))
        held += (p["embedding"] / tp if index == 0 else 0) + (p["head"] / tp if index == pp - 1 else 0)
        states = {part: costs.zero_memory_bytes(held, dp * cp, zero, param_bytes=BYTES["param"] if part == "params"
                                                else 0, grad_bytes=BYTES["grad"] if part == "grads" else 0,
                                                optimizer_bytes=BYTES["optimizer"] if part == "optimizer" else 0)
                  for part in ("params", "grads", "optimizer")}
        in_flight = costs.pipeline_peak_activations(pp, m, 1, index, "1F1B")
        activations = in_flight * layers * per_layer_act
        if index == pp - 1:
            activations += 4 * tokens * b * s["vocab"] / tp  # fp32 logits for the loss
        memory = {**states, "activations": activations}
        stages.append({"stage": name, "layers": layers, "params": held, "memory": memory,
                       "total": sum(memory.values())})
    if pp == 1:
        stages = stages[:1]
    peak = max(st["total"] for st in stages)

    # --- time of one step
    peak_flops = costs.peak_flops(spec["device"], dtype)
    model_flops = costs.model_flops_per_token(p["matmul"], L, d, seq) * seq * global_batch / gpus
    extra = {"none": 0.0, "selective": 0.0, "full": 1 / 3}[recompute]  # full: forward again, 1/3 of 6N
    compute = model_flops * (1 + extra) / peak_flops
    bubble = compute * costs.pipeline_bubble_ratio(pp, m) if pp > 1 else 0.0
    layers = max(per_stage)
    activation_bytes = 2 * tokens * b * d  # bf16, one micro-batch's hidden states on this rank's sequence
    tp_calls = (6 if recompute == "full" else 4) * layers * m  # 2 forward, 2 backward (+2 recomputed forward)
    kv_bytes = 2 * 2 * seq * b * s["kv_heads"] * (d // s["heads"]) / tp  # K and V, bf16, the whole sequence
    grad_bytes = BYTES["grad"] * max(st["params"] for st in stages)
    comm = {"tp": tp_calls * _time("all_reduce", activation_bytes, tp, system, span["tp"]),
            "cp": 2 * layers * m * _time("all_gather", kv_bytes, cp, system, span["cp"]),
            "pp": 2 * m * _time("send_recv", activation_bytes / tp, 2, system, span["pp"]) if pp > 1 else 0.0,
            "ep": 0.0}
    if experts:
        routed = tokens * b * s["top_k"] * d * 2 / tp  # bf16 tokens sent to their experts
        # dispatch and combine, forward and backward
        comm["ep"] = 4 * layers * m * _time("all_to_all", routed, ep, system, span["ep"])
    reduce_grads = _time("all_reduce", grad_bytes, dp * cp, system, span["dp"])
    last_backward = compute / m * costs.BACKWARD_FRACTION
    comm["dp"] = max(0.0, reduce_grads - last_backward)
    step = compute + bubble + sum(comm.values())
    return {"label": "modelled", "model": model if isinstance(model, str) else "custom", "gpus": gpus,
            "layout": {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}, "seq": seq, "global_batch": global_batch,
            "micro_batch": micro_batch, "micro_batches": m, "zero": zero, "recompute": recompute, "system": system,
            "device": spec["device"], "device_bytes": device_bytes, "params": p["total"], "stages": stages,
            "peak_bytes": peak, "fits": peak <= device_bytes, "compute_s": compute, "bubble_s": bubble,
            "comm_s": comm, "step_s": step, "mfu": model_flops / peak_flops / step,
            "tokens_per_s": seq * global_batch / step, "spans_nodes": span, "warnings": warnings,
            "assumes": f"compute at the {dtype} dense peak (an upper bound); 1F1B; ring alpha-beta on nominal links "
                       f"({spec['inside']} inside a node of {node}, {spec['between']} between); only the gradient "
                       "reduction overlapped; Korthikanti's activations; NCCL buffers and fragmentation left out"}


# --- published runs, read against the model (chapter 12) -------------------------------------------------------

# What each paper reports, and the plan that reproduces its layout. Only "reported" is the paper's; every figure
# plan_parallelism derives from "plan" is the course's model.
PUBLISHED = {
    "Megatron-LM 1T (Narayanan et al. 2021)": {
        "source": "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
                  "Megatron-LM, SC21, arXiv 2104.04473: Table 1 and section 5.1",
        "plan": {"model": "megatron-1t", "gpus": 3072, "dp": 6, "tp": 8, "pp": 64, "seq": 2048,
                 "global_batch": 3072, "system": "a100-sxm", "recompute": "full"},
        "reported": {"pflops": 502, "share_of_peak": 0.52, "tflops_per_gpu": 163,
                     "text": "502 PFLOP/s on 3,072 GPUs, 52 % of peak (163 TFLOP/s a GPU)"},
    },
    "Llama 3 405B, 8K context (Grattafiori et al. 2024)": {
        "source": "Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783: section 3.3.2, Table 4 "
                  "(16,384 GPUs, TP 8, CP 1, PP 16, DP 128, 8,192 tokens, 16M tokens a batch)",
        "plan": {"model": "llama3-405b", "gpus": 16384, "dp": 128, "tp": 8, "pp": 16, "seq": 8192,
                 "global_batch": 2048, "system": "h100-sxm"},
        "reported": {"tflops_per_gpu": 400, "mfu": 0.41, "text": "400 TFLOP/s a GPU, 41 % BF16 MFU"},
    },
    "Llama 3 405B, 128K context (Grattafiori et al. 2024)": {
        "source": "Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783: section 3.3.2, Table 4 "
                  "(16,384 GPUs, TP 8, CP 16, PP 16, DP 8, 131,072 tokens, 16M tokens a batch)",
        "plan": {"model": "llama3-405b", "gpus": 16384, "dp": 8, "tp": 8, "pp": 16, "cp": 16, "seq": 131072,
                 "global_batch": 128, "system": "h100-sxm"},
        "reported": {"tflops_per_gpu": 380, "mfu": 0.38, "text": "380 TFLOP/s a GPU, 38 % BF16 MFU"},
    },
}


def megatron_flops_per_iteration(batch, seq, layers, hidden, vocab):
    """Narayanan et al. 2021's FLOPs per iteration (their equation 3): 96 B s l h^2 (1 + s / 6h + V / 16 l h).

    It counts activation recomputation (a second forward: 4 passes instead of 3), so the paper's "share of peak"
    is a hardware utilisation; model_flops_per_token's 6 N + 12 L d T gives the model FLOPs utilisation (MFU)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def read_published(name) -> dict:
    """One PUBLISHED run: what the paper reports next to what the course's model says of the same layout.
    Returns {"name", "source", "reported", "plan" (plan_parallelism's result), "reported_mfu" (the paper's
    throughput as MFU by the course's 6 N + 12 L d T, the device's dense peak from costs.PEAK_DENSE_TFLOPS)}."""
    if name not in PUBLISHED:
        raise ValueError(f"unknown published run {name!r}: one of {', '.join(PUBLISHED)}")
    entry = PUBLISHED[name]
    spec = dict(entry["plan"])
    plan = plan_parallelism(spec.pop("model"), **spec)
    shape = shape_of(entry["plan"]["model"])
    peak = costs.peak_flops(plan["device"], "bf16")
    reported = entry["reported"]
    if "pflops" in reported:  # hardware FLOP/s by the paper's formula -> tokens/s -> model FLOP/s
        per_iter = megatron_flops_per_iteration(plan["global_batch"], plan["seq"], shape["layers"],
                                                shape["d_model"], shape["vocab"])
        tokens_per_s = reported["pflops"] * 1e15 / per_iter * plan["global_batch"] * plan["seq"]
        per_token = costs.model_flops_per_token(shape_params(shape)["matmul"], shape["layers"], shape["d_model"],
                                                plan["seq"])
        reported_mfu = tokens_per_s * per_token / (plan["gpus"] * peak)
    else:
        reported_mfu = reported["mfu"]
    return {"name": name, "source": entry["source"], "reported": reported, "plan": plan,
            "reported_mfu": reported_mfu}


def smallest_fitting(model, *, gpus, tp=8, seq=8192, cp=1, **kwargs):
    """The fewest pipeline stages (a power of two dividing gpus / (tp x cp)) at which the plan fits in the device's
    memory, or None when none does: {"pp", "plan"}."""
    pp = 1
    while gpus % (tp * cp * pp) == 0 and pp <= shape_of(model)["layers"]:
        plan = plan_parallelism(model, gpus=gpus, dp=gpus // (tp * cp * pp), tp=tp, pp=pp, cp=cp, seq=seq, **kwargs)
        if plan["fits"]:
            return {"pp": pp, "plan": plan}
        pp *= 2
    return None

