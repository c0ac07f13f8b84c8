"""Chapter 11's problems: expert capacity (costs.moe_capacity), the bytes and time of expert parallelism's
all-to-alls (costs.expert_parallel), hiding them by chunks (costs.moe_overlap_time), your run's bytes with the drops it
counted, and an audit of Mixtral 8x7B's 47 B total and 13 B active parameters (planner.shape_params)."""
from __future__ import annotations

from ...models import costs, planner
from .base import Problem

NDR = "InfiniBand NDR 400G"
MIXTRAL = ("Jiang et al., Mixtral of Experts, arXiv 2401.04088, abstract: 47 B parameters, 13 B active a token; "
           "its shape (32 layers, d_model 4,096, 8 experts of 14,336, top-2, 8 key/value heads) in planner.SHAPES")


def _capacity(tokens, top_k, experts, factor):
    return {"answer": costs.moe_capacity(tokens, top_k, experts, factor), "top1": costs.moe_capacity(tokens, 1,
            experts, factor), "even": tokens * top_k / experts, "no_factor": costs.moe_capacity(tokens, top_k,
            experts, 1.0)}


def _a2a_bytes(tokens, top_k, hidden, n):
    sent = costs.expert_parallel_all_to_all_bytes(tokens, top_k, hidden, n)
    return {"answer": sent, "buffer": tokens * top_k * hidden * 2, "share": (n - 1) / n}


def _a2a_time(tokens, top_k, hidden, n, link, layers):
    ic = costs.INTERCONNECTS[link]
    buffer = tokens * top_k * hidden * 2
    one = costs.collective_time("all_to_all", buffer, n, ic.alpha, ic.beta)
    return {"answer": 4 * layers * one, "one_ms": one * 1e3, "buffer_MB": buffer / 1e6, "calls": 4 * layers,
            "forward_only": 2 * layers * one}


def _overlap(compute_ms, a2a_ms, chunks):
    out = costs.moe_overlap_time(compute_ms / 1e3, a2a_ms / 1e3, chunks)
    one = costs.moe_overlap_time(compute_ms / 1e3, a2a_ms / 1e3, 1)
    return {"answer": out["time"], "exposed_ms": out["exposed_s"] * 1e3, "serial": one["time"],
            "serial_ms": one["time"] * 1e3, "perfect": compute_ms / 1e3}


def _your_bytes(tokens, top_k, hidden, n, dropped_pct):
    kept = 1 - dropped_pct / 100
    sent = costs.expert_parallel_all_to_all_bytes(tokens, top_k, hidden, n, bytes_per_value=4, kept_fraction=kept)
    return {"answer": sent, "kept": kept, "rows": tokens * top_k * kept,
            "all_kept": costs.expert_parallel_all_to_all_bytes(tokens, top_k, hidden, n, bytes_per_value=4)}


def _mixtral(model):
    p, shape = planner.shape_params(model), planner.shape_of(model)
    active = shape["layers"] * p["layer_active"] + p["embedding"] + p["head"]
    return {"answer": active, "total": p["total"], "layers": shape["layers"], "layer_active_M": p["layer_active"] / 1e6,
            "tables_B": (p["embedding"] + p["head"]) / 1e9, "experts_B": shape["layers"] * p["layer_experts"] / 1e9,
            "total_B": p["total"] / 1e9, "naive": 8 * 7e9 * shape["top_k"] / shape["experts"]}


PROBLEMS = [
    Problem(
        "11.capacity",
        "A rank routes {tokens:,} tokens, top-{top_k}, over {experts} experts, capacity factor {factor}. What is "
        "each expert's capacity (Switch Transformer's rule)?",
        inputs={"tokens": 4096, "top_k": 2, "experts": 64, "factor": 1.25}, work=_capacity, unit="assignments",
        digits=0, tolerance=0,
        hint="with top-k routing each token makes k assignments: capacity = ceil(factor x tokens x k / experts).",
        traps={"top1": "That counted one assignment a token: top-2 makes two.",
               "no_factor": "That is the even share without the capacity factor's room for imbalance."},
        solution="{tokens} x {top_k} / {experts} = {even:g} assignments an expert if routing were even; x {factor} "
                 "= {answer}."),
    Problem(
        "11.all-to-all-bytes",
        "Expert parallelism over {n} ranks: each routes {tokens:,} tokens top-{top_k}, hidden {hidden:,}, bf16, "
        "uniform routing, nothing dropped. How many MB does a rank send to other ranks in one dispatch?",
        inputs={"tokens": 4096, "top_k": 2, "hidden": 4096, "n": 8}, work=_a2a_bytes, unit="MB", scale=1e6, digits=1,
        hint="every (token, choice) is a row of hidden values; with the experts spread evenly, (n-1)/n of the rows "
             "leave the rank.",
        traps={"buffer": "That is the whole dispatch buffer: 1/n of its rows go to this rank's own experts."},
        solution="{tokens} x {top_k} rows x {hidden} x 2 bytes = {buffer:,} bytes; x {share:.3f} leave: {answer}."),
    Problem(
        "11.all-to-all-time",
        "The same layer ({tokens:,} tokens a rank, top-{top_k}, hidden {hidden:,}, bf16) with its {n} expert ranks "
        "on different nodes over {link}: how long do the all-to-alls of {layers} MoE layers take per step (forward "
        "and backward, nothing overlapped)?",
        inputs={"tokens": 4096, "top_k": 2, "hidden": 4096, "n": 8, "link": NDR, "layers": 32}, work=_a2a_time,
        unit="ms", scale=1e-3, digits=0, level="combine", source=costs.INTERCONNECTS[NDR].source,
        hint="four all-to-alls a layer a step (dispatch and combine, each again in backward); each one, by the ring "
             "model, n-1 messages and (n-1)/n of the buffer.",
        traps={"forward_only": "That is the forward's dispatch and combine: backward repeats both."},
        solution="one all-to-all of {buffer_MB:.1f} MB: {one_ms:.2f} ms; x {calls} = {answer}."),
    Problem(
        "11.overlap-chunks",
        "An MoE layer's experts take {compute_ms} ms for the whole batch, one all-to-all {a2a_ms} ms. Cut into "
        "{chunks} chunks pipelined on a communication and a compute stream, how long does the layer's forward "
        "take?",
        inputs={"compute_ms": 2.0, "a2a_ms": 0.8, "chunks": 4}, work=_overlap, unit="ms", scale=1e-3, digits=2,
        hint="with compute at least twice an all-to-all, every chunk's compute covers the next dispatch and the "
             "previous combine: only the first dispatch and the last combine, 2 a / chunks, stay exposed.",
        traps={"serial": "That is one chunk: dispatch, compute and combine one after the other.",
               "perfect": "That hid everything: the first dispatch and the last combine cannot hide."},
        solution="exposed: 2 x {a2a_ms} / {chunks} = {exposed_ms:.2f} ms; {compute_ms} + {exposed_ms:.2f} = "
                 "{answer} (one chunk: {serial_ms:.2f} ms)."),
    Problem(
        "11.your-kept-bytes",
        "Your chapter 11 run: {tokens} tokens a rank, top-{top_k}, hidden {hidden}, fp32, {n} ranks, and the "
        "learned router dropped {dropped_pct} % of the assignments. With uniform routing otherwise, how many KiB "
        "does a rank send in one dispatch?",
        inputs={"tokens": 64, "top_k": 2, "hidden": 32, "n": 4, "dropped_pct": 10.0},
        own=("tokens", "top_k", "hidden", "n", "dropped_pct"), work=_your_bytes, unit="KiB", scale=1024, digits=2,
        level="your run",
        hint="a dropped assignment sends no row: multiply the rows by the kept fraction, then (n-1)/n of them at "
             "hidden x 4 bytes leave the rank.",
        traps={"all_kept": "That sent every assignment: the dropped ones never leave."},
        solution="{rows:g} kept rows x {hidden} x 4 bytes x (n-1)/n = {answer}."),
    Problem(
        "11.audit-mixtral-active",
        "Audit: Mixtral's paper says each token uses 13 B of its 47 B parameters. By the course's count of "
        "{model}'s shape (attention, the router and top-2 of 8 experts a layer, embedding and head), how many "
        "billion parameters does a token use?",
        inputs={"model": "mixtral-8x7b"}, work=_mixtral, unit="B params", scale=1e9, digits=1, level="audit",
        source=MIXTRAL,
        hint="a token meets every layer's attention and router, 2 of its 8 experts (3 matrices of 4,096 x 14,336 "
             "each), and the embedding and head: not 2/8 of 8 x 7 B.",
        traps={"total": "That is every parameter, the 47 B: a token uses 2 experts of 8.",
               "naive": "That is 2/8 of \"8 x 7 B\": the experts share attention, and 7 B is not an expert's size."},
        solution="{layers} layers x {layer_active_M:.1f} M active + embedding and head {tables_B:.2f} B = {answer} "
                 "(all parameters: {total_B:.1f} B)."),
]
