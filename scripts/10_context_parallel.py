"""Chapter 10: attention over a sequence split across ranks, three ways, each checked against SDPA on the whole sequence.

    10_context_parallel.py --impl exercises/ex10_ring_attention.py [--seq 1024 --heads 4 ...]

Every rank builds the same full q, k, v (batch, heads, seq, head_dim) and upstream gradient from a fixed seed,
computes F.scaled_dot_product_attention on the WHOLE sequence in float64 as the reference, and keeps its shard of
the sequence in the zig-zag layout (the impl's shard_sequence: chunks r and 2N-1-r of 2N). Then, causal and not:
  all_gather  all-gather K and V (the whole sequence's on every rank), attend, reduce-scatter dK/dV in backward
  ring        ring_attention from --impl (exercise ex10; the reference solution stands in while the exercise
              raises NotImplementedError): K/V blocks passed around the ring with isend/irecv
  ulysses     all-to-all from sequence-split to head-split (each rank: H/N heads, whole sequence), attend,
              all-to-all back (DeepSpeed-Ulysses); needs heads divisible by N
  ring_autograd  the same ring forward written with plain autograd (no backward of its own): what it saves for
              backward, and which gradients come out wrong (logged, not asserted: dK/dV are expected wrong)
Each case ASSERTS that its output and q/k/v gradients equal the reference's shard (float32 tolerance), and logs
the bytes this rank addressed to other ranks (forward, backward), what the forward left for backward (bytes of
tensors saved by autograd), and the times. Also:
  all_gather_gqa  all-gather K/V with grouped-query attention (--kv-heads < --heads), causal, as Llama 3 trains
              long contexts: the bytes shrink with the K/V heads (asserted like the others)
  usp_UxR     Ulysses inside groups of U ranks, ring attention (--impl, on a subgroup) across the R = N/U groups
              (USP), for every U dividing N and the heads: U x 1 is Ulysses, 1 x N the ring (asserted like the others)
  cp_training a small model (embedding, attention, head) trained a few SGD steps in float64 under CP, labels taken
              at the inputs' zig-zag positions: with the weight gradients all-reduced over the CP group it ASSERTS
              the losses and parameters of one process on the whole sequence; without, it logs how far the
              replicas drift apart. labels: the sharded loss against the whole one, and labels shifted after sharding
  ring_step   one ring step's block attention and one K/V hop to the next rank, timed (the overlap condition)
  balance     causal attention of this rank's queries against the whole sequence, chunk block by chunk block,
              skipping blocks wholly in the future: (query, key) pairs and time per rank, contiguous vs zig-zag
  mistake     ring attention with the causal mask of each block's LOCAL positions (is_causal on every block)
  torch_cp    torch.distributed.tensor.experimental.context_parallel around causal SDPA (on CUDA), with each of
              its two ways of moving K/V: its error against the reference; everywhere, read from the installed
              torch: which SDPA ops it handles (is the CPU's one of them?), how it moves K/V by default
              (_cp_options.rotate_method: all-gather unless set_rotate_method("alltoall")), and which chunks
              of the sequence its default (head-tail) load balancer gives this rank
  profile     a few ring-attention steps (forward + backward) under the profiler: traces/rank<r>.json
--only ways,gqa,... runs only the parts named (tests use it).

    gpucourse dryrun scripts/10_context_parallel.py --world 1024 -- --only training --seq 2048   # CP over 1,024

In a dry run (fake process group) values mean nothing: they are read through runtime.value (None there), and no
comparison is asserted. cp_training logs each step with the gradients all-reduced: a dry run reports the last.
"""
import argparse
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.nn import functional as F

from gpucourse import exercises, runtime

TOLERANCE = 1e-4  # float32 against float64: attention over up to a few thousand keys rounds to ~1e-6
SENT = {"bytes": 0}  # bytes this rank addressed to other ranks, counted at each call
PARTS = ("ways", "gqa", "usp", "training", "ring_step", "balance", "mistake", "torch_cp", "profile")


# --- counting what is sent ------------------------------------------------------------------------------------
def count_point_to_point_sends() -> None:
    """Every point-to-point send ends in ProcessGroup.send (isend, batch_isend_irecv): count its tensors' bytes."""
    from torch._C._distributed_c10d import ProcessGroup

    original = ProcessGroup.send

    def send(self, tensors, *args, **kwargs):
        SENT["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        return original(self, tensors, *args, **kwargs)

    ProcessGroup.send = send


def probe_ex10(impl, device) -> None:
    """shard_sequence and ring_attention once, on every rank at once (the ring's messages meet): raises
    NotImplementedError while either is a stub."""
    impl.shard_sequence(torch.zeros(1, 1, 2, 1, device=device), 0, 1)
    impl.ring_attention(*(torch.zeros(1, 1, 2, 1, device=device) for _ in range(3)))


# --- way 1: all-gather K/V --------------------------------------------------------------------------------------
class GatherSequence(torch.autograd.Function):
    """Forward: every rank's shard, stacked in rank order (all-gather). Backward: reduce-scatter of the gradient:
    this rank's shard gets the sum of every rank's gradient for it."""

    @staticmethod
    def forward(ctx, x):
        n = dist.get_world_size()
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # shards along dim 0
        dist.all_gather_into_tensor(out, x.contiguous())
        SENT["bytes"] += (n - 1) * x.numel() * x.element_size()  # a ring all-gather forwards n-1 shards
        return out.view(n, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[0]
        mine = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)  # (2, B, H, S/n, D): dK, dV
        dist.reduce_scatter_tensor(mine, grad.reshape(n * grad.shape[1], *grad.shape[2:]).contiguous())
        SENT["bytes"] += (n - 1) * mine.numel() * mine.element_size()
        return mine


def attend(q, k, v, q_pos, k_pos, causal):
    """Plain attention of q against k/v with positions given: the causal mask is GLOBAL (q_pos >= k_pos). K/V may
    have fewer heads than q (grouped-query attention: each K/V head serves heads/kv_heads query heads)."""
    mask = (q_pos[:, None] >= k_pos[None, :]) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def all_gather_attention(q, k, v, positions, causal):
    n = dist.get_world_size()
    kv = GatherSequence.apply(torch.stack([k, v]))  # (n, 2, B, H, S_l, D): the whole sequence's K and V
    k_all = torch.cat(list(kv[:, 0]), dim=2)
    v_all = torch.cat(list(kv[:, 1]), dim=2)
    return attend(q, k_all, v_all, positions[dist.get_rank()], torch.cat([positions[r] for r in range(n)]), causal)


# --- way 3: all-to-all over heads (Ulysses) -----------------------------------------------------------------------
def all_to_all(x: torch.Tensor, group=None) -> torch.Tensor:
    """x (n, ...): part j goes to rank j of the group; returns (n, ...) with part j from rank j."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    SENT["bytes"] += (x.shape[0] - 1) * x[0].numel() * x.element_size()  # all parts but our own
    return out


class SequenceToHeads(torch.autograd.Function):
    """(B, H, S/n, D) sequence-split → (B, H/n, S, D) head-split (the sequence in rank order). Backward: the inverse."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group), None


def seq_to_heads(x, group=None):
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = all_to_all(x.reshape(b, n, h // n, s, d).transpose(0, 1), group)  # part j: head group j
    return torch.cat(list(parts), dim=2)  # rank j's sequence shard j, in rank order


def heads_to_seq(y, group=None):
    n = dist.get_world_size(group)
    parts = all_to_all(torch.stack(y.chunk(n, dim=2)), group)  # part j: rank j's sequence shard
    return torch.cat(list(parts), dim=1)  # head groups back in order


def ulysses_attention(q, k, v, positions, causal):
    n = dist.get_world_size()
    qh, kh, vh = (SequenceToHeads.apply(t) for t in (q, k, v))
    order = torch.cat([positions[r] for r in range(n)])  # the sequence as the all-to-all assembled it
    if not causal:
        return HeadsToSequence.apply(F.scaled_dot_product_attention(qh, kh, vh))
    to_global = torch.argsort(order)  # the whole sequence is here: put it in order, and causal is the plain triangle
    out = F.scaled_dot_product_attention(*(t[:, :, to_global] for t in (qh, kh, vh)), is_causal=True)
    return HeadsToSequence.apply(out[:, :, torch.argsort(to_global)])


# --- the ring without its own backward: autograd through the forward's operations --------------------------------
def ring_autograd_attention(q, k, v, positions, causal):
    """Ring attention's forward (K/V blocks around the ring, an online softmax over them) as plain tensor ops, so
    that autograd records it. Autograd then keeps every block that arrived (each step's K, V and probabilities):
    state ∝ S, not S/N. And the gradients of the blocks that arrived stay on this rank: nothing sends them home,
    so only the rank's own block contributes to its dK and dV."""
    n, rank = dist.get_world_size(), dist.get_rank()
    scale = q.shape[-1] ** -0.5
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)  # running row maximum
    num, den = torch.zeros_like(q), torch.zeros_like(m)
    block_k, block_v = k, v
    for step in range(n):
        source = (rank - step) % n  # whose K/V block this is
        if step < n - 1:  # start passing the block on while it is used
            nxt_k, nxt_v = torch.empty_like(k), torch.empty_like(v)
            ops = [dist.P2POp(dist.isend, block_k.detach().contiguous(), (rank + 1) % n),
                   dist.P2POp(dist.isend, block_v.detach().contiguous(), (rank + 1) % n),
                   dist.P2POp(dist.irecv, nxt_k, (rank - 1) % n), dist.P2POp(dist.irecv, nxt_v, (rank - 1) % n)]
            requests = dist.batch_isend_irecv(ops)
        scores = (q @ block_k.transpose(-2, -1)) * scale
        if causal:
            future = positions[rank].view(-1, 1) < positions[source].view(1, -1)
            scores = scores.masked_fill(future, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # a row with no key yet stays 0
        weights = torch.exp(scores - shift)
        keep = torch.exp(m - shift)
        num, den, m = num * keep + weights @ block_v, den * keep + weights.sum(-1, keepdim=True), m_new
        if step < n - 1:
            for request in requests:
                request.wait()
            block_k, block_v = nxt_k, nxt_v
    return num / den


# --- Ulysses inside groups, the ring across them (USP) ---------------------------------------------------------
def usp_layout(n, ulysses, seq):
    """{rank: positions it holds} for `ulysses` x `ring` ranks, rank = ring index · ulysses + Ulysses index. The
    ring's zig-zag layout over `ring` members (chunks j and 2·ring-1-j of 2·ring), each chunk cut into `ulysses`
    pieces over the Ulysses group: after the group's all-to-all every member holds chunks j and 2·ring-1-j whole."""
    ring = n // ulysses
    chunks = torch.arange(seq).chunk(2 * ring)
    return {j * ulysses + i: torch.cat([chunks[c].chunk(ulysses)[i] for c in (j, 2 * ring - 1 - j)])
            for j in range(ring) for i in range(ulysses)}


def usp_ring_order(ulysses, shard_tokens):
    """Indices that put the Ulysses all-to-all's sequence (rank i's two pieces, for i in group order) into the
    ring's order (the first chunk's pieces, then the second's)."""
    piece = shard_tokens // 2  # each rank holds one piece of each of its ring member's two chunks
    return torch.cat([torch.arange(i * 2 * piece + half * piece, i * 2 * piece + (half + 1) * piece)
                      for half in (0, 1) for i in range(ulysses)])


def usp_groups(n, ulysses):
    """(this rank's Ulysses group, its ring group): every rank creates every group, in the same order."""
    rank, ring = dist.get_rank(), n // ulysses
    ulysses_groups = [dist.new_group([j * ulysses + i for i in range(ulysses)]) for j in range(ring)]
    ring_groups = [dist.new_group([j * ulysses + i for j in range(ring)]) for i in range(ulysses)]
    return ulysses_groups[rank // ulysses], ring_groups[rank % ulysses]


def usp_attention(q, k, v, causal, impl, ulysses, groups):
    """All-to-all to heads/ulysses heads inside the Ulysses group, then ring attention (impl) over the ring group
    on that block, then back. The all-to-all leaves the pieces interleaved (piece i of both chunks, for every i):
    put both chunks back in order for the ring, and the result back in the all-to-all's order."""
    u_group, r_group = groups
    qh, kh, vh = (SequenceToHeads.apply(t, u_group) for t in (q, k, v))
    order = usp_ring_order(ulysses, q.shape[2]).to(q.device)
    out = impl.ring_attention(*(t[:, :, order] for t in (qh, kh, vh)), causal=causal, group=r_group)
    return HeadsToSequence.apply(out[:, :, torch.argsort(order)], u_group)


# --- a small model trained under context parallelism: labels, loss and the weight gradients ----------------------
class TinyLM(torch.nn.Module):
    """Embedding, one causal self-attention and an output head. Every rank holds all of it; only attention needs
    other ranks' tokens (all-gather K/V with the tokens' global positions)."""

    def __init__(self, vocab, heads, head_dim):
        super().__init__()
        width = heads * head_dim
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens, attention):
        b, s = tokens.shape
        x = self.embed(tokens)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.head(x + attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


def lm_loss(model, inputs, labels, attention, total_tokens):
    """Cross-entropy summed over these tokens / all the sequence's tokens: the ranks' losses add up to the mean."""
    logits = model(inputs, attention)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / total_tokens


def sgd_step(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train_under_cp(args, positions, steps=3, lr=0.5):
    """One process on the whole sequence (the reference), then the same model under CP: labels taken at the same
    zig-zag positions as the inputs, and `steps` SGD steps with and without all-reducing the weight gradients over
    the CP group. float64, so equal means equal to ~1e-15."""
    n, rank, device = dist.get_world_size(), dist.get_rank(), runtime.context().device
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # shifted on the WHOLE sequence, then sharded alike
    mine = positions[rank]
    total = labels.numel()

    torch.manual_seed(2)
    reference = TinyLM(args.vocab, args.heads, args.head_dim).to(device, torch.float64)
    start = {k: t.clone() for k, t in reference.state_dict().items()}
    whole = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    ref_losses = []
    for _ in range(steps):
        loss = lm_loss(reference, inputs, labels, whole, total)
        loss.backward()
        sgd_step(reference, lr)
        ref_losses.append(runtime.value(loss))

    split = lambda q, k, v: all_gather_attention(q, k, v, positions, True)  # noqa: E731
    for sync in (True, False):
        model = TinyLM(args.vocab, args.heads, args.head_dim).to(device, torch.float64)
        model.load_state_dict(start)
        losses, spread = [], []
        for step in range(steps):
            loss = lm_loss(model, inputs[:, mine], labels[:, mine], split, total)
            loss.backward()
            if sync:  # each rank's weight gradient covers its tokens only: sum them over the CP group
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            sgd_step(model, lr)
            summed = loss.detach().clone()
            dist.all_reduce(summed)
            losses.append(runtime.value(summed))
            first = flat_params(model)
            dist.broadcast(first, src=0)  # rank 0's parameters: the largest gap from them, over the ranks
            gap = (flat_params(model) - first).abs().max()
            dist.all_reduce(gap, op=dist.ReduceOp.MAX)  # not an all-gather of every replica: n x the model at scale
            spread.append(runtime.value(gap))
            if sync:
                runtime.log(step=step, case="cp_step")  # a dry run reports the last step logged
        runtime.log(case="cp_training", sync=sync, steps=steps, lr=lr, losses=losses, ref_losses=ref_losses,
                    rank_spread=spread,
                    vs_reference=runtime.value((flat_params(model) - flat_params(reference)).abs().max()))
        if sync and not runtime.dry_run():
            assert abs(losses[0] - ref_losses[0]) <= 1e-12, (losses[0], ref_losses[0])  # the same loss, sharded
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-10, (losses, ref_losses)
            assert max(spread) == 0.0 and (flat_params(model) - flat_params(reference)).abs().max() <= 1e-10

    # labels shifted AFTER sharding: each shard's next token, not the sequence's (rank 0's first model state)
    model = TinyLM(args.vocab, args.heads, args.head_dim).to(device, torch.float64)
    model.load_state_dict(start)
    with torch.no_grad():
        wrong = lm_loss(model, inputs[:, mine], inputs[:, mine].roll(-1, dims=1), split, total)
        right = lm_loss(model, inputs[:, mine], labels[:, mine], split, total)
    wrong_rows = runtime.value((inputs[:, mine].roll(-1, dims=1) != labels[:, mine]).sum())
    for t in (wrong, right):
        dist.all_reduce(t)
    runtime.log(case="labels", positions=mine.tolist(), label_positions=(mine + 1).tolist(),
                loss=runtime.value(right), ref_loss=ref_losses[0],
                loss_labels_shifted_after_sharding=runtime.value(wrong),
                wrong_labels_here=wrong_rows)


# --- the ring's overlap condition: one block's compute against passing its K/V on ---------------------------------
def ring_step_timing(q, k, v, tries=5):
    """Seconds of one ring step's work on this rank's block (attention of its queries to a K/V block of the same
    size, no mask) and of one hop of its K/V block to the next rank (both the fastest of `tries`)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    compute, transfer = [], []
    for _ in range(tries + 1):  # the first is a warm-up
        dist.barrier()
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v)
        sync()
        compute.append(time.perf_counter() - start)
        kv, received = torch.stack([k, v]).contiguous(), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
        dist.barrier()
        start = time.perf_counter()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % n),
                                            dist.P2POp(dist.irecv, received, (rank - 1) % n)]):
            work.wait()
        sync()
        transfer.append(time.perf_counter() - start)
    b, h, c, d = q.shape
    runtime.log(case="ring_step", block_tokens=c, heads=h, kv_heads=k.shape[1], head_dim=d, batch=b,
                bytes_per_value=k.element_size(), flops=4 * b * h * c * c * d, kv_bytes=kv.numel() * kv.element_size(),
                compute_s=min(compute[1:]), transfer_s=min(transfer[1:]))


# --- running one way and checking it ----------------------------------------------------------------------------
def saved_bytes(run):
    """run() under saved_tensors_hooks: (its result, bytes of the tensors autograd saved for backward, each
    storage once)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def sync():
    """Wait for the GPU's queued work before reading a clock (nothing to wait for on a CPU)."""
    if torch.cuda.is_available() and runtime.context().device.type == "cuda":
        torch.cuda.synchronize()


def check_case(name, fn, inputs, want, causal, checked=("out", "dq", "dk", "dv")):
    q, k, v, grad = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dist.barrier()
    SENT["bytes"] = 0
    start = time.perf_counter()
    out, saved = saved_bytes(lambda: fn(*leaves, causal))
    sync()
    forward_s, forward_bytes = time.perf_counter() - start, SENT["bytes"]
    SENT["bytes"] = 0
    start = time.perf_counter()
    out.backward(grad)
    sync()
    backward_s, backward_bytes = time.perf_counter() - start, SENT["bytes"]
    errors = {label: runtime.value((got.double() - w).abs().max())  # None in a dry run: nothing to assert
              for label, got, w in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), want)}
    bad = {label: e for label, e in errors.items() if label in checked and e is not None and not e <= TOLERANCE}
    assert not bad, f"{name} (causal={causal}) differs from SDPA on the whole sequence: {bad}"
    runtime.log(case=name, causal=causal, errors=errors, forward_bytes=forward_bytes, backward_bytes=backward_bytes,
                saved_bytes=saved, shard_bytes=q.numel() * q.element_size(),
                kv_shard_bytes=k.numel() * k.element_size(), forward_s=forward_s,
                backward_s=backward_s)


# --- causal balance: the work of each rank, contiguous vs zig-zag -------------------------------------------------
def causal_work(q, k, v, chunks, n):
    """This rank's queries (chunks `chunks` of 2n) against the whole sequence's keys, block by block, causal:
    blocks wholly in the future skipped. (query, key) pairs that count, and seconds."""
    qc, kc, vc = (t.chunk(2 * n, dim=2) for t in (q, k, v))
    pairs, start = 0, time.perf_counter()
    for a in chunks:
        for b in range(a + 1):  # key chunks up to the query chunk's own
            F.scaled_dot_product_attention(qc[a], kc[b], vc[b], is_causal=a == b)
            c = qc[a].shape[2]
            pairs += c * (c + 1) // 2 if a == b else c * c
    sync()
    return pairs, time.perf_counter() - start


# --- PyTorch's own: context_parallel ---------------------------------------------------------------------------
def torch_context_parallel(q, k, v, want_out):
    """PyTorch's context_parallel around causal SDPA, then unsharded: its error against the (causal) reference, for
    each rotate method. Also what the installed torch does by default: how K/V reach the other ranks
    (_cp_options.rotate_method) and which chunks of 2N each rank holds (the head-tail load balancer, used when the
    sequence divides by 2N; it requires is_causal=True). It replaces only the CUDA attention kernels (flash,
    efficient, cuDNN); on a CPU, SDPA calls another op, so only the reads of the defaults run here."""
    from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer

    n, rank, seq = dist.get_world_size(), dist.get_rank(), q.shape[2]
    handled = sorted(str(op) for op in _attention.custom_ops)
    cpu_op = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    order = _load_balancer._HeadTailLoadBalancer(seq, n, "cpu")._generate_indices()[0]  # the position in each slot
    chunks = (order.view(n, 2, -1)[rank, :, 0] // (seq // (2 * n))).tolist()  # the chunks this rank holds
    record = {"handled": handled, "cpu_op": cpu_op, "cpu_op_handled": cpu_op in handled,
              "rotate_method": _attention._cp_options.rotate_method.name,
              "load_balance": _attention._cp_options.enable_load_balance, "head_tail_chunks": chunks}
    if runtime.context().device.type != "cuda":
        return {**record, "ran": False}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    errors = {}
    for method in ("allgather", "alltoall"):
        set_rotate_method(method)
        q_, k_, v_ = (t.to("cuda", torch.bfloat16) for t in (q, k, v))  # the flash kernel takes half precision
        with context_parallel(mesh, buffers=[q_, k_, v_], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)  # load balancing needs is_causal
        (full,) = context_parallel_unshard(mesh, [out], [2])
        errors[method] = (full.double() - want_out.to(full.device)).abs().max().item()
    set_rotate_method("allgather")  # back to the default
    return {**record, "ran": True, "errors": errors}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default=str(exercises.exercises_dir() / "ex10_ring_attention.py"),
                        help="the file defining shard_sequence and ring_attention (exercise ex10)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads of the grouped-query case (heads/2)")
    parser.add_argument("--vocab", type=int, default=32, help="vocabulary of the small model trained under CP")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--only", default="", help=f"comma-separated parts to run (default: all): {','.join(PARTS)}")
    args = parser.parse_args()
    parts = set(args.only.split(",")) if args.only else None
    if parts and parts - set(PARTS):
        parser.error(f"--only: unknown part(s) {', '.join(sorted(parts - set(PARTS)))}; valid: {', '.join(PARTS)}")
    runs = lambda part: parts is None or part in parts  # noqa: E731
    kv_heads = args.kv_heads or max(1, args.heads // 2)
    if args.heads % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} does not divide --heads {args.heads}: each K/V head serves "
                         f"heads/kv_heads query heads")
    ctx = runtime.setup(seed=0, cuda_with_gloo=False)  # gloo's send/recv take CPU tensors only
    n, rank = ctx.world_size, ctx.rank
    if args.seq % (2 * n):
        raise ValueError(f"--seq {args.seq} is not divisible by 2 × world size = {2 * n}: the zig-zag layout cuts "
                         f"the sequence into 2N equal chunks")
    count_point_to_point_sends()
    impl, which = exercises.load_for_chapter(args.impl, "ex10_ring_attention", partial(probe_ex10, device=ctx.device))
    if impl is None:
        raise SystemExit(f"this chapter's ring runs exercise ex10's shard_sequence and ring_attention: {which}")
    runtime.log(case="impl", impl=which)

    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    full = [torch.randn(shape, generator=gen, dtype=torch.float64).to(ctx.device) for _ in range(4)]  # q, k, v, grad
    positions = {r: impl.shard_sequence(torch.arange(args.seq, device=ctx.device).view(1, 1, -1, 1), r, n).flatten()
                 for r in range(n)}
    mine = [impl.shard_sequence(t, rank, n).float() for t in full]

    ways = {"all_gather": lambda q, k, v, c: all_gather_attention(q, k, v, positions, c),
            "ring": lambda q, k, v, c: impl.ring_attention(q, k, v, causal=c)}
    if args.heads % n == 0:
        ways["ulysses"] = lambda q, k, v, c: ulysses_attention(q, k, v, positions, c)
    else:
        runtime.log(case="ulysses-skipped", why=f"{args.heads} heads are not divisible by {n} ranks")
    for causal in (False, True) if runs("ways") else ():
        leaves = [t.clone().requires_grad_() for t in full[:3]]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        out.backward(full[3])
        want = [impl.shard_sequence(t.detach(), rank, n) for t in (out, *(t.grad for t in leaves))]
        for name, fn in ways.items():
            check_case(name, fn, mine, want, causal)
        check_case("ring_autograd", lambda q, k, v, c: ring_autograd_attention(q, k, v, positions, c), mine, want,
                   causal, checked=("out", "dq"))

    # all-gather K/V as Llama 3 trains long contexts, with grouped-query attention: K/V have kv_heads < heads
    if runs("gqa"):
        k, v = (t[:, :kv_heads] for t in full[1:3])
        leaves = [t.clone().requires_grad_() for t in (full[0], k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(full[3])
        want = [impl.shard_sequence(t.detach(), rank, n) for t in (out, *(t.grad for t in leaves))]
        inputs = [impl.shard_sequence(t, rank, n).float() for t in (full[0], k, v, full[3])]
        check_case("all_gather_gqa", ways["all_gather"], inputs, want, True)

    # Ulysses inside groups of u ranks, the ring across n/u groups (USP), for every u that divides n and the heads
    for ulysses in [u for u in range(1, n + 1) if n % u == 0 and args.heads % u == 0] if runs("usp") else ():
        layout, groups = usp_layout(n, ulysses, args.seq), usp_groups(n, ulysses)
        for causal in (False, True):
            leaves = [t.clone().requires_grad_() for t in full[:3]]
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            out.backward(full[3])
            want = [t.detach()[:, :, layout[rank]] for t in (out, *(t.grad for t in leaves))]
            inputs = [t[:, :, layout[rank]].float() for t in full]
            check_case(f"usp_{ulysses}x{n // ulysses}", lambda q, k, v, c: usp_attention(
                q, k, v, c, impl, ulysses, groups), inputs, want, causal)

    if runs("training"):
        train_under_cp(args, positions)
    if runs("ring_step") and n > 1:
        ring_step_timing(*mine[:3])

    # causal balance: the same work done per rank by each layout
    qf, kf, vf = (t.float() for t in full[:3])
    for layout, chunks in (("contiguous", (2 * rank, 2 * rank + 1)), ("zigzag", (rank, 2 * n - 1 - rank))):
        if not runs("balance"):
            break
        causal_work(qf, kf, vf, chunks, n)  # warm-up
        timed = []
        for _ in range(5):  # every rank starts together; the fastest of 5 is the least disturbed by the others
            dist.barrier()
            timed.append(causal_work(qf, kf, vf, chunks, n))
        pairs, seconds = timed[0][0], min(t for _, t in timed)
        runtime.log(case="balance", layout=layout, chunks=list(chunks), pairs=pairs, seconds=seconds)

    # the common mistake: the causal triangle of each block's local positions (is_causal on every block)
    right = impl.block_kind if hasattr(impl, "block_kind") else None
    if right is not None and runs("mistake"):
        impl.block_kind = lambda q_chunk, k_chunk, causal: "diagonal" if causal else "full"
        wrong = impl.ring_attention(*(t.clone() for t in mine[:3]), causal=True)
        impl.block_kind = right
        leaves = [t.clone() for t in full[:3]]
        want_out = impl.shard_sequence(F.scaled_dot_product_attention(*leaves, is_causal=True), rank, n)
        runtime.log(case="mistake", error=runtime.value((wrong.double() - want_out).abs().max()))

    if runs("torch_cp"):
        runtime.log(case="torch_cp", **torch_context_parallel(
            *full[:3], F.scaled_dot_product_attention(*full[:3], is_causal=True)))

    # a few ring-attention steps under the profiler: the K/V exchange beside the block computations
    leaves = [t.clone().requires_grad_() for t in mine[:3]]
    with runtime.profile(wait=1, warmup=1, active=args.profile_steps, name="ring") as prof:
        for _ in range(2 + args.profile_steps) if runs("profile") else ():
            impl.ring_attention(*leaves, causal=True).backward(mine[3])
            prof.step()
    runtime.teardown()


if __name__ == "__main__":
    main()
