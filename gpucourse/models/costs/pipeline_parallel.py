"""Pipeline parallelism (chapter 05): the bubble of a schedule, a schedule's actions replayed with fixed durations,
DualPipeV's bubble, the activations a rank holds at once, and what each stage of a GPT costs."""
import re

from ._checks import check_nonneg, require


# --- pipeline parallelism (chapter 05) ----------------------------------------------------------------------

def pipeline_bubble_fraction(p, m, v=1):
    """Idle fraction of the step of a GPipe/1F1B schedule: (p-1)/(m+p-1); interleaved, (p-1)/(v*m+p-1).

    p stages, m micro-batches: p-1 slots to fill and drain the pipe out of
    m+p-1 in total. More micro-batches shrink the bubble. With v stages per
    rank (interleaved 1F1B, Narayanan et al. 2021) each slot is 1/v as long,
    so the p-1 fill and drain slots cost (p-1)/v of a micro-batch's time.
    """
    require(p >= 1, f"p (pipeline stages) must be >= 1, got {p}")
    require(m >= 1, f"m (micro-batches) must be >= 1, got {m}")
    require(v >= 1, f"v (stages per rank) must be >= 1, got {v}")
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_ratio(p, m, v=1):
    """Bubble time over the ideal (bubble-free) step: (p-1)/m; interleaved, (p-1)/(v*m).

    The same bubble as pipeline_bubble_fraction, measured against the work
    instead of the whole step, as Narayanan et al. 2021 write it. For p = 4,
    m = 4: 3/7 of the step is idle, which is 3/4 on top of the ideal step.
    """
    require(p >= 1, f"p (pipeline stages) must be >= 1, got {p}")
    require(m >= 1, f"m (micro-batches) must be >= 1, got {m}")
    require(v >= 1, f"v (stages per rank) must be >= 1, got {v}")
    return (p - 1) / (v * m)


_PIPE_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")


def simulate_pipeline(orders, durations):
    """Replay each rank's pipeline actions in their order, with fixed durations and free communication.

    orders: {rank: ["0F0", "0F1", "0B0", ...]}: <stage><kind><micro-batch>, kind F (forward), B (full
    backward), I (backward to the input only) or W (backward to the weights). durations: {kind: seconds}
    (an action's own name, e.g. "1F0", takes precedence over its kind).
    An action starts when its rank is free and what it needs is done: F on stage s after F on s-1; B or I
    on stage s after F on s and B or I on s+1 (the last stage's after its own F); W after I. This is the
    time the schedule itself costs, without a real machine's overheads: compare a measured timeline with it.
    An entry may also be a tuple of actions, e.g. ("0F3", "3B1"): one overlapped block (DualPipe's F&B), which
    starts when all of them can, lasts durations["F&B"] if given or else the sum of theirs, and whose results
    are all ready at its end.
    Returns {rank: [(action, start, end)]}, a block's actions with the block's start and end; raises
    ValueError on an order that can never finish.
    """
    parsed, seconds = {}, {}
    for rank, actions in orders.items():
        parsed[rank] = []
        for entry in actions:
            block = []
            for action in (entry if isinstance(entry, (tuple, list)) else (entry,)):
                match = _PIPE_ACTION.fullmatch(str(action))
                require(match, f"action {action!r} of rank {rank}: expected <stage><F|B|I|W><micro-batch>, e.g. '0F1'")
                require(action in durations or match[2] in durations,
                         f"durations has no time for kind {match[2]!r} (action {action})")
                block.append((int(match[1]), match[2], int(match[3])))
                seconds[block[-1]] = durations.get(action, durations.get(match[2]))
            require(block, f"rank {rank} has an empty block of actions")
            parsed[rank].append(tuple(block))
    last = max(s for acts in parsed.values() for block in acts for s, _, _ in block)
    done, free, out, head = {}, dict.fromkeys(parsed, 0.0), {r: [] for r in parsed}, dict.fromkeys(parsed, 0)

    def ready_at(stage, kind, mb):
        """When everything (stage, kind, mb) needs is done, or None if something is not done yet."""
        if kind == "F":
            needed = [(stage - 1, "F", mb)] if stage > 0 else []
        elif kind == "W":
            needed = [(stage, "I", mb)]
        else:  # B or I: the stage's own forward, and the output's gradient from the next stage (B or I there)
            needed = [(stage, "F", mb)]
            if stage < last:
                grad = [d for d in ((stage + 1, "B", mb), (stage + 1, "I", mb)) if d in done]
                needed.append(grad[0] if grad else (stage + 1, "B or I", mb))
        return max((done[d] for d in needed), default=0.0) if all(d in done for d in needed) else None

    while any(head[r] < len(parsed[r]) for r in parsed):
        progressed = False
        for rank, acts in parsed.items():
            while head[rank] < len(acts) and None not in (ats := [ready_at(*a) for a in acts[head[rank]]]):
                block = acts[head[rank]]
                start = max([free[rank], *ats])
                length = (durations.get("F&B", sum(seconds[a] for a in block)) if len(block) > 1
                          else seconds[block[0]])
                free[rank] = start + length
                for a in block:
                    done[a] = free[rank]
                    out[rank].append((f"{a[0]}{a[1]}{a[2]}", start, free[rank]))
                head[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: "+".join("".join(map(str, a)) for a in parsed[r][head[r]])
                     for r in parsed if head[r] < len(parsed[r])}
            raise ValueError(f"these orders can never finish: each rank waits on another ({stuck}); "
                             "check the actions and that every stage's forward comes before its backward")
    return out


def pipeline_order_from_torch(order, blocks=True):
    """A rank's plan in torch.distributed.pipelining's notation as simulate_pipeline takes it.

    order: e.g. ["0F0", "(0F3;3B1)OVERLAP_F_B", "0REDUCE_GRAD"] (str of torch's _Action). Compute actions are kept;
    an overlapped pair becomes a tuple (one block) or, with blocks=False, its actions one after the other; the
    rest (communication, REDUCE_GRAD, ...) is left out.
    """
    out = []
    for action in order:
        if str(action).endswith("OVERLAP_F_B"):
            pair = tuple(re.findall(r"\d+[FBIW]\d+", str(action)))
            require(len(pair) >= 2, f"{action!r}: an OVERLAP_F_B with fewer than two compute actions")
            out.extend([pair] if blocks else pair)
        elif _PIPE_ACTION.fullmatch(str(action)):
            out.append(str(action))
    return out


def dualpipev_bubble(ranks, forward, backward, weight, overlapped=None):
    """Idle time per rank of DualPipeV on `ranks` ranks (2 * ranks stages): (ranks - 1)(F&B + B - 3W).

    DeepSeek-V3 (arXiv 2412.19437, Table 2) gives DualPipe's bubble as (PP/2 - 1)(F&B + B - 3W), F a forward
    chunk, B a full backward chunk, W its weight part, F&B a forward and a backward chunk run overlapped; 1F1B's
    is (PP - 1)(F + B). DualPipeV folds the same schedule into a V: 2 * ranks stages, two per rank, so PP/2 - 1 =
    ranks - 1. overlapped (F&B) defaults to forward + backward: the pair run one after the other, as torch's
    ScheduleDualPipeV does unless a custom overlap function is registered. With F = I = W (B = 2F), replaying
    torch 2.13's DualPipeV order with each overlapped pair as one block (simulate_pipeline) gives exactly this.
    """
    require(ranks >= 1, f"ranks must be >= 1, got {ranks}")
    for value, name in ((forward, "forward"), (backward, "backward"), (weight, "weight")):
        check_nonneg(value, name)
    require(weight <= backward, f"weight ({weight}) is part of the full backward and cannot exceed it ({backward})")
    both = forward + backward if overlapped is None else overlapped
    check_nonneg(both, "overlapped")
    return (ranks - 1) * (both + backward - 3 * weight)


def pipeline_peak_activations(p, m, v=1, rank=0, schedule="1F1B"):
    """Most chunks whose activations one rank holds at once (a chunk: one micro-batch through one of its stages).

    "GPipe" (v = 1): m, every forward before any backward. "1F1B" (v = 1): min(p - rank, m), the warm-up forwards
    plus the one before the first backward.
    "Interleaved1F1B" (v >= 2 stages per rank), as torch 2.13 and Megatron-LM order it: (v - 1) * k + 2(p - 1 -
    rank) warm-up forwards plus one, at most all m * v chunks, where k = m / max(1, m // p) micro-batches per
    round (k = p when p divides m). On rank 0 with p | m that is v*p + p - 1 chunks of 1/v of the rank's layers:
    p * (1 + (p - 1) / (p * v)) micro-batches' worth, Korthikanti et al. 2022's factor over 1F1B's p.
    "DualPipeV" (2 stages per rank): 2p + 1 chunks on every rank, DeepSeek-V3's PP + 1 with PP = 2p stages.
    """
    require(p >= 1, f"p (pipeline ranks) must be >= 1, got {p}")
    require(m >= 1, f"m (micro-batches) must be >= 1, got {m}")
    require(v >= 1, f"v (stages per rank) must be >= 1, got {v}")
    require(0 <= rank < p, f"rank must be in [0, {p}), got {rank}")
    if schedule in ("GPipe", "1F1B"):
        require(v == 1, f"{schedule} has one stage per rank: v must be 1, got {v}")
        return m if schedule == "GPipe" else min(p - rank, m)
    if schedule == "Interleaved1F1B":
        per_round = m // max(1, m // p)
        return min((v - 1) * per_round + 2 * (p - 1 - rank) + 1, m * v)
    if schedule == "DualPipeV":
        require(v == 2 and m >= 2 * p, f"DualPipeV needs v = 2 and m >= 2p micro-batches, got v={v}, m={m}, p={p}")
        return 2 * p + 1
    raise ValueError(f"schedule must be 'GPipe', '1F1B', 'Interleaved1F1B' or 'DualPipeV', got {schedule!r}")


def pipeline_stage_costs(layers_per_stage, d_model, vocab, seq_len):
    """Parameters and training FLOPs per token of each stage of a GPT cut into stages: the token and position
    embeddings on the first stage, the output head on the last.

    layers_per_stage: transformer blocks on each stage, e.g. [2, 2, 2, 2]. Parameters: the weights of every
    Linear and Embedding (12 d^2 per block; V d for the token table, T d for positions, V d for an untied head;
    biases and norms left out). FLOPs per token, forward + backward, as model_flops_per_token counts them: 6 per
    weight of a matrix product (an embedding lookup does none) plus 12 d T per block for attention (non-causal).
    The head alone costs 6 V d, as much as V / (12 d) blocks' matrix products: a pipeline runs at the pace of its
    slowest stage, so an even cut of the blocks leaves the last stage (and, in memory, the first) the heaviest.
    Returns [{"stage", "layers", "params", "flops_per_token"}].
    """
    require(len(layers_per_stage) >= 1 and all(n >= 0 for n in layers_per_stage),
             f"layers_per_stage must be a non-empty list of counts >= 0, got {layers_per_stage}")
    require(d_model >= 1 and vocab >= 1 and seq_len >= 1,
             f"d_model, vocab and seq_len must be >= 1, got {d_model}, {vocab}, {seq_len}")
    out = []
    for s, layers in enumerate(layers_per_stage):
        matmul = 12 * d_model ** 2 * layers + (vocab * d_model if s == len(layers_per_stage) - 1 else 0)
        tables = (vocab + seq_len) * d_model if s == 0 else 0
        out.append({"stage": s, "layers": layers, "params": matmul + tables,
                    "flops_per_token": 6 * matmul + 12 * layers * d_model * seq_len})
    return out
