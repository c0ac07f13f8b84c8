"""Mixture of experts and expert parallelism (chapter 11): capacity, all-to-all bytes, parameters and FLOPs of a
layer, and its all-to-alls hidden by chunks."""
import math

from ._checks import check_nonneg, require


# --- mixture of experts and expert parallelism (chapter 11) -------------------------------------------------

def moe_capacity(tokens, top_k, num_experts, capacity_factor):
    """Expert capacity: the most (token, choice) assignments one expert accepts from one rank's `tokens`.

    Switch Transformer (Fedus et al. 2021): tokens / experts x capacity factor, with top-k routing k assignments
    per token. Rounded up; a factor of 1.0 leaves no room for any imbalance, 1.25 is the paper's usual choice.
    """
    for value, name in ((tokens, "tokens"), (top_k, "top_k"), (num_experts, "num_experts")):
        require(isinstance(value, int) and value >= 1, f"{name} must be a whole number >= 1, got {value!r}")
    require(top_k <= num_experts, f"top_k={top_k} cannot exceed num_experts={num_experts}")
    require(capacity_factor > 0, f"capacity_factor must be > 0, got {capacity_factor}")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def expert_parallel_all_to_all_bytes(tokens, top_k, hidden, n, bytes_per_value=2, kept_fraction=1.0):
    """Bytes one rank sends to the OTHER ranks in one all-to-all of an expert-parallel MoE layer, routing uniform.

    A rank's tokens x top_k assignments, of which `kept_fraction` survive the capacity, each a row of `hidden`
    values; with experts spread evenly over `n` ranks and routing uniform, (n-1)/n of the rows go to other ranks
    (the rest stay on this rank). The dispatch's buffer is tokens x top_k x kept_fraction x hidden x bytes; the
    combine sends the same back, and backward repeats both: 4 such all-to-alls per layer per step. Skewed
    routing moves a different amount per rank: count it (the chapter does).
    """
    for value, name in ((tokens, "tokens"), (top_k, "top_k"), (hidden, "hidden")):
        check_nonneg(value, name)
    require(isinstance(n, int) and n >= 1, f"n (number of ranks) must be a whole number >= 1, got {n!r}")
    require(bytes_per_value > 0, f"bytes_per_value must be > 0, got {bytes_per_value}")
    require(0 <= kept_fraction <= 1, f"kept_fraction must be between 0 and 1, got {kept_fraction}")
    return tokens * top_k * kept_fraction * hidden * bytes_per_value * (n - 1) / n


def moe_params(hidden, ffn, num_experts, top_k, *, shared=0):
    """{"total": ..., "active": ...} weight-matrix parameters of one MoE layer: a router (hidden x E) and
    E routed plus `shared` shared experts, each two matrices (hidden x ffn and ffn x hidden).

    "active" is what one token uses: the router, its top_k routed experts and every shared expert. Biases and
    normalisation are left out (a few per-row values, not matrix work). Fine-grained experts (DeepSeekMoE,
    arXiv 2401.06066) split each expert m ways (m x E experts of ffn / m, top m x k): total and active stay the
    same, only the number of ways to combine experts grows.
    """
    for value, name in ((hidden, "hidden"), (ffn, "ffn"), (num_experts, "num_experts"), (top_k, "top_k")):
        require(isinstance(value, int) and value >= 1, f"{name} must be a whole number >= 1, got {value!r}")
    require(isinstance(shared, int) and shared >= 0, f"shared must be a whole number >= 0, got {shared!r}")
    require(top_k <= num_experts, f"top_k={top_k} cannot exceed num_experts={num_experts}")
    expert, router = 2 * hidden * ffn, hidden * num_experts
    return {"total": router + (num_experts + shared) * expert, "active": router + (top_k + shared) * expert}


def moe_flops_per_token(hidden, ffn, num_experts, top_k, *, shared=0, training=True):
    """{"active": ..., "total": ...} matrix FLOPs per token of one MoE layer: 2 per weight in forward, 6 with
    backward (`training`), on the active parameters (what the token runs: the number MFU counts) and on all of
    them (what a dense layer of the same size would run). An MFU computed on total parameters overstates the
    work by total / active: for DeepSeek-V3, about 671 B / 37 B (arXiv 2412.19437).
    """
    params = moe_params(hidden, ffn, num_experts, top_k, shared=shared)
    per_weight = 6 if training else 2
    return {kind: per_weight * n for kind, n in params.items()}


def moe_overlap_time(compute_s, all_to_all_s, chunks=1):
    """One MoE layer's forward with its tokens cut into `chunks` pieces that pipeline on two streams, one
    communicating and one computing: {"time", "exposed_s", "hidden"}.

    compute_s: the experts' time for the whole batch; all_to_all_s: one all-to-all (dispatch) of the whole batch,
    and the combine takes as long. Chunk j is dispatched (D_j), computed (X_j), combined (C_j); the
    communication stream runs D_1, D_2, C_1, D_3, C_2, ..., D_m, C_(m-1), C_m (the next dispatch before the
    previous combine), the compute stream X_1 ... X_m; an operation starts when its stream is free and its input
    is ready. exposed_s = time - compute_s. With one chunk nothing overlaps: 2 a + c. "hidden": more than one
    chunk and no communication exposed beyond the pipeline's fill and drain (the first dispatch and the last
    combine, 2 a / m). It holds whenever compute_s >= 2 x all_to_all_s: each chunk's compute then covers the
    next chunk's dispatch and the previous chunk's combine. Below that the communication stream falls behind
    once the pipeline is long enough (from 4 chunks at compute_s = 1.9 x all_to_all_s; 2 chunks are too short
    to show it).
    """
    check_nonneg(compute_s, "compute_s")
    check_nonneg(all_to_all_s, "all_to_all_s")
    require(isinstance(chunks, int) and chunks >= 1, f"chunks must be a whole number >= 1, got {chunks!r}")
    a, c = all_to_all_s / chunks, compute_s / chunks
    comm_free = compute_free = 0.0
    dispatched, computed, combined = [0.0] * chunks, [0.0] * chunks, [0.0] * chunks
    order = [("D", 0)] + [op for j in range(1, chunks) for op in (("D", j), ("C", j - 1))] + [("C", chunks - 1)]
    for kind, j in order:
        if kind == "D":
            comm_free = dispatched[j] = comm_free + a
        else:
            for i in range(j + 1):  # the compute stream runs every chunk that is ready, in order
                if not computed[i]:
                    compute_free = computed[i] = max(compute_free, dispatched[i]) + c
            comm_free = combined[j] = max(comm_free, computed[j]) + a
    time = combined[-1]
    exposed = time - compute_s
    return {"time": time, "exposed_s": exposed, "hidden": chunks > 1 and exposed <= 2 * a * (1 + 1e-9)}
