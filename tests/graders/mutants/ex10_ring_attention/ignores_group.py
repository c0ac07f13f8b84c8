"""ring_attention ignores group= and runs its ring over every rank (the default group).

With group=None that is right, so every world-size case passes; with two groups of 2 on 4 ranks the ring goes
through all four, mixing the two groups' sequences: wrong outputs, and calls outside the group. Only the
subgroup tests.

A copy of solutions/ex10_ring_attention.py with this one mistake (the lines marked `# MUTANT:`).
tests/test_mutants.py grades it and checks that exactly the grader tests in MUST_FAIL lose their points, and
that every other test keeps them.
"""
MUST_FAIL = (
    'test_subgroups_equal_sdpa',
    'test_subgroups_communicate_inside_their_group',
)
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
    ### BEGIN SOLUTION
    ### HINT: chunk r and its mirror image 2·world - 1 - r
    return rank, 2 * world - 1 - rank
    ### END SOLUTION


def shard_sequence(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """rank's shard of a full [batch, heads, seq, head_dim] tensor in the zig-zag layout (a new tensor)."""
    if x.dim() != 4:
        raise ValueError(f"shard_sequence expects [batch, heads, seq, head_dim], got shape {tuple(x.shape)}")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not a rank of a group of world={world}")
    seq = x.shape[2]
    ### BEGIN SOLUTION
    ### HINT: seq % (2 * world) -> ValueError naming both; then torch.cat of the two chunks of chunk_ids(rank, world)
    if seq % (2 * world):
        raise ValueError(f"seq={seq} is not divisible by 2 × world = {2 * world}: the zig-zag layout cuts the "
                         f"sequence into 2 × world equal chunks; choose seq a multiple of {2 * world}")
    chunks = x.chunk(2 * world, dim=2)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world)], dim=2)
    ### END SOLUTION


def block_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    """'full' (no mask), 'diagonal' (the causal triangle) or 'skip' (every key in the future), by GLOBAL chunk."""
    ### BEGIN SOLUTION
    ### HINT: not causal: 'full'; causal: compare the chunk indices (later query chunk: full; same: diagonal)
    if not causal or q_chunk > k_chunk:
        return "full"
    return "diagonal" if q_chunk == k_chunk else "skip"
    ### END SOLUTION


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
    ### BEGIN SOLUTION
    ### HINT: m = s.amax(-1, keepdim=True); p = exp(s - m); l = p.sum(-1, keepdim=True); return (p @ v) / l, m + log(l)
    m = s.amax(dim=-1, keepdim=True)  # every row has at least one key (the diagonal's own), so m is finite
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    return (p @ v) / l, m + torch.log(l)
    ### END SOLUTION


def merge(out, lse, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results over disjoint key sets (lse = -inf: nothing yet)."""
    ### BEGIN SOLUTION
    ### HINT: new = torch.logaddexp(lse, lse_b); out * exp(lse - new) + out_b * exp(lse_b - new), new
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new) + out_b * torch.exp(lse_b - new), new
    ### END SOLUTION


def block_backward(q, k, v, dout, lse, delta, scale: float, diagonal: bool):
    """(dq, dk, dv) of one block, given the FINAL lse of the query rows and delta = rowsum(dout * out)."""
    s = scores(q, k, scale, diagonal)
    ### BEGIN SOLUTION
    ### HINT: p = exp(s - lse); dv = pᵀ dout; dp = dout vᵀ; ds = p (dp - delta); dq = ds k scale; dk = dsᵀ q scale
    p = torch.exp(s - lse)
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv
    ### END SOLUTION


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
        ### BEGIN SOLUTION
        ### HINT: recv = empty_like(tensor); dist.batch_isend_irecv([P2POp(isend, tensor, next), P2POp(irecv, recv, prev)])
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, received, self.prev, self.group, tag)])
        return Exchange(works, received, tensor)
        ### END SOLUTION


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
        ### BEGIN SOLUTION
        ### HINT: kv = torch.stack([k, v]); each step: ring.start(kv) (not at the last), every block by block_kind(mine[i], theirs[j]): block_forward, merge; then wait
        kv = torch.stack([k, v])
        for step in range(ring.world):
            theirs = chunk_ids((ring.rank - step) % ring.world, ring.world)
            pending = ring.start(kv) if step < ring.world - 1 else None  # the next block travels while we compute
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for i in range(2):
                for j in range(2):
                    kind = block_kind(mine[i], theirs[j], causal)
                    if kind != "skip":
                        out_b, lse_b = block_forward(qs[i], ks[j], vs[j], scale, kind == "diagonal")
                        outs[i], lses[i] = merge(outs[i], lses[i], out_b, lse_b)
            if pending is not None:
                kv = pending.wait()
        ### END SOLUTION
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
        ### BEGIN SOLUTION
        ### HINT: kv = stack([k, v]), dkv = zeros_like(kv); each step: prefetch kv, add block_backward's dq/dk/dv, pass dkv on (N hops: home)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)
        for step in range(ring.world):
            theirs = chunk_ids((ring.rank - step) % ring.world, ring.world)
            pending = ring.start(kv) if step < ring.world - 1 else None
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            dks, dvs = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)  # views: add_ writes into dkv
            for i in range(2):
                for j in range(2):
                    kind = block_kind(mine[i], theirs[j], causal=ctx.causal)
                    if kind != "skip":
                        dq, dk, dv = block_backward(qs[i], ks[j], vs[j], dos[i], lses[i], deltas[i], scale,
                                                    kind == "diagonal")
                        dqs[i] += dq
                        dks[j].add_(dk)
                        dvs[j].add_(dv)
            if ring.world > 1:
                dkv = ring.start(dkv, tag=1).wait()  # the gradient follows its block; after N hops it is home
            if pending is not None:
                kv = pending.wait()
        ### END SOLUTION
        return torch.cat(dqs, dim=2), dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   group=None) -> torch.Tensor:
    """This rank's shard (zig-zag layout) of attention over the whole sequence; differentiable."""
    check_inputs(q, k, v)
    return RingAttention.apply(q, k, v, causal, None)  # MUTANT: group ignored: the ring spans every rank
