"""Context parallelism (chapter 10): the bytes each rank sends per attention layer (all-gather, ring, Ulysses and
both), and when a ring hop hides behind a block's compute."""
from ._checks import check_nonneg, require
from .comms import bytes_moved_per_rank


# --- context parallelism: bytes each rank sends per attention layer (chapter 10) ----------------------------

CONTEXT_PARALLEL = ("all_gather", "ring", "ulysses")


def attention_shard_bytes(batch, seq, heads, head_dim, n, bytes_per_value=2):
    """Bytes of one rank's shard of q (or of k or v: pass their number of heads) with the sequence split over n
    ranks: batch × heads × seq/n × head_dim × bytes per value."""
    for value, name in ((batch, "batch"), (seq, "seq"), (heads, "heads"), (head_dim, "head_dim"), (n, "n")):
        require(isinstance(value, int) and value >= 1, f"{name} must be a whole number >= 1, got {value!r}")
    require(seq % n == 0, f"seq={seq} is not divisible by n={n}: every rank holds seq/n tokens")
    require(bytes_per_value > 0, f"bytes_per_value must be > 0, got {bytes_per_value}")
    return batch * heads * (seq // n) * head_dim * bytes_per_value


def context_parallel_bytes(method, shard_bytes, n, *, backward=False, kv_shard_bytes=None):
    """Bytes one rank sends for one attention layer's forward (or its backward) with the sequence split over n ranks.

    shard_bytes: this rank's q shard (batch × heads × seq/n × head_dim × bytes per value); kv_shard_bytes: its k
    (or v) shard, the same unless grouped-query attention gives K/V fewer heads than q (kv_heads / heads of it).
    K and V together are kv = 2 · kv_shard_bytes. What each way sends (chapter 10 counts the sends and checks these):
      all_gather  forward all-gather K and V ((n-1)/n of the whole K and V = (n-1)·kv); backward reduce-scatter
                  dK and dV (the same).
      ring        forward (n-1) hops of the local K/V block; backward the K/V blocks go round again ((n-1)·kv)
                  and their gradients dK/dV travel with them all the way home (n hops: n·kv). One rank: nothing.
      ulysses     forward all-to-all of q, k and v (sequence-split to head-split) and of the output back: 4
                  tensors, each sending (n-1)/n of itself; backward the same 4 (dO in, dq/dk/dv out). With
                  grouped-query attention k and v are the smaller ones.
    The per-rank volume of all_gather and ring does not shrink with n (each rank sees every other's K/V once);
    Ulysses' does, as (n-1)/n · 4 shards with shards of seq/n. That is bytes, not time: Ulysses' all-to-alls sit
    on the critical path (attention waits for them), an all-to-all across nodes runs at the inter-node links'
    speed, and n is capped by the number of (K/V) heads; the ring overlaps each hop with a block's compute.
    """
    require(method in CONTEXT_PARALLEL, f"unknown method {method!r}; valid: {', '.join(CONTEXT_PARALLEL)}")
    check_nonneg(shard_bytes, "shard_bytes")
    kv_shard_bytes = shard_bytes if kv_shard_bytes is None else kv_shard_bytes
    check_nonneg(kv_shard_bytes, "kv_shard_bytes")
    require(n >= 1, f"n (number of ranks) must be >= 1, got {n}")
    kv = 2 * kv_shard_bytes
    if method == "all_gather":
        return (n - 1) * kv
    if method == "ring":
        return (n - 1) * kv + (n * kv if backward and n > 1 else 0)  # one rank sends nothing
    moved = lambda size: bytes_moved_per_rank("all_to_all", size, n)  # noqa: E731
    return 2 * moved(shard_bytes) + 2 * moved(kv_shard_bytes)  # q and the output; k and v


def hybrid_context_parallel_bytes(shard_bytes, ulysses, ring, *, backward=False, kv_shard_bytes=None):
    """Bytes one rank sends for one attention layer with Ulysses inside groups of `ulysses` ranks and ring attention
    across `ring` such groups (USP, Fang and Zhao 2024, arXiv 2405.07719): n = ulysses × ring ranks.

    shard_bytes is this rank's q shard with the sequence split over all n ranks. The all-to-alls of q, k, v and the
    output run inside the Ulysses group, as Ulysses over `ulysses` ranks. They leave each rank heads/ulysses heads
    over seq/ring tokens: a block of exactly shard_bytes again, which then goes round a ring of `ring` ranks. So the
    bytes are Ulysses' over `ulysses` ranks plus the ring's over `ring` ranks, for the same shard: ring = 1 is plain
    Ulysses, ulysses = 1 the plain ring. The Ulysses degree is capped by the (K/V) heads, the ring's is not.
    """
    for value, name in ((ulysses, "ulysses"), (ring, "ring")):
        require(isinstance(value, int) and value >= 1, f"{name} degree must be a whole number >= 1, got {value!r}")
    kwargs = {"backward": backward, "kv_shard_bytes": kv_shard_bytes}
    return (context_parallel_bytes("ulysses", shard_bytes, ulysses, **kwargs)
            + context_parallel_bytes("ring", shard_bytes, ring, **kwargs))


def ring_step_times(block_tokens, heads, head_dim, flops_per_s, bandwidth_bytes_per_s, *, batch=1, kv_heads=None,
                    bytes_per_value=2):
    """(compute seconds, transfer seconds) of one forward step of ring attention, modelled.

    Compute: this rank's block_tokens queries against one K/V block of block_tokens keys, with no mask inside the
    block: QKᵀ and PV, 2 · 2 · batch · heads · block_tokens² · head_dim FLOPs at flops_per_s. Transfer: the K/V
    block passed on to the next rank, 2 · batch · kv_heads · block_tokens · head_dim · bytes_per_value bytes at
    bandwidth_bytes_per_s. No latency term: the blocks that matter are megabytes.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for value, name in ((block_tokens, "block_tokens"), (flops_per_s, "flops_per_s"),
                        (bandwidth_bytes_per_s, "bandwidth_bytes_per_s"), (heads, "heads"), (kv_heads, "kv_heads"),
                        (head_dim, "head_dim"), (batch, "batch"), (bytes_per_value, "bytes_per_value")):
        require(value > 0, f"{name} must be > 0, got {value!r}")
    compute = 4 * batch * heads * block_tokens ** 2 * head_dim / flops_per_s
    transfer = 2 * batch * kv_heads * block_tokens * head_dim * bytes_per_value / bandwidth_bytes_per_s
    return compute, transfer


def ring_overlap_block_tokens(flops_per_s, bandwidth_bytes_per_s, *, heads=1, kv_heads=None, bytes_per_value=2):
    """The block size (tokens per rank, S/N) from which one ring step's compute takes at least as long as passing
    its K/V block on, so that the transfer can hide behind it (ring_step_times: compute ∝ c², transfer ∝ c):

        4 · h · c² · d / F  >=  2 · h_kv · c · d · bytes / B   <=>   c >= (h_kv / h) · bytes · F / (2 · B)

    F is the FLOP/s attention achieves (a datasheet peak gives the largest, most demanding block), B the link's
    bandwidth per direction. Batch and head_dim cancel. Grouped-query attention (kv_heads < heads) divides it by
    heads / kv_heads: fewer bytes per FLOP.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    for value, name in ((flops_per_s, "flops_per_s"), (bandwidth_bytes_per_s, "bandwidth_bytes_per_s"),
                        (heads, "heads"), (kv_heads, "kv_heads"), (bytes_per_value, "bytes_per_value")):
        require(value > 0, f"{name} must be > 0, got {value!r}")
    return kv_heads / heads * bytes_per_value * flops_per_s / (2 * bandwidth_bytes_per_s)
