# Generated from solutions/ex10_ring_attention.py by `gpucourse make-exercises`: course authors edit the
# solution, not this file. Learners: fill in every `# YOUR CODE HERE`, then `gpucourse grade ex10`.
"""Exercise 10: ring attention: exact attention over a sequence split across ranks, K/V passed around a ring.

Task
----
Context parallelism splits the SEQUENCE over the N ranks of a group: each rank holds its shard of q, k and v,
shape [batch, heads, seq_local, head_dim] (seq_local = seq / N). Attention needs every query to meet every key,
so the K/V shards travel around a ring: at step s (0..N-1) rank r holds the K/V shard of rank (r - s) mod N,
computes its queries against it while the next shard is already on its way (`isend` to rank r+1, `irecv` from
rank r-1), and merges the partial result into its running one with the log-sum-exp rule below. After N steps
each rank has its queries' exact attention output, yet no rank ever held more than two K/V shards at once.

- `shard_sequence(x, rank, world)` returns rank's shard of a full [batch, heads, seq, head_dim] tensor in the
  ZIG-ZAG layout: cut the sequence into 2N equal chunks; rank r holds chunks r and 2N-1-r, in that order. With a
  causal mask, a contiguous split gives the last rank N times the first rank's work (its queries see the whole
  past); zig-zag pairs an early chunk with a late one, so every rank does the same work.
- `ring_attention(q, k, v, causal=False, group=None)` returns this rank's shard of
  softmax(q kᵀ / sqrt(head_dim) [+ causal mask]) v, computed over the WHOLE sequence, in that layout; it
  supports backward (gradients for q, k and v of this rank's shard).

How to merge partial results (the online softmax): attention of rows q against one key block gives
    out_b = softmax(s_b) v_b   and   lse_b = log Σ_j exp(s_b[j])   (s = q kᵀ · scale, per query row).
Two partial results (out₁, lse₁), (out₂, lse₂) over disjoint key sets combine exactly:
    lse = log(exp(lse₁) + exp(lse₂))             (torch.logaddexp: never exp() of a large score)
    out = out₁ · exp(lse₁ - lse) + out₂ · exp(lse₂ - lse)
Inside a block, subtract the row maximum before exp (exp(88) already overflows float32).

Causal mask in the zig-zag layout: work chunk by chunk. Query chunk a against key chunk b (GLOBAL chunk
indices, from the layouts of this rank and of the rank the K/V came from): a > b: every key is in the past
(no mask); a == b: the causal triangle; a < b: every key is in the future (skip the block). A mask built from
the local positions inside each block (or is_causal=True on every block) is wrong.

Backward: a `torch.autograd.Function` (`RingAttention`), as production ring attention does. Forward saves only
this rank's q, k, v, the output and the log-sum-exp; backward passes the K/V shards around the ring AGAIN,
and with each shard the gradient accumulated for it so far (dK, dV): each rank adds its queries' part and
passes both on; after N hops the accumulated dK/dV of every shard is back on its owner. The state saved for
backward is O(seq_local) per rank. (Autograd through the forward's ops would save every received block:
O(seq) per rank, and the received blocks have no gradient path back to their owners anyway.)
The gradient of one block, with P = exp(s - lse) (the final lse), dO the output's gradient and
D = rowsum(dO * O):  dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P * (dP - D);  dQ = dS K · scale;  dK = dSᵀ Q · scale.

Rules
-----
- Point-to-point only (`dist.isend`/`dist.irecv`, or `dist.P2POp` with `dist.batch_isend_irecv`): no
  collective (all_gather, broadcast, all_to_all, all_reduce, ...); no rank ever holds the whole sequence's K
  or V. Post each send and receive together (no deadlock), and send nothing at world size 1.
- Bytes sent per rank (e = bytes per element, kv = 2 · batch · heads · seq_local · head_dim · e, K and V):
  forward (N-1) · kv (N-1 hops; the last shard is not sent home); backward (N-1) · kv for K/V plus N · kv
  for dK/dV. The grader counts them: a hop more than that is bytes wasted.
- Communicate only inside `group` (None: every rank), with `dist.get_world_size(group)` and
  `dist.get_rank(group)`; point-to-point peers are GLOBAL ranks (`dist.get_process_group_ranks(group)`).
- World size 1 to 4 (any N, in fact); causal and not; float32 and float64 (compute in the input's dtype).
- Bad input raises ValueError naming what is wrong: q, k, v of different shapes, or not 4-D; an odd seq_local
  (the zig-zag layout gives each rank two equal chunks); shard_sequence on a sequence that 2 · world does not
  divide.

Check your work: `gpucourse grade ex10`.
"""
import torch
import torch.distributed as dist


def group_size_and_rank(group=None) -> tuple[int, int]:
    """(size of the context-parallel group, this process's rank in it); (1, 0) without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# --- the layout ----------------------------------------------------------------------------------------------
def chunk_ids(rank: int, world: int) -> tuple[int, int]:
    """The two chunks (of 2·world) of the sequence that rank holds, in order: zig-zag, one early and one late."""
    # YOUR CODE HERE
    raise NotImplementedError("chunk r and its mirror image 2·world - 1 - r")


def shard_sequence(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """rank's shard of a full [batch, heads, seq, head_dim] tensor in the zig-zag layout (a new tensor)."""
    if x.dim() != 4:
        raise ValueError(f"shard_sequence expects [batch, heads, seq, head_dim], got shape {tuple(x.shape)}")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not a rank of a group of world={world}")
    seq = x.shape[2]
    # YOUR CODE HERE
    raise NotImplementedError("seq % (2 * world) -> ValueError naming both; then torch.cat of the two chunks of chunk_ids(rank, world)")


def block_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """'full' (no mask), 'diagonal' (the causal triangle) or 'skip' (every key in the future), by GLOBAL chunk."""
    # YOUR CODE HERE
    raise NotImplementedError("not causal: 'full'; causal: compare the chunk indices (later query chunk: full; same: diagonal)")


# --- one block, and merging blocks -----------------------------------------------------------------------------
def scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """q kᵀ · scale, with the causal triangle's future set to -inf when the block is on the diagonal."""
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_forward(q, k, v, scale: float, diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(s) v, logsumexp(s)) for one block: out [..., rows, head_dim], lse [..., rows, 1]."""
    s = scores(q, k, scale, diagonal)
    # YOUR CODE HERE
    raise NotImplementedError("m = s.amax(-1, keepdim=True); p = exp(s - m); l = p.sum(-1, keepdim=True); return (p @ v) / l, m + log(l)")


def merge(out, lse, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results over disjoint key sets (lse = -inf: nothing yet)."""
    # YOUR CODE HERE
    raise NotImplementedError("new = torch.logaddexp(lse, lse_b); out * exp(lse - new) + out_b * exp(lse_b - new), new")


def block_backward(q, k, v, dout, lse, delta, scale: float, diagonal: bool):
    """(dq, dk, dv) of one block, given the FINAL lse of the query rows and delta = rowsum(dout * out)."""
    s = scores(q, k, scale, diagonal)
    # YOUR CODE HERE
    raise NotImplementedError("p = exp(s - lse); dv = pᵀ dout; dp = dout vᵀ; ds = p (dp - delta); dq = ds k scale; dk = dsᵀ q scale")


# --- the ring -----------------------------------------------------------------------------------------------
class Ring:
    """This rank's place in the group's ring: `start(tensor)` sends it to the next rank and receives the same
    shape from the previous one; `.wait()` on what it returns gives the received tensor."""

    def __init__(self, group=None):
        self.group = group
        self.world, self.rank = group_size_and_rank(group)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if self.world > 1 else [0]
        self.next, self.prev = ranks[(self.rank + 1) % self.world], ranks[(self.rank - 1) % self.world]

    def start(self, tensor: torch.Tensor, tag: int = 0) -> "Exchange":
        # YOUR CODE HERE
        raise NotImplementedError("recv = empty_like(tensor); dist.batch_isend_irecv([P2POp(isend, tensor, next), P2POp(irecv, recv, prev)])")


class Exchange:
    """A send and a receive in flight; the sent tensor is kept alive until both are done."""

    def __init__(self, works, received: torch.Tensor, sent: torch.Tensor):
        self.works, self.received, self.sent = works, received, sent

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.sent = None
        return self.received


def check_inputs(q, k, v) -> None:
    shapes = {name: tuple(t.shape) for name, t in (("q", q), ("k", k), ("v", v))}
    if len(set(shapes.values())) != 1 or q.dim() != 4:
        raise ValueError(f"q, k and v must have the same 4-D shape [batch, heads, seq_local, head_dim]; got "
                         + ", ".join(f"{n} {s}" for n, s in shapes.items()))
    if q.shape[2] % 2:
        raise ValueError(f"seq_local={q.shape[2]} is odd: the zig-zag layout gives each rank two equal chunks; "
                         f"choose a sequence length divisible by 2 × world size (shard it with shard_sequence)")


class RingAttention(torch.autograd.Function):
    """Ring attention whose backward passes K/V around the ring again: saved state O(seq_local) per rank."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, group):
        ring = Ring(group)
        scale = q.shape[-1] ** -0.5
        mine = chunk_ids(ring.rank, ring.world)
        qs = q.chunk(2, dim=2)
        outs = [torch.zeros_like(qc) for qc in qs]
        lses = [torch.full((*qc.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device) for qc in qs]
        # YOUR CODE HERE
        raise NotImplementedError("kv = torch.stack([k, v]); each step: ring.start(kv) (not at the last), every block by block_kind(mine[i], theirs[j]): block_forward, merge; then wait")
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        scale = q.shape[-1] ** -0.5
        mine = chunk_ids(ring.rank, ring.world)
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1, keepdim=True)
        qs, dos, lses, deltas = (t.chunk(2, dim=2) for t in (q, dout, lse, delta))
        dqs = [torch.zeros_like(qc) for qc in qs]
        # YOUR CODE HERE
        raise NotImplementedError("kv = stack([k, v]), dkv = zeros_like(kv); each step: prefetch kv, add block_backward's dq/dk/dv, pass dkv on (N hops: home)")
        return torch.cat(dqs, dim=2), dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   group=None) -> torch.Tensor:
    """This rank's shard (zig-zag layout) of attention over the whole sequence; differentiable."""
    check_inputs(q, k, v)
    return RingAttention.apply(q, k, v, causal, group)
