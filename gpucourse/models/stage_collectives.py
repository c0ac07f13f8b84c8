"""What one rank of a pipeline stage issues in one training step, per process group (tp, dp, pp): the planner's
count of calls and bytes (gpucourse.models.planner puts it in plan["stages"][i]["collectives"]). A dry run counts
the same from a real step (gpucourse.dryrun); tests/integration/test_dryrun.py holds the two equal."""
from __future__ import annotations


def collectives(s, stage, p, *, index, pp, dp, tp, m, chunks, zero, recompute, sequence_parallel, act_bytes,
                state_bytes, layer_held, head=None, tokens=0, vocab_parallel=True, loss_parallel=True,
                sp_saves="sharded") -> list[dict]:
    """What one rank of a pipeline stage issues in one step, per process group: [{"group", "op", "calls",
    "bytes"}], bytes in nccl-tests' convention (the full buffer of an all-gather or reduce-scatter, the buffer of
    an all-reduce, the message of a send). A dry run counts the same (gpucourse.dryrun; the test holds them equal).

    tp, per layer and micro-batch: without sequence parallelism 2 all-reduces forward (after the row-parallel
    layers) and one backward per column-parallel input (1 + 1 when q, k, v and the MLP's input matrices are fused,
    as in Megatron-LM; 3 + 1 for separate q, k, v and a GELU MLP: shape "fused": False); with it, 2 all-gathers
    and 2 reduce-scatters each way, and under sp_saves "sharded" (Megatron-LM) 2 all-gathers more in the backward
    (the kept sharded inputs gathered again). Full recomputation repeats the forward's. Per micro-batch, a
    vocabulary-parallel embedding's partial output is reduce-scattered into sequence slices (all-reduced without
    sequence parallelism) and its gradient all-gathered back; the head's input is all-gathered (again in the
    backward under "sharded") and its gradient reduce-scattered (all-reduced without sequence parallelism); the
    loss either all-reduces three fp32 numbers a token (Megatron-LM's vocabulary-parallel cross-entropy: max,
    target logit, sum of exponentials) or all-gathers the whole logits (loss_parallel False). A whole embedding
    and head (vocab_parallel False) under sequence parallelism: the embedding's gradient and the head's input
    all-gathered, as DTensor does. Once a step, under sequence parallelism, the norms' weights' gradients (each tp
    rank's from its own slice of the sequence) are all-reduced: one call per norm tensor (torch's DTensor,
    "gathered") or all in one (Megatron-LM coalesces them, "sharded"). `head`: whether the stage holds the head
    (default: the last stage).
    dp (over dp x cp): ZeRO-3 as FSDP2 does it, one unit a layer and one for the rest (the root): an all-gather
    per unit forward, again per layer unit backward (the root stays gathered), a reduce-scatter per unit, every
    micro-batch; ZeRO-1/2 a reduce-scatter of the gradients (every micro-batch for ZeRO-2) and an all-gather of
    the weights; ZeRO-0 an all-reduce. pp: a send and a receive per micro-batch and chunk, each way the stage
    talks (1/tp of the activations under sequence parallelism)."""
    out, layers = [], stage["layers"]
    head = index == pp - 1 if head is None else head
    if tp > 1:
        recomputed = recompute == "full"
        again = 2 if sequence_parallel and sp_saves == "sharded" else 0  # Megatron-LM gathers its inputs again
        tp_ops = {}  # op: [calls, bytes]

        def issue(op, calls, size):
            row = tp_ops.setdefault(op, [0, 0])
            row[0] += calls
            row[1] += calls * size
        if sequence_parallel:
            issue("all_gather", m * layers * (2 * (2 + recomputed) + again), act_bytes)
            issue("reduce_scatter", m * layers * 2 * (2 + recomputed), act_bytes)
        else:
            backward = (1 if s.get("fused", True) else 3) + (1 if s.get("fused", True) or s["mlp_matrices"] == 2
                                                             else s["mlp_matrices"] - 1)
            issue("all_reduce", m * layers * (2 * (1 + recomputed) + backward), act_bytes)
        if index == 0 and vocab_parallel:  # the embedding's partial sums over the vocabulary's slices
            if sequence_parallel:
                issue("reduce_scatter", m, act_bytes)
                issue("all_gather", m, act_bytes)
            else:
                issue("all_reduce", m, act_bytes)
        elif index == 0 and sequence_parallel:  # a whole table: its output cut, the gradient gathered back
            issue("all_gather", m, act_bytes)
        if head:
            if sequence_parallel:
                issue("all_gather", m * (1 + again // 2), act_bytes)
                if vocab_parallel:
                    issue("reduce_scatter", m, act_bytes)
            elif vocab_parallel:
                issue("all_reduce", m, act_bytes)
            if vocab_parallel and loss_parallel:
                issue("all_reduce", 3 * m, 4 * tokens)
            elif vocab_parallel:
                issue("all_gather", m, act_bytes / s["d_model"] * s["vocab"])
        norm = {"rmsnorm": 1, "layernorm": 2}.get(s.get("norm"), 0)  # tensors a norm has (weight, bias)
        if sequence_parallel and norm:
            tensors = norm * (2 * layers + head)
            calls = tensors if sp_saves == "gathered" else 1
            issue("all_reduce", calls, state_bytes["grad"] * s["d_model"] * tensors / calls)
        out += [{"group": "tp", "op": op, "calls": calls, "bytes": size} for op, (calls, size) in tp_ops.items()]
    if dp > 1:
        held, grad, param = stage["params"], state_bytes["grad"], state_bytes["param"]
        if zero == 3:
            units = layers + (stage["root_params"] > 0)  # a layer's experts: gathered with their layer
            out += [{"group": "dp", "op": "all_gather", "calls": m * (units + layers),
                     "bytes": m * param * (held + layers * layer_held)},
                    {"group": "dp", "op": "reduce_scatter", "calls": m * units, "bytes": m * grad * held}]
        elif zero:
            every = m if zero == 2 else 1
            out += [{"group": "dp", "op": "reduce_scatter", "calls": every, "bytes": every * grad * held},
                    {"group": "dp", "op": "all_gather", "calls": 1, "bytes": param * held}]
        else:
            out.append({"group": "dp", "op": "all_reduce", "calls": 1, "bytes": grad * held})
    if pp > 1:
        message = act_bytes / tp if sequence_parallel else act_bytes
        ways = 1 if index in (0, pp - 1) else 2
        out += [{"group": "pp", "op": op, "calls": ways * m * chunks, "bytes": ways * m * chunks * message}
                for op in ("send", "recv")]
    return out
