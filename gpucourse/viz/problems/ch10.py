"""Chapter 10's problems: the bytes each context-parallel rank sends per attention layer, ring against Ulysses, and
Llama 3's all-gather with grouped-query attention (costs.context_parallel), the block size from which a ring hop hides
behind compute (costs.ring_overlap_block_tokens) on an H100 and in your run, and an audit of DeepSpeed-Ulysses'
constant communication."""
from __future__ import annotations

from ...models import costs, published
from .base import Problem

H100 = costs.SYSTEMS["h100-sxm"]["device"]
NDR = "InfiniBand NDR 400G"
LLAMA_128K = "Llama 3 405B, 128K, 16,384 GPUs (Grattafiori et al. 2024)"
LLAMA_PLAN = published.PUBLISHED[LLAMA_128K]["plan"]
ULYSSES = ("Jacobs et al., DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence "
           "Transformer Models, arXiv 2309.14509: the communication volume per device stays constant when the "
           "sequence length and the devices grow in proportion")
LLAMA_SHAPE = "Llama 3 405B's shape: Grattafiori et al. 2024, Table 3 (planner.SHAPES: 128 heads, 8 key/value heads)"


def _both(batch, seq, heads, head_dim, n):
    shard = costs.attention_shard_bytes(batch, seq, heads, head_dim, n)
    ring = costs.context_parallel_bytes("ring", shard, n)
    return {"ring": ring, "ring_MB": ring / 1e6,
            "ulysses": costs.context_parallel_bytes("ulysses", shard, n),
            "ring_backward": costs.context_parallel_bytes("ring", shard, n, backward=True),
            "shard_MB": shard / 1e6, "kv_MB": 2 * shard / 1e6, "hops": n - 1,
            "factor": costs.busbw_factor("all_to_all", n)}


def _ring(batch, seq, heads, head_dim, n):
    out = _both(batch, seq, heads, head_dim, n)
    return {**out, "answer": out["ring"]}


def _ulysses(batch, seq, heads, head_dim, n):
    out = _both(batch, seq, heads, head_dim, n)
    return {**out, "answer": out["ulysses"]}


def _llama_gather(run, seq, cp, heads, kv_heads, head_dim):
    q = costs.attention_shard_bytes(1, seq, heads, head_dim, cp)
    kv = costs.attention_shard_bytes(1, seq, kv_heads, head_dim, cp)
    return {"answer": costs.context_parallel_bytes("all_gather", q, cp, kv_shard_bytes=kv), "q_MB": q / 1e6,
            "kv_MB": kv / 1e6, "hops": cp - 1, "no_gqa": costs.context_parallel_bytes("all_gather", q, cp),
            "tokens": seq // cp}


def _hop_hides(heads, kv_heads, link):
    bandwidth = costs.INTERCONNECTS[link].bandwidth_bytes_per_s
    peak = costs.peak_flops(H100)
    return {"answer": costs.ring_overlap_block_tokens(peak, bandwidth, heads=heads, kv_heads=kv_heads),
            "no_gqa": costs.ring_overlap_block_tokens(peak, bandwidth), "peak_T": peak / 1e12,
            "bw_GBs": bandwidth / 1e9}


def _your_overlap(block_tokens, heads, kv_heads, head_dim, compute_ms, hop_ms, bytes_per_value):
    flops, moved = costs.ring_step_times(block_tokens, heads, head_dim, 1.0, 1.0, kv_heads=kv_heads,
                                         bytes_per_value=bytes_per_value)  # FLOPs and bytes of one step
    rate, bandwidth = flops / (compute_ms / 1e3), moved / (hop_ms / 1e3)
    bound = costs.ring_overlap_block_tokens(rate, bandwidth, heads=heads, kv_heads=kv_heads,
                                            bytes_per_value=bytes_per_value)
    return {"answer": bound, "gflops": rate / 1e9, "mbs": bandwidth / 1e6, "flops_M": flops / 1e6,
            "kib": moved / 1024, "ratio": hop_ms / compute_ms}


def _ulysses_constant(seq, n, grow):
    def sent(method, s, k):
        return costs.context_parallel_bytes(method, costs.attention_shard_bytes(1, s, 32, 128, k), k)
    small, large = sent("ulysses", seq, n), sent("ulysses", seq * grow, n * grow)
    return {"answer": large / small, "small_MB": small / 1e6, "large_MB": large / 1e6,
            "ring": sent("ring", seq * grow, n * grow) / sent("ring", seq, n), "big_seq": seq * grow,
            "big_n": n * grow}


PROBLEMS = [
    Problem(
        "10.ring-bytes",
        "Attention over a sequence of {seq:,} tokens split over {n} ranks ({heads} heads of {head_dim}, batch "
        "{batch}, bf16). In one layer's forward, how many MB does each rank send with ring attention?",
        inputs={"batch": 1, "seq": 32768, "heads": 32, "head_dim": 128, "n": 8}, work=_ring, unit="MB", scale=1e6,
        digits=1,
        hint="the ring passes this rank's K and V block (2 shards of seq/n tokens) on n - 1 times: every rank sees "
             "every other's K/V once.",
        traps={"ulysses": "That is Ulysses' all-to-alls, 4 (n-1)/n shards: the ring sends more.",
               "ring_backward": "That is the backward's, which sends the K/V again and their gradients home."},
        solution="a shard: {shard_MB:.2f} MB; K and V: {kv_MB:.2f} MB; x {hops} hops = {answer}."),
    Problem(
        "10.ulysses-bytes",
        "The same layer ({seq:,} tokens, {n} ranks, {heads} heads of {head_dim}, bf16) with DeepSpeed-Ulysses: how "
        "many MB does each rank send in the forward?",
        inputs={"batch": 1, "seq": 32768, "heads": 32, "head_dim": 128, "n": 8}, work=_ulysses, unit="MB", scale=1e6,
        digits=1,
        hint="four all-to-alls (q, k and v to split heads, the output back), each sending (n-1)/n of a shard.",
        traps={"ring": "That is the ring's (n-1) x K/V."},
        solution="4 x {factor:.3f} x {shard_MB:.2f} MB = {answer} (the ring: {ring_MB:.1f} MB)."),
    Problem(
        "10.llama3-gather",
        "{run}: context parallelism {cp} over {seq:,} tokens, K/V all-gathered, {heads} query heads and {kv_heads} "
        "key/value heads of {head_dim}, bf16, one sequence. How many MB does each rank send in one layer's forward?",
        inputs={"run": LLAMA_128K, "seq": LLAMA_PLAN["seq"], "cp": LLAMA_PLAN["cp"], "heads": 128, "kv_heads": 8,
                "head_dim": 128}, work=_llama_gather, unit="MB", scale=1e6, digits=1, level="combine",
        source=f"{published.PUBLISHED[LLAMA_128K]['source']}; {LLAMA_SHAPE}",
        hint="an all-gather sends (n-1) copies of this rank's K and V; with grouped-query attention they have "
             "kv_heads, not heads: 1/16 of q's size here.",
        traps={"no_gqa": "That gathered K/V with as many heads as q: Llama 3 has 8 key/value heads."},
        solution="{tokens:,} tokens a rank; q shard {q_MB:.1f} MB, a K (or V) shard {kv_MB:.2f} MB; {hops} x 2 x "
                 "{kv_MB:.2f} MB = {answer}."),
    Problem(
        "10.hop-hides",
        "Ring attention on H100 SXM GPUs at their dense bf16 peak, hops over {link}, {heads} query heads and "
        "{kv_heads} K/V heads: from how many tokens per rank does a block's compute hide its K/V hop?",
        inputs={"heads": 128, "kv_heads": 8, "link": NDR}, work=_hop_hides, unit="tokens", digits=0,
        level="combine", source=f"{costs.PEAK_DENSE_TFLOPS[H100].source}; {costs.INTERCONNECTS[NDR].source}",
        hint="compute grows as c^2, the transfer as c: c >= (h_kv / h) x bytes x F / (2 B); grouped-query "
             "attention divides the bound by heads / kv_heads.",
        traps={"no_gqa": "That is the bound with K/V as wide as q: GQA sends 16 times fewer bytes a FLOP."},
        solution="(h_kv / h) x 2 bytes x {peak_T:.1f} TFLOP/s / (2 x {bw_GBs:.0f} GB/s) = {answer} (without GQA: "
                 "{no_gqa:,.0f})."),
    Problem(
        "10.your-ring-overlap",
        "Your chapter 10 run timed one ring step at {block_tokens} tokens a rank ({heads} heads, {kv_heads} K/V "
        "heads of {head_dim}, {bytes_per_value}-byte values): block attention {compute_ms} ms, one K/V hop "
        "{hop_ms} ms. At these rates, from how many tokens a rank would the hop hide behind the compute?",
        inputs={"block_tokens": 128, "heads": 4, "kv_heads": 4, "head_dim": 64, "compute_ms": 0.5, "hop_ms": 2.0,
                "bytes_per_value": 4}, work=_your_overlap,
        own=("block_tokens", "heads", "kv_heads", "head_dim", "bytes_per_value", "compute_ms", "hop_ms"),
        unit="tokens", digits=0, level="your run",
        hint="turn your two times into rates (FLOP/s from 4 h c^2 d FLOPs, bytes/s from 2 h_kv c d values), then "
             "c* = (h_kv/h) x bytes x F / (2 B); equivalently c x hop / compute, since compute grows as c^2.",
        traps={"ratio": "That is the hop's time over the compute's, not a block size."},
        solution="{flops_M:.1f} MFLOP in {compute_ms} ms = {gflops:.2f} GFLOP/s; {kib:.0f} KiB in {hop_ms} ms = "
                 "{mbs:.1f} MB/s; c* = {answer}."),
    Problem(
        "10.audit-ulysses-constant",
        "Audit: DeepSpeed-Ulysses' paper says its communication per device stays constant when the sequence and the "
        "devices grow together. From {seq:,} tokens on {n} ranks to {grow} x both (32 heads of 128, bf16): by what "
        "factor do Ulysses' bytes per rank change?",
        inputs={"seq": 65536, "n": 8, "grow": 2}, work=_ulysses_constant, unit="x", digits=3, level="audit",
        source=ULYSSES,
        hint="the shard (seq/n tokens) stays the same size, and each all-to-all sends (n-1)/n of it: only that "
             "factor moves.",
        traps={"ring": "That is the ring's factor: its n - 1 hops grow with n while the block stays the same."},
        solution="{seq:,} on {n}: {small_MB:.1f} MB; {big_seq:,} on {big_n}: {large_MB:.1f} MB; x {answer}, nearly "
                 "constant as the paper says (the ring: x {ring:.2f})."),
]
