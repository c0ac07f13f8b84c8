"""Plan a training job at scale: memory per GPU and a step-time ESTIMATE for a transformer on dp x tp x pp x cp GPUs.

    plan = planner.plan_parallelism("llama3-405b", gpus=16384, dp=128, tp=8, pp=16, seq=8192, global_batch=2048,
                                    schedule="interleaved", virtual_stages=4)
    plan["fits"], plan["peak_bytes"], plan["step_s"], plan["mfu"], plan["terms"]   # modelled, never measured

Chapter 12 draws what this returns (viz/widgets.py, `parallelism_planner`) and reads published runs against it
(models/published.py). Nothing here runs a model: the sizes come from a model's shape (SHAPES) and the cost models
of gpucourse.models.costs.

Ranks are laid out as Llama 3 lays them out, [tp, cp, pp, dp] from the innermost: a tp group is one node when
tp <= 8, cp groups take the next stride, then pipeline stages, then data-parallel replicas. Expert parallelism (MoE
shapes) splits each layer's experts over `ep` ranks of the dp x cp group; an expert's states are then replicated
over the expert-data-parallel group of dp x cp / ep ranks, and sharded over it by ZeRO.

Memory per GPU, for the first and the last pipeline stage (the embedding on the first, the head and its logits on
the last):
  model states: bf16 parameters (2 bytes), fp32 gradients (4: Megatron-LM and Llama 3 reduce fp32 gradients) and
    fp32 master weights + Adam's two moments (12), of the parameters the rank holds; ZeRO stage `zero` shards them
    over the ranks that hold the same parameters (dp x cp; dp x cp / ep for experts). ZeRO-1 is Megatron-LM's
    distributed optimizer: 6 + 12/d bytes a parameter;
  activations: per layer and token, what the backward needs (`activation_bytes_per_token`, Korthikanti et al.
    2022's count generalised to grouped-query attention and 2- or 3-matrix MLPs), for the micro-batches the
    schedule keeps in flight on that stage (costs.pipeline_peak_activations), plus the last stage's final norm,
    head input and logits (Megatron-LM's implementation by default; options name torch's where it keeps more:
    SP_SAVES, NORM_KERNELS, loss_parallel). Not counted: torch's pipeline schedule's receive buffers (one per
    micro-batch) and the stage output it keeps, attention's logsumexp and the norms' per-token statistics;
  headroom (`reserved_bytes`): the CUDA context, NCCL's buffers per process group and the caching allocator's
    fragmentation, against the device's memory in GiB ("80 GB" HBM is 80 GiB).
Step time, per micro-batch on the slowest stage, then the pipeline: matrix products at the device's sustained
matmul rate (SUSTAINED, a measurement, not the datasheet peak), attention at a flash-attention rate, memory-bound
kernels at the HBM bandwidth, TP / CP / EP communication not overlapped (ring alpha-beta on the links each group
spans), the schedule's bubble, pipeline sends, and the data-parallel reduction overlapped with the last
micro-batch's backward. Every term is returned in plan["terms"].
"""
from __future__ import annotations

from . import costs
from .stage_collectives import collectives

# Published shapes. Llama 3: "The Llama 3 Herd of Models", Grattafiori et al. 2024 (arXiv 2407.21783), Table 3;
# SwiGLU MLPs (three matrices) and grouped-query attention (8 key/value heads). Megatron GPTs: Narayanan et al.
# 2021 (arXiv 2104.04473), Table 1: GPT layers (a 4h GELU MLP, two matrices), vocabulary 51,200, the embedding
# tied to the head (their parameter counts: 39.1 B to 1,008 B). MT-NLG 530B:
# Smith et al. 2022 (arXiv 2201.11990), section 2: 105 layers, hidden 20,480, 128 heads. Mixtral 8x7B: Jiang et
# al. 2024 (arXiv 2401.04088), 8 experts, top-2.
SHAPES = {
    "gpt-1.3b": {"layers": 24, "d_model": 2048, "ffn": 8192, "heads": 16, "kv_heads": 16, "vocab": 51200,
                 "mlp_matrices": 2},
    "llama3-8b": {"layers": 32, "d_model": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256,
                  "mlp_matrices": 3},
    "llama3-70b": {"layers": 80, "d_model": 8192, "ffn": 28672, "heads": 64, "kv_heads": 8, "vocab": 128256,
                   "mlp_matrices": 3},
    "llama3-405b": {"layers": 126, "d_model": 16384, "ffn": 53248, "heads": 128, "kv_heads": 8, "vocab": 128256,
                    "mlp_matrices": 3},
    "megatron-39b": {"layers": 48, "d_model": 8192, "ffn": 32768, "heads": 64, "kv_heads": 64, "vocab": 51200,
                     "mlp_matrices": 2, "tied": True},
    "megatron-76b": {"layers": 60, "d_model": 10240, "ffn": 40960, "heads": 80, "kv_heads": 80, "vocab": 51200,
                     "mlp_matrices": 2, "tied": True},
    "megatron-146b": {"layers": 80, "d_model": 12288, "ffn": 49152, "heads": 96, "kv_heads": 96, "vocab": 51200,
                      "mlp_matrices": 2, "tied": True},
    "megatron-310b": {"layers": 96, "d_model": 16384, "ffn": 65536, "heads": 128, "kv_heads": 128, "vocab": 51200,
                      "mlp_matrices": 2, "tied": True},
    "megatron-530b": {"layers": 105, "d_model": 20480, "ffn": 81920, "heads": 128, "kv_heads": 128, "vocab": 51200,
                      "mlp_matrices": 2, "tied": True},
    "megatron-1t": {"layers": 128, "d_model": 25600, "ffn": 102400, "heads": 160, "kv_heads": 160, "vocab": 51200,
                    "mlp_matrices": 2, "tied": True},
    "mixtral-8x7b": {"layers": 32, "d_model": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 32000,
                     "mlp_matrices": 3, "experts": 8, "top_k": 2},
}
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved", "zero-bubble", "dualpipev")
ATTENTION = ("flash", "unfused")
# What sequence parallelism keeps for the backward of a column-parallel layer (q/k/v, the MLP's input matrices, the
# head), whose input it all-gathers over tp in the forward: "sharded", Megatron-LM's (Korthikanti et al. 2022,
# section 4.2.2: the norm's sequence-sharded output is kept and all-gathered again in the backward, overlapped with
# the input-gradient matmul), or "gathered", torch's DTensor (2.13: PrepareModuleInput to Replicate before
# ColwiseParallel layers, as torchtitan and scripts/13_gpt_3d.py apply it: the linear layers keep the gathered,
# whole-sequence input, and the backward gathers nothing again).
SP_SAVES = ("sharded", "gathered")
# What a norm keeps for its backward: "fused", a GPU's fused kernel (the input, in the activations' dtype, and a
# per-token statistic, which Korthikanti's count and this one leave out: 4 bytes a token); "composite", torch's
# composite RMSNorm (torch.rms_norm where no fused kernel exists: the CPU in 2.13, so what a CPU dry run counts),
# which computes in fp32 and keeps the fp32 input and the fp32 normalised product (x * rstd, for the weight's
# gradient): 8 bytes an element whatever the activations' dtype. A CPU artefact, not a GPU recipe.
NORM_KERNELS = ("fused", "composite")
BYTES = {"param": 2, "grad": 4, "optimizer": 12}  # bf16 weights, fp32 gradients; fp32 master, Adam's m and v

GiB = 2 ** 30
# What a device sustains, measured, not its datasheet peak (costs.PEAK_DENSE_TFLOPS), in FLOP/s and bytes/s:
#   matmul: bf16 matrix products at their best shape, "Maximum Achievable Matmul FLOPS" (MAMF) measured with
#     torch.matmul: A100 SXM 267.9 TFLOP/s (85.9 % of 312), H100 SXM 792.1 (80.1 % of 989). S. Bekman,
#     Machine Learning Engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
#     table" (github.com/stas00/ml-engineering).
#   attention: flash attention's forward + backward, counted the flash-attention way (causal half, backward 2.5x
#     the forward): FlashAttention-2 (Dao 2023, arXiv 2307.08691, section 4.1) reaches about 190 TFLOP/s on an
#     A100 and about 335 on an H100 at head size 128.
#   hbm: the datasheet's memory bandwidth (A100 SXM 80GB 2.04 TB/s, H100 SXM 3.35 TB/s): memory-bound kernels.
SUSTAINED = {
    "NVIDIA A100-SXM4-80GB": {"matmul": 267.9e12, "attention": 190e12, "hbm": 2.039e12},
    "NVIDIA H100 80GB HBM3": {"matmul": 792.1e12, "attention": 335e12, "hbm": 3.35e12},
}
# The one constant FITTED, not measured: the share of those rates the matmul and attention kernels keep inside a
# whole training step (shapes other than the best one, NCCL's kernels taking SMs, launch gaps). With every other
# term physical, the six Megatron-LM rows (A100, models/published.py) come out 1.22-1.27x too fast at 1.0; 0.75
# centres them (0.98-1.04). The Llama 3 rows (H100, another model, schedule and network) were not used to choose
# it and land at 0.94-1.02. A GPU's own profile of a step (its kernels' shares) is what should replace it.
KERNEL_EFFICIENCY = 0.75
# Memory the training tensors cannot have (reserved_bytes): the CUDA context with cuBLAS' and NCCL's own
# allocations (about 1 GiB), NCCL's buffers per communicator (NCCL_BUFFSIZE 4 MiB x channels x peers: a few
# hundred MiB a group), and the caching allocator's fragmentation (a share of what is allocated).
CUDA_CONTEXT_BYTES = 1 * GiB
NCCL_BYTES_PER_GROUP = 0.5 * GiB
FRAGMENTATION = 0.10
# Memory-bound kernels (norms, activation functions, rotary, residual adds): bytes they read and write per token
# and layer, forward, ASSUMED (not measured: a count of each kernel's bf16 reads and writes in a GPT/Llama layer,
# rounded); the backward moves about twice that. In the published runs they are 0.4-14 % of the step.
_ELEMENTWISE_FORWARD = {"per_d_model": 24, "per_ffn": 4}


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


def llama3_stage_layers(layers: int, stages: int) -> list[int]:
    """Blocks per pipeline stage as Llama 3 split them: the first and the last stage one fewer than the others,
    for the embedding and for the head and loss (126 layers on 16 stages: 7, 8 x 14, 7; section 3.3.2 of the
    paper). scripts/13_gpt_3d.py --split llama3 splits the same way."""
    per = (layers + 2) // stages
    split = [per - 1] + [per] * (stages - 2) + [per - 1] if stages > 1 else [layers]
    if sum(split) != layers:
        raise ValueError(f"Llama 3's split needs the stages ({stages}) to divide the layers + 2 ({layers + 2})")
    return split


def shape_params(model) -> dict:
    """Parameters of a shape: {"layer_dense" (attention, and the MLP of a dense model), "layer_experts" (all the
    experts of one MoE layer, and its router), "layer_active" (what one token meets in a layer: attention and top_k
    experts), "embedding", "head", "total", "matmul" (what takes part in matrix products for an average token:
    every layer's active weights and the head; costs.model_flops_per_token's N), and the parts tensor parallelism
    splits ("layer_split") and leaves whole ("layer_whole")}. Norms, biases and learned positions count only where
    the shape names them: "norm" ("layernorm": 2d a norm, "rmsnorm": d; two a layer and a final one), "biases"
    (True: every linear layer's), "positions" (rows of a learned position table). SHAPES leaves them out.
    A shape with "tied": True shares one matrix between the embedding and the head (Megatron-LM's GPTs): counted
    once in "total"; a pipeline still keeps a copy on its first and its last stage."""
    s = shape_of(model)
    d, head_dim = s["d_model"], s["d_model"] // s["heads"]
    attention = 2 * d * d + 2 * d * s["kv_heads"] * head_dim  # q and out; k and v, kv_heads wide
    mlp = s["mlp_matrices"] * d * s["ffn"]
    experts, top_k = s.get("experts", 0), s.get("top_k", 0)
    kv_width = s["kv_heads"] * head_dim
    # what tensor parallelism splits (weights; the column-parallel layers' biases) and what it leaves whole on
    # every tp rank (norms; the row-parallel layers' biases), when the shape counts biases and norms
    split_biases = (d + 2 * kv_width + (s["mlp_matrices"] - 1) * s["ffn"] * (not experts)) * s.get("biases", False)
    whole_biases = (d + d * (not experts)) * s.get("biases", False)
    norm = {None: 0, "rmsnorm": d, "layernorm": 2 * d}[s.get("norm")]
    layer_split = attention + (0 if experts else mlp) + split_biases
    layer_whole = 2 * norm + whole_biases
    layer_dense = layer_split + layer_whole
    layer_experts = experts * mlp + (d * experts if experts else 0)  # the router: d x E
    layer_active = attention + (top_k * mlp + d * experts if experts else mlp)
    embedding = head = s["vocab"] * d
    positions = s.get("positions", 0) * d
    total = (s["layers"] * (layer_dense + layer_experts) + embedding + positions + norm
             + (0 if s.get("tied") else head))
    return {"layer_dense": layer_dense, "layer_split": layer_split, "layer_whole": layer_whole,
            "layer_experts": layer_experts, "layer_active": layer_active, "embedding": embedding,
            "positions": positions, "final_norm": norm, "head": head, "total": total,
            "matmul": s["layers"] * layer_active + head}


def activation_bytes_per_token(model, *, tp=1, sequence_parallel=True, recompute="selective", attention="flash",
                               seq=None, dropout=False, sp_saves="sharded", norm_kernel="fused",
                               element_bytes=2) -> float:
    """Bytes one layer keeps for the backward, per token of a micro-batch on one tensor-parallel rank (bf16
    activations, element_bytes 2, unless told).

    Korthikanti et al. 2022 (arXiv 2205.05198), section 4, for a GPT layer: s b h (34 + 5 a s / h) bytes, 10 of the
    34 replicated on every tp rank without sequence parallelism. Term by term, so that grouped-query attention and
    a SwiGLU MLP count right: the two norms' inputs and outputs (4 x 2h, replicated without sequence parallelism),
    q and the attention output (2 x 2h), k and v (2 x 2 kv_width), the MLP's inner tensors (2 ffn each: two for a
    GELU MLP, four for SwiGLU's gate, up, activation and product), dropout masks (h bytes each, two, when the model
    uses dropout), and unfused attention's scores (5 a s bytes: softmax output, dropout mask and output). Flash
    attention keeps no scores (it recomputes them in its backward; its per-head logsumexp, 4 bytes a head, is left
    out). Selective recomputation drops the scores; full recomputation keeps only the layer's input (2h).

    sp_saves (SP_SAVES; with sequence parallelism only): "sharded" counts the norms' outputs at 1/tp (Megatron-LM);
    "gathered" counts, in their place, the whole gathered input of the attention's and the MLP's column-parallel
    layers (2 x 2h on every tp rank: torch's DTensor). norm_kernel (NORM_KERNELS): "fused" counts each norm's
    input in the activations' dtype; "composite" its fp32 input and fp32 product (8 bytes an element).
    element_bytes: bytes of an activation's element (4 for fp32 activations: every term scales with it, but a
    composite norm's fp32 copies)."""
    s = shape_of(model)
    if recompute not in RECOMPUTE or attention not in ATTENTION:
        raise ValueError(f"recompute must be one of {RECOMPUTE} and attention one of {ATTENTION}")
    if sp_saves not in SP_SAVES or norm_kernel not in NORM_KERNELS:
        raise ValueError(f"sp_saves must be one of {SP_SAVES} and norm_kernel one of {NORM_KERNELS}")
    d, f, e = s["d_model"], s["ffn"], element_bytes
    kv_width = s["kv_heads"] * (d // s["heads"])
    if recompute == "full":
        return e * d / (tp if sequence_parallel else 1)
    norm_inputs = 2 * (8 * d if norm_kernel == "composite" else e * d)
    column_inputs = 2 * e * d  # the norms' outputs: what the attention's and the MLP's first matrices multiply
    replicated = norm_inputs + column_inputs + (2 * d * e / 2 if dropout else 0)  # (and the two dropout masks)
    split = 2 * e * d + 2 * e * kv_width + (2 if s["mlp_matrices"] == 2 else 4) * e * f
    if attention == "unfused" and recompute == "none":
        if seq is None:
            raise ValueError("unfused attention keeps a x s scores per token: give seq")
        split += 5 * s["heads"] * seq * e / 2
    if not sequence_parallel:
        return replicated + split / tp
    if sp_saves == "gathered":  # the gathered inputs, whole, in place of the norms' sharded outputs
        return (replicated - column_inputs + split) / tp + column_inputs
    return (replicated + split) / tp


def _head_activation_bytes(s, *, tp, sequence_parallel, sp_saves, norm_kernel, element_bytes, vocab_parallel,
                           loss_parallel) -> float:
    """Bytes the last stage keeps beyond its layers, per token of a micro-batch on one tp rank: the final norm's
    input (as a layer's norm keeps it), the head's input (the norm's output: sharded under "sharded" sequence
    parallelism, whole under "gathered" or without sequence parallelism), and for the loss either the fp32
    softmax of the rank's 1/tp of the logits (Megatron-LM's vocabulary-parallel cross-entropy: loss_parallel with a
    vocabulary-parallel head) or the whole logits and their log-softmax in the activations' dtype (the logits
    gathered whole, or a whole head: torch's pipeline schedule keeps the last stage's output until its backward,
    and cross-entropy keeps its log-softmax)."""
    d, vocab, e = s["d_model"], s["vocab"], element_bytes
    cut = tp if sequence_parallel else 1
    norm = (8 * d if norm_kernel == "composite" else e * d) / cut  # outside the layers: never recomputed
    head_input = e * d / (tp if sequence_parallel and sp_saves == "sharded" else 1)
    if vocab_parallel and loss_parallel:
        return norm + head_input + 4 * vocab / tp
    return norm + head_input + 2 * e * vocab


def _link(system, spans_nodes):
    spec = costs.SYSTEMS[system]
    return costs.INTERCONNECTS[spec["between"] if spans_nodes else spec["inside"]]


def _time(kind, size, n, system, spans_nodes):
    link = _link(system, spans_nodes)
    return costs.collective_time(kind, size, n, link.alpha, link.beta) if n > 1 else 0.0


def bubble_slots(schedule, pp, virtual_stages=1):
    """Idle time of one pipeline step, in micro-batch times (one forward + backward of one micro-batch on one
    stage): 1F1B (Narayanan et al. 2021) p - 1; interleaved with v chunks per rank (p - 1) / v; zero-bubble's
    ZB-H1 (Qi et al. 2023, arXiv 2401.10241) a third of 1F1B's at the same memory, weights' gradients filling
    it; DualPipeV (DeepSeek-V3, costs.dualpipev_bubble) with F = B/2 = W, its 2p half-size chunks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if pp == 1:
        return 0.0
    if schedule == "1f1b":
        return float(pp - 1)
    if schedule == "interleaved":
        return (pp - 1) / virtual_stages
    if schedule == "zero-bubble":
        return (pp - 1) / 3
    chunk = 0.5  # a DualPipeV chunk holds half a stage's layers
    forward, backward = chunk / 3, 2 * chunk / 3
    return costs.dualpipev_bubble(pp, forward, backward, backward / 2)


def _check(s, gpus, dp, tp, pp, cp, ep, seq, micro_batch, zero, recompute, system, schedule, virtual_stages,
           attention):
    for value, name in ((gpus, "gpus"), (dp, "dp"), (tp, "tp"), (pp, "pp"), (cp, "cp"), (ep, "ep"), (seq, "seq"),
                        (micro_batch, "micro_batch"), (virtual_stages, "virtual_stages")):
        _whole(value, name)
    if dp * tp * pp * cp != gpus:
        raise ValueError(f"dp x tp x pp x cp = {dp} x {tp} x {pp} x {cp} = {dp * tp * pp * cp}, not the {gpus:,} "
                         "GPUs: every GPU holds one place in the grid, so the product must equal the GPU count")
    if system not in costs.SYSTEMS:
        raise ValueError(f"system must be one of {sorted(costs.SYSTEMS)}, got {system!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage, 0 to 3, got {zero!r}")
    if s["heads"] % tp or s["kv_heads"] % tp and tp % s["kv_heads"]:
        raise ValueError(f"tp={tp} must divide the {s['heads']} attention heads (and the {s['kv_heads']} key/value "
                         "heads, or be a multiple of them)")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    chunks = {"interleaved": virtual_stages, "dualpipev": 2}.get(schedule, 1)
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError("schedule='interleaved' needs virtual_stages >= 2 (chunks of layers per rank); with one "
                         "chunk per rank it is 1F1B")
    if schedule in ("interleaved", "dualpipev") and pp < 2:
        raise ValueError(f"schedule={schedule!r} splits each rank's layers into chunks of a pipeline: it needs "
                         "pp >= 2 (with pp = 1 use '1f1b')")
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved' (DualPipeV always has 2)")
    if pp * chunks > s["layers"]:
        raise ValueError(f"pp={pp} stages x {chunks} chunk(s) each for {s['layers']} layers: at most one chunk "
                         "per layer")
    if seq % cp:
        raise ValueError(f"cp={cp} must divide the sequence length {seq}")
    experts = s.get("experts", 0)
    if ep > 1 and not experts:
        raise ValueError(f"ep={ep}: this model has no experts to split; ep must be 1 for a dense model")
    if (dp * cp) % ep or experts and experts % ep:
        raise ValueError(f"ep={ep} must divide dp x cp = {dp * cp} (the experts are split inside the data-parallel "
                         f"group) and the {experts} experts")


def plan_parallelism(model, *, gpus, dp, tp=1, pp=1, cp=1, ep=1, seq=4096, global_batch=None, micro_batch=1,
                     zero=1, recompute="selective", system="h100-sxm", schedule="1f1b", virtual_stages=1,
                     sequence_parallel=None, attention="flash", dropout=False, dtype="bf16", device_bytes=80 * GiB,
                     grad_bytes=BYTES["grad"], recipe=None, vocab_parallel=True, stage_layers=None,
                     sp_saves="sharded", norm_kernel="fused", loss_parallel=True):
    """Memory per GPU and a step-time estimate for `model` (a SHAPES name or a shape dict) trained on `gpus` GPUs
    split dp x tp x pp x cp (ep inside dp x cp, MoE only), all MODELLED (module docstring).

    global_batch: sequences per step (default: one micro-batch per pipeline stage and replica, dp x pp x
    micro_batch). zero: the ZeRO stage over the ranks holding the same parameters (0-3; 1 is Megatron-LM's
    distributed optimizer). With several micro-batches a step (a pipeline's, or gradient accumulation's), stages 2
    and 3 keep no whole gradient between them: they reduce-scatter every micro-batch (and stage 3 all-gathers the
    weights every micro-batch), which the step time charges (DeepSpeed refuses them with pipeline parallelism). schedule: "1f1b", "interleaved" (with
    virtual_stages >= 2 chunks per rank and at least pp micro-batches), "zero-bubble" (ZB-H1) or "dualpipev" (at
    least 2 pp micro-batches; rank 0 holds the first and the last chunk, so the embedding and the head). sequence_parallel: default on when
    tp > 1. attention: "flash" (no scores kept) or "unfused" (Megatron-LM 2021). device_bytes: the device's memory
    (80 GiB for an "80 GB" A100 or H100). recipe: None for Megatron-LM's bytes (BYTES, grad_bytes), or one of
    costs.RECIPES (costs.recipe_bytes_per_param with Adam; activations then 4 bytes under "fp32" and "autocast",
    2 otherwise): "fp32" is what a CPU dry run holds. vocab_parallel: the embedding and the head split over tp
    (Megatron-LM), or whole on every tp rank (the course's capstone). stage_layers: the layers of each of the pp
    stages (default: layers / pp each, the first layers % pp stages one more); Llama 3 gave its first and last
    stage one layer fewer than the others (126 on 16: 7, 8 x 14, 7), as scripts/13_gpt_3d.py's --split llama3 does.
    The defaults are Megatron-LM's implementation; three options name another's (a dry run of the course's 3-D
    capstone, chapter 12's `llama_job`, sets all three): sp_saves (SP_SAVES), what sequence parallelism keeps for
    the backward of the column-parallel layers, "sharded" (Megatron-LM: gathered again in the backward) or
    "gathered" (torch's DTensor); norm_kernel (NORM_KERNELS), what a norm keeps, "fused" (a GPU's kernel) or
    "composite" (torch's RMSNorm without a fused kernel, the CPU's: fp32 copies); loss_parallel, with a
    vocabulary-parallel head, Megatron-LM's vocabulary-parallel cross-entropy (True: each tp rank keeps the fp32
    softmax of its 1/tp of the logits, three small all-reduces) or the logits all-gathered whole on every tp rank
    and the plain cross-entropy (False: the whole logits, kept as the last stage's output, and their log-softmax,
    in the activations' dtype). Without a vocabulary-parallel head the logits are whole on every rank anyway.

    Returns {"label": "modelled", "fits", "device_bytes", "peak_bytes" (tensors), "reserved_bytes" (with headroom),
    "stages": [first, last] each {"stage", "layers", "params", "states" (the sharded model states kept between
    steps), "memory": {"params", "grads", "optimizer", "activations"} (at the peak), "total"}, "collectives" (what
    one rank issues in a step, per group: `collectives`), "micro_batches", "terms" (seconds per step, each term apart), "compute_s",
    "bubble_s", "comm_s": {"tp", "cp", "pp", "dp", "ep"}, "step_s", "mfu", "hfu", "tflops_per_gpu",
    "tokens_per_s", "spans_nodes", "warnings", "assumes"}. Raises ValueError on a plan that cannot be laid out."""
    s = shape_of(model)
    _check(s, gpus, dp, tp, pp, cp, ep, seq, micro_batch, zero, recompute, system, schedule, virtual_stages,
           attention)
    if sp_saves not in SP_SAVES:
        raise ValueError(f"sp_saves must be one of {SP_SAVES}, got {sp_saves!r}")
    if norm_kernel not in NORM_KERNELS:
        raise ValueError(f"norm_kernel must be one of {NORM_KERNELS}, got {norm_kernel!r}")
    sequence_parallel = tp > 1 if sequence_parallel is None else sequence_parallel
    global_batch = dp * pp * micro_batch if global_batch is None else global_batch
    _whole(global_batch, "global_batch")
    if global_batch % (dp * micro_batch):
        raise ValueError(f"global_batch={global_batch} must split into micro-batches of {micro_batch} over "
                         f"dp={dp} replicas (a multiple of {dp * micro_batch})")
    m = global_batch // (dp * micro_batch)
    least = {"interleaved": pp, "dualpipev": 2 * pp}.get(schedule, 1)
    if m < least:
        raise ValueError(f"schedule={schedule!r} needs at least {least} micro-batches a step for pp={pp}, got {m} "
                         f"(global_batch / (dp x micro_batch)): a larger global batch or a smaller micro-batch")
    chunks = {"interleaved": virtual_stages, "dualpipev": 2}.get(schedule, 1)
    spec = costs.SYSTEMS[system]
    device = spec["device"]
    if device not in SUSTAINED:
        raise ValueError(f"no sustained rates for {device!r}: add it to planner.SUSTAINED with their source")
    rate = SUSTAINED[device]
    node, experts = spec["node_size"], s.get("experts", 0)
    p = shape_params(s)
    d, L, b = s["d_model"], s["layers"], micro_batch
    tokens = seq // cp * b  # of one micro-batch on this rank
    span = {"tp": tp > node, "cp": tp * cp > node, "pp": pp > 1 and tp * cp >= node,
            "dp": dp > 1 and gpus > node, "ep": ep > 1 and tp * ep > node}
    warnings = []
    if span["tp"]:
        warnings.append(f"tp={tp} spans nodes of {node}: its collectives, on every layer, ride the slower link")
    if pp > 1 and m < pp:
        warnings.append(f"{m} micro-batch(es) for {pp} stages: the pipeline never fills")
    if zero >= 2 and m > 1:
        warnings.append(f"ZeRO-{zero} with {m} micro-batches a step reduce-scatters the gradients every micro-batch "
                        "(no whole gradient is kept between them)"
                        + (" and all-gathers the weights every micro-batch" if zero == 3 else "")
                        + (": DeepSpeed refuses it under a pipeline, Megatron-LM pairs pipelines with ZeRO-1"
                           if pp > 1 else ""))

    if recipe is None:
        state_bytes, act_scale = {"param": BYTES["param"], "grad": grad_bytes, "optimizer": BYTES["optimizer"]}, 1
    else:
        r = costs.recipe_bytes_per_param(recipe, "adam")
        state_bytes = {"param": r["parameters"], "grad": r["gradients"],
                       "optimizer": r["master weights"] + r["optimizer states"]}
        act_scale = 2 if recipe in ("fp32", "autocast") else 1
    grad_bytes = state_bytes["grad"]

    # --- memory, first and last stage
    per_stage = [L // pp + (1 if i < L % pp else 0) for i in range(pp)] if stage_layers is None else list(stage_layers)
    if len(per_stage) != pp or sum(per_stage) != L or not all(isinstance(n, int) and n >= 1 for n in per_stage):
        raise ValueError(f"stage_layers={stage_layers!r}: give the pp={pp} stages' layers, at least 1 each, adding up "
                         f"to the model's {L}")
    element = 2 * act_scale  # bytes of an activation's element
    per_layer_act = activation_bytes_per_token(s, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute,
                                               attention=attention, seq=seq, dropout=dropout, sp_saves=sp_saves,
                                               norm_kernel=norm_kernel, element_bytes=element) * tokens
    if experts:  # each token's activations inside the MLP exist top_k times
        mlp_share = 4 * 2 * s["ffn"] / tp
        per_layer_act += (s["top_k"] - 1) * mlp_share * tokens * (recompute != "full")
    groups = sum(n > 1 for n in (tp, cp, pp, dp, ep))
    stages = []
    head_rank = 0 if schedule == "dualpipev" else pp - 1  # DualPipeV's V: rank 0 holds the first and last chunk
    vocab_split = tp if vocab_parallel else 1  # Megatron splits the embedding and the head over tp
    layer_held = p["layer_split"] / tp + p["layer_whole"]
    for name, index in (("first", 0), ("last", pp - 1)):
        layers = per_stage[index]
        dense = layers * layer_held + (
            (p["embedding"] / vocab_split + p["positions"]) if index == 0 else 0) + (
            (p["head"] / vocab_split + p["final_norm"]) if index == head_rank else 0)
        expert = layers * p["layer_experts"] / (tp * ep)
        states = {}
        for part, nbytes in (("params", state_bytes["param"]), ("grads", state_bytes["grad"]),
                             ("optimizer", state_bytes["optimizer"])):
            kw = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0,
                  {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes"}[part]: nbytes}
            states[part] = (costs.zero_memory_bytes(dense, dp * cp, zero, **kw)
                            + costs.zero_memory_bytes(expert, dp * cp // ep, zero, **kw))
        sharded = dict(states)  # what the rank keeps between steps (a dry run's model states)
        if zero == 3:  # the layer in use and the next one, gathered whole
            states["params"] += 2 * state_bytes["param"] * (layer_held + p["layer_experts"] / (tp * ep))
        sched = {"1f1b": "1F1B", "zero-bubble": "1F1B", "interleaved": "Interleaved1F1B",
                 "dualpipev": "DualPipeV"}[schedule]
        in_flight = costs.pipeline_peak_activations(pp, m, chunks, index, sched) if pp > 1 else 1
        activations = in_flight * layers / chunks * per_layer_act
        if index == head_rank:
            activations += tokens * _head_activation_bytes(s, tp=tp, sequence_parallel=sequence_parallel,
                                                           sp_saves=sp_saves, norm_kernel=norm_kernel,
                                                           element_bytes=element, vocab_parallel=vocab_parallel,
                                                           loss_parallel=loss_parallel)
        memory = {**states, "activations": activations}
        stages.append({"stage": name, "layers": layers, "params": dense + expert, "root_params": dense - layers *
                       layer_held, "states": sharded,
                       "memory": memory, "total": sum(memory.values())})
    for st, index in zip(stages, (0, pp - 1)):
        st["collectives"] = collectives(s, st, p, index=index, pp=pp, dp=dp * cp, tp=tp, m=m, chunks=chunks,
                                        zero=zero, recompute=recompute, sequence_parallel=sequence_parallel,
                                        act_bytes=element * tokens * d, state_bytes=state_bytes,
                                        layer_held=layer_held, head=index == head_rank, tokens=tokens,
                                        vocab_parallel=vocab_parallel, loss_parallel=loss_parallel,
                                        sp_saves=sp_saves)
    if pp == 1:
        stages = stages[:1]
    peak = max(st["total"] for st in stages)
    reserved = peak * (1 + FRAGMENTATION) + CUDA_CONTEXT_BYTES + groups * NCCL_BYTES_PER_GROUP

    # --- one micro-batch (forward + backward) on each stage; the slowest sets the pipeline's pace
    passes = 3 + (recompute == "full")  # forward, backward (2x), and the forward again under full recomputation
    kv_width = s["kv_heads"] * (d // s["heads"])
    act_bytes = element * tokens * d  # one micro-batch's hidden states on this rank's sequence
    tp_calls = (4 if sequence_parallel else 2) * (2 + (recompute == "full"))  # per layer: fwd, bwd, recomputed
    tp_kind = "all_gather" if sequence_parallel else "all_reduce"  # all-gathers and reduce-scatters cost the same
    forward_bytes = (_ELEMENTWISE_FORWARD["per_d_model"] * d
                     + _ELEMENTWISE_FORWARD["per_ffn"] * s["ffn"] * (s.get("top_k") or 1))
    ew = forward_bytes * passes * tokens / (tp if sequence_parallel else 1)  # forward, backward (2x), recomputed
    if attention == "unfused":  # softmax and dropout read and write a x s scores: 9 bytes fwd, 11 bwd per score
        ew += s["heads"] / tp * seq * tokens * (20 + 9 * (recompute == "full"))
    attention_flops = 4 * d / tp * (seq + 1) / 2 * tokens * 3.5  # causal; forward 1 + flash backward 2.5
    attention_flops += attention_flops / 3.5 * (recompute == "full")
    per_layer = {
        "matmul": 2 * passes * p["layer_active"] / tp * tokens / (rate["matmul"] * KERNEL_EFFICIENCY),
        "attention": attention_flops / ((rate["attention"] if attention == "flash" else rate["matmul"])
                                        * KERNEL_EFFICIENCY),
        "memory-bound": ew / rate["hbm"],
        "tp comm": tp_calls * _time(tp_kind, act_bytes, tp, system, span["tp"]),
        "cp comm": 2 * _time("all_gather", 2 * 2 * seq * b * kv_width / tp, cp, system, span["cp"]),
        "ep comm": 4 * _time("all_to_all", act_bytes / tp * s.get("top_k", 0), ep, system, span["ep"]),
    }
    head = 2 * 3 * p["head"] / vocab_split * tokens / (rate["matmul"] * KERNEL_EFFICIENCY)  # the last stage's output layer

    def stage_parts(index):
        parts = {name: v * per_stage[index] for name, v in per_layer.items()}
        parts["output head"] = head if index == head_rank else 0.0
        return parts

    slowest = max(range(pp), key=lambda i: sum(stage_parts(i).values()))
    t_mb = sum(stage_parts(slowest).values())
    send = _time("send_recv", act_bytes / tp, 2, system, span["pp"])  # sequence-parallel or scatter-gather
    pp_comm = 2 * m * chunks * send if pp > 1 else 0.0

    # --- data parallelism: the gradients of the slowest stage's parameters
    held = max(st["params"] for st in stages)
    shard = dp * cp
    reduce_grads = _time("reduce_scatter" if zero else "all_reduce", grad_bytes * held, shard, system, span["dp"])
    gather_params = _time("all_gather", state_bytes["param"] * held, shard, system, span["dp"]) if zero else 0.0
    if zero >= 2 and m > 1:  # every micro-batch, hidden behind its own compute where it fits
        per_mb = reduce_grads + (2 * gather_params if zero == 3 else 0.0)
        dp_comm = m * max(0.0, per_mb - t_mb) + gather_params * (zero == 2)
    else:  # once a step, behind the last micro-batch's backward
        dp_comm = max(0.0, reduce_grads - t_mb * costs.BACKWARD_FRACTION) + gather_params
    optimizer = held / (shard if zero else 1) * (2 * state_bytes["optimizer"] + grad_bytes + state_bytes["param"]) / (
        rate["hbm"])

    terms = {name: m * v for name, v in stage_parts(slowest).items()}
    terms.update({"pipeline bubble": bubble_slots(schedule, pp, virtual_stages) * t_mb, "pp comm": pp_comm,
                  "dp comm (exposed)": dp_comm, "optimizer step": optimizer})
    step = sum(terms.values())

    peak_flops = costs.peak_flops(device, dtype)
    tokens_step = seq * global_batch
    model_flops = costs.model_flops_per_token(p["matmul"], L, d, seq) * tokens_step / gpus
    hardware_flops = costs.hardware_flops_per_token(p["matmul"], L, d, seq, recompute=recompute) * tokens_step / gpus
    comm = {"tp": terms["tp comm"], "cp": terms["cp comm"], "pp": pp_comm, "dp": dp_comm, "ep": terms["ep comm"]}
    compute = step - terms["pipeline bubble"] - sum(comm.values())
    return {"label": "modelled", "model": model if isinstance(model, str) else "custom", "gpus": gpus,
            "layout": {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}, "seq": seq, "global_batch": global_batch,
            "micro_batch": micro_batch, "micro_batches": m, "zero": zero, "recompute": recompute, "system": system,
            "schedule": schedule, "virtual_stages": virtual_stages, "sequence_parallel": sequence_parallel,
            "sp_saves": sp_saves, "norm_kernel": norm_kernel, "loss_parallel": loss_parallel,
            "attention": attention, "device": device, "device_bytes": device_bytes, "params": p["total"],
            "stages": stages, "peak_bytes": peak, "reserved_bytes": reserved, "fits": reserved <= device_bytes,
            "terms": terms, "compute_s": compute, "bubble_s": terms["pipeline bubble"], "comm_s": comm,
            "step_s": step, "mfu": model_flops / peak_flops / step, "hfu": hardware_flops / peak_flops / step,
            "tflops_per_gpu": model_flops / step / 1e12, "tokens_per_s": tokens_step / step,
            "spans_nodes": span, "warnings": warnings,
            "assumes": f"an estimate: matmuls at {device}'s sustained rate ({rate['matmul'] / 1e12:.0f} TFLOP/s "
                       f"measured, the {dtype} peak is {peak_flops / 1e12:.0f}), flash attention at "
                       f"{rate['attention'] / 1e12:.0f}; {schedule}"
                       + (f" with {virtual_stages} chunks a rank" if schedule == "interleaved" else "")
                       + f"; ring alpha-beta on nominal links ({spec['inside']} inside a node of {node}, "
                       f"{spec['between']} between); TP/CP/EP/PP communication not overlapped, the gradient "
                       "reduction hidden behind the last micro-batch's backward; headroom for the CUDA context, "
                       "NCCL and fragmentation"}


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
