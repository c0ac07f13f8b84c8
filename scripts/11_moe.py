"""Chapter 11: a mixture-of-experts layer, and expert parallelism checked against one process.

Every rank builds the same MoE layer (a router and E expert MLPs) from a fixed seed, and every rank's tokens
(seed + rank), so each can also run the single-process layer on every rank's tokens as the reference.

    11_moe.py --mode check --router learned skewed --capacity-factor 1.0 1.25
                               expert parallelism (all_to_all_single, uneven splits) vs the single-process layer,
                               one case per router and factor: outputs, gradients (tokens, router, experts),
                               tokens per expert, dropped tokens, load-balancing loss, all-to-all bytes
    11_moe.py --mode timing    step time of the expert-parallel layer, one router per --router
    11_moe.py --mode mistake --mistake no-counts|wrong-order|silent-drop
    11_moe.py --mode mesh --dp D   experts split over "ep" and replicated over "dp" on a 2D DeviceMesh
    11_moe.py --mode router    routing decisions and gating weights of a bf16 router and of an fp32 router in a
                               bf16 layer, against float64, as the logits grow; the router z-loss of each size
    11_moe.py --mode balance   a skewed router for --steps steps, balanced by nothing, by the Switch loss, or by
                               DeepSeek-V3's bias (auxiliary-loss-free): max / mean expert load per step
    11_moe.py --mode dropless  capacity with padding (static shapes, equal splits) vs dropless (every assignment,
                               uneven splits), each checked against one process; rows, padding, drops, FLOPs
Several modes in one launch: --mode router balance dropless.

--shared S adds S shared experts that every token goes through (replicated on every rank, like the router);
--fine M splits every expert M ways: M x experts of ffn / M, top M x k (DeepSeekMoE's two changes).

--priority picks which assignments an expert over capacity keeps: "token" (the default, and the exercise's rule:
token 0's k choices, then token 1's, ...) or "choice" (GShard: every token's first choice before any second
choice). Check records count the first choices each rule drops on this rank's routing.

The capacity rule and the all-to-all are exercise ex11's kept_assignments and AllToAll, from --impl (the
learner's file): the reference solution stands in while they raise NotImplementedError; a student release has
none, and the script stops saying what to write. Every record names which ran ("impl").

Routers: "learned" (the router's own logits), "skewed" (the same plus a large bias towards a few experts,
the collapse that the load-balancing loss fights), "uniform" (a perfectly balanced assignment, round robin:
the routing the volume formula assumes).

    gpucourse dryrun scripts/11_moe.py --world 1024 -- --mode timing --router uniform --experts 1024 --tokens 512

A dry run (fake process group) exchanges no counts: every rank is assumed to route its tokens as this rank does
(uniform: T·k/E rows per expert from every rank, where T·k is a multiple of E, hence --tokens 512 above; --router
skewed for a skew), stated beside the report's figures.
"""
import argparse
import contextlib
import dataclasses
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpucourse import costs, exercises, runtime


class CommCounter:
    """Wraps dist.all_to_all_single and the collectives a mistake might use: (op, bytes sent to other ranks)."""

    def __init__(self):
        self.calls, self.on = [], False
        real = dist.all_to_all_single

        def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            if self.on:
                n, r = dist.get_world_size(group), dist.get_rank(group)
                rows = input_split_sizes or [input.shape[0] // n] * n
                per_row = input[0].numel() * input.element_size() if input.shape[0] else 0
                self.calls.append({"op": "all_to_all_single", "bytes": (sum(rows) - rows[r]) * per_row,
                                   "dtype": str(input.dtype).removeprefix("torch.")})
            return real(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        dist.all_to_all_single = counted

    def take(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


# --- the MoE layer -------------------------------------------------------------------------------------
def mlp(hidden: int, ffn: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class MoE(nn.Module):
    """Router (linear, softmax, top-k) and E expert MLPs. The weights of a token's k experts are their router
    probabilities (not renormalised), so the router gets a gradient through the output. `ex11`: exercise ex11's
    module, whose kept_assignments is the capacity rule and whose AllToAll the expert-parallel layer sends with."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, ex11, shared: int = 0):
        super().__init__()
        self.top_k, self.num_experts, self.ex11 = top_k, num_experts, ex11
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(mlp(hidden, ffn) for _ in range(num_experts))
        self.shared = nn.ModuleList(mlp(hidden, ffn) for _ in range(shared))  # every token, no router

    def route(self, x: torch.Tensor, router: str):
        """(probabilities (T, E), expert ids (T, k), weights (T, k))."""
        logits = self.router(x)
        if router == "skewed":  # a router that has collapsed onto a few experts
            logits = logits + torch.linspace(4.0, 0.0, self.num_experts, device=x.device)
        probs = logits.softmax(-1)
        if router == "uniform":  # round robin: every expert gets exactly T*k/E assignments
            t = torch.arange(x.shape[0], device=x.device)[:, None]
            ids = (t * self.top_k + torch.arange(self.top_k, device=x.device)) % self.num_experts
        else:
            ids = probs.topk(self.top_k, dim=-1).indices
        return probs, ids, probs.gather(1, ids)


def shared_output(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The shared experts' sum (DeepSeekMoE): every token, on every rank; zeros without shared experts."""
    return sum((expert(x) for expert in moe.shared), torch.zeros_like(x))


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2, large when the logits are."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def load_balancing_loss(probs: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e: f_e the fraction of assignments routed to expert
    e, P_e the mean router probability of e. 1.0 when both are uniform; up to E when all go to one expert."""
    f = torch.bincount(ids.reshape(-1), minlength=num_experts).float() / ids.numel()
    return num_experts * (f * probs.mean(0)).sum()


PRIORITIES = ("token", "choice")


def kept_mask(moe: MoE, ids: torch.Tensor, capacity: int | None, priority: str = "token") -> torch.Tensor:
    """(T, k): an assignment is kept when fewer than `capacity` earlier ones chose its expert. "Earlier":
    priority "token" reads the assignments row-major (token 0's k choices, then token 1's, ...), so a token's
    second choice can take a place before a later token's first choice; "choice" reads them column-major (every
    token's first choice, then every second choice: GShard's rule). Either way an expert keeps min(capacity,
    assignments to it): the rule changes which are dropped, not how many. Token order is ex11's kept_assignments;
    first choices first is the same count on the transposed ids."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    if priority == "token":
        return moe.ex11.kept_assignments(ids, moe.num_experts, capacity)
    return moe.ex11.kept_assignments(ids.t().contiguous(), moe.num_experts, capacity).t().contiguous()


def moe_single(moe: MoE, x, ids, weights, capacity, priority="token"):
    """The layer in one process: each kept assignment through its expert, weighted, summed per token."""
    kept = kept_mask(moe, ids, capacity, priority)
    y = shared_output(moe, x)
    for e, expert in enumerate(moe.experts):
        t, j = ((ids == e) & kept).nonzero(as_tuple=True)
        if len(t):
            y = y.index_add(0, t, weights[t, j, None] * expert(x[t]))
    return y, kept


# --- expert parallelism: dispatch, local experts, combine ---------------------------------------------
@contextlib.contextmanager
def dispatch_rules(moe: MoE, priority: str, mistake: str | None):
    """While ex11's dispatch runs: its capacity rule reads first choices first (priority "choice"), and for the
    "no-counts" mistake its counts exchange becomes "they send me what I send them" (an int64 all_to_all_single
    copies its input instead of exchanging it)."""
    rule, exchange = moe.ex11.kept_assignments, dist.all_to_all_single
    if priority == "choice":
        moe.ex11.kept_assignments = lambda ids, e, c: rule(ids.t().contiguous(), e, c).t().contiguous()
    if mistake == "no-counts":
        def assumed(output, input, *args, **kwargs):
            if input.dtype == torch.int64:
                return output.copy_(input)
            return exchange(output, input, *args, **kwargs)
        dist.all_to_all_single = assumed
    elif runtime.dry_run():  # the fake group delivers no counts: each rank is assumed to route as this one does
        def dry_counts(output, input, *args, **kwargs):
            work = exchange(output, input, *args, **kwargs)  # issued (and counted) as in a real run
            if input.dtype == torch.int64:  # from every rank, what this rank sends its own experts
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
                n, r = dist.get_world_size(group), dist.get_rank(group)
                output.copy_(input.view(n, -1)[r].repeat(n))
            return work
        dist.all_to_all_single = dry_counts
    try:
        yield
    finally:
        moe.ex11.kept_assignments, dist.all_to_all_single = rule, exchange


def let_the_fake_group_move_rows_one_way() -> None:
    """Dry runs: an all_to_all_single with rows one way only (this rank's experts receive none but it gets its own
    rows back, or the reverse) is what real groups do; the fake group refuses it. It moves nothing anyway, so it is
    given a receive buffer shaped like the send: the call and its send buffer, what is counted, stay the same."""
    exchange = dist.all_to_all_single

    def one_way(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if (output.numel() == 0) != (input.numel() == 0):
            output, output_split_sizes = torch.empty_like(input), input_split_sizes
        return exchange(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = one_way


def moe_expert_parallel(moe: MoE, x, ids, weights, capacity, group=None, mistake=None, times=None,
                        priority="token"):
    """This rank's tokens through the experts spread over `group`: (output, kept mask, rows per expert here).
    Exercise ex11's dispatch and combine move the rows; each mistake is one change around them. Dropless when
    capacity is None: every assignment is sent and computed, the splits as uneven as the routing.
    times: a dict to whose "dispatch" and "expert" lists the seconds of the dispatch (counts and rows) and of
    this rank's experts in forward are appended."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    per = moe.num_experts // n
    t0 = time.perf_counter()
    with dispatch_rules(moe, priority, mistake):
        local, local_ids, state = moe.ex11.dispatch(x, ids, moe.num_experts, capacity, group)
    t1 = time.perf_counter()
    local_ids = local_ids.to(x.device)
    out = torch.zeros_like(local)
    for e in range(per):  # a looped matmul: each expert on its rows, however many (a grouped GEMM on GPUs)
        rows = (local_ids == e).nonzero().squeeze(1)
        out = out.index_copy(0, rows, moe.experts[r * per + e](local[rows]))
    if times is not None:
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        times["dispatch"].append(t1 - t0)
        times["expert"].append(time.perf_counter() - t1)
    if mistake == "wrong-order":  # the rows left back in the order they were sent (by expert)
        state = dataclasses.replace(state, order=torch.arange(len(state.order), device=x.device))
    placed = moe.ex11.combine(out, state, group)                    # each row back at its (token, choice)
    y = (placed * weights[..., None]).sum(1) + shared_output(moe, x)
    kept = torch.ones_like(state.kept) if mistake == "silent-drop" else state.kept  # silent: drops not reported
    return y, kept, torch.bincount(local_ids, minlength=per)


def moe_padded(moe: MoE, x, ids, weights, capacity, group=None, mistake=None, priority="token"):
    """Capacity with padding (GShard's static shapes): each rank sends every expert exactly `capacity` rows,
    real or zero, so the splits are equal and known in advance (no counts exchange); the padding rows travel
    and are computed like real ones, and assignments beyond capacity are dropped. (output, kept mask, rows each
    local expert computed)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    E, k, H = moe.num_experts, ids.shape[1], x.shape[1]
    per, C = E // n, capacity
    if C is None or mistake:
        raise ValueError("the padded layer needs a capacity (its buffers are capacity rows per expert) and runs "
                         "no mistake")
    kept = kept_mask(moe, ids, C, priority)
    flat, keep = ids.reshape(-1), kept.reshape(-1)
    earlier = (flat[:, None] == flat[None, :]) & keep[None, :]         # kept assignments to the same expert
    slot = earlier.tril(-1).sum(1)                                      # ... before this one: its row in the slab
    idx = keep.nonzero().squeeze(1)
    where = flat[idx] * C + slot[idx]                                   # row in this rank's (E x C) send buffer
    buf = x.new_zeros(E * C, H).index_copy(0, where, x[idx // k])
    local = moe.ex11.AllToAll.apply(buf, [per * C] * n, [per * C] * n, group).view(n, per, C, H)
    out = torch.stack([moe.experts[r * per + e](local[:, e].reshape(n * C, H)).view(n, C, H)
                       for e in range(per)], 1)                         # padding rows computed too
    back = moe.ex11.AllToAll.apply(out.reshape(n * per * C, H), [per * C] * n, [per * C] * n, group)
    placed = x.new_zeros(flat.numel(), H).index_copy(0, idx, back[where])
    y = (placed.view(*ids.shape, H) * weights[..., None]).sum(1) + shared_output(moe, x)
    return y, kept, torch.full((per,), n * C)


# --- the runs ------------------------------------------------------------------------------------------
def build(args, dev, ex11):
    torch.manual_seed(args.seed)  # the same layer on every rank
    return MoE(args.hidden, args.ffn, args.experts, args.top_k, ex11, args.shared).to(dev)


def probe_ex11(ex11, dev) -> None:
    """kept_assignments and AllToAll once, one row to each rank: raises NotImplementedError while either is a stub."""
    n = dist.get_world_size()
    ex11.kept_assignments(torch.zeros(1, 1, dtype=torch.long, device=dev), 1, 1)
    ex11.AllToAll.apply(torch.zeros(n, 1, device=dev), [1] * n, [1] * n, None)


def tokens_of(source: int, args, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `source`'s tokens and upstream gradient, the same wherever they are made."""
    g = torch.Generator().manual_seed(1000 + source)
    return (torch.randn(args.tokens, args.hidden, generator=g).to(dev),
            torch.randn(args.tokens, args.hidden, generator=g).to(dev))


def max_diff(a, b) -> float | None:
    """None in a dry run, where no value means anything."""
    return 0.0 if a is None and b is None else runtime.value((a.detach().double() - b.detach().double()).abs().max())


def worst(diffs) -> float | None:
    diffs = list(diffs)
    return None if None in diffs else max(diffs)


def grads(moe: MoE, experts) -> dict:
    """{name: gradient or zeros} of the router, the shared experts and the given routed experts."""
    out = {"router.weight": moe.router.weight.grad}
    for name, p in moe.shared.named_parameters():
        out[f"shared.{name}"] = p.grad
    for e in experts:
        for name, p in moe.experts[e].named_parameters():
            out[f"experts.{e}.{name}"] = p.grad if p.grad is not None else torch.zeros_like(p)
    return out


def check(args, ctx, counter, dev, ex11, router, capacity_factor, group=None, dp_group=None, sources=None,
          priority="token", layer=moe_expert_parallel):
    """Expert parallel over `group` (`layer`: dropless-capable or padded) vs one process on the tokens of
    `sources` (every rank in the 1-D case)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    sources = list(range(ctx.world_size)) if sources is None else sources
    per = args.experts // n
    capacity = costs.moe_capacity(args.tokens, args.top_k, args.experts, capacity_factor) \
        if capacity_factor > 0 else None
    ref_moe = build(args, dev, ex11)
    ref = {}
    for s in sources:  # the single-process layer, on every source rank's tokens, each with its own capacity
        x, gy = tokens_of(s, args, dev)
        x = x.requires_grad_()
        probs, ids, w = ref_moe.route(x, router)
        y, kept = moe_single(ref_moe, x, ids, w, capacity, priority)
        (y * gy).sum().backward()
        ref[s] = {"y": y.detach(), "x.grad": x.grad, "kept": kept, "ids": ids,
                  "aux": load_balancing_loss(probs, ids, args.experts).item()}
    moe = build(args, dev, ex11)
    me = ctx.rank
    x, gy = tokens_of(me, args, dev)
    x = x.requires_grad_()
    probs, ids, w = moe.route(x, router)
    counter.on = True
    y, kept, rows_here = layer(moe, x, ids, w, capacity, group, args.mistake, priority=priority)
    forward_calls = counter.take()
    (y * gy).sum().backward()
    backward_calls = counter.take()
    counter.on = False
    mine = list(range(r * per, (r + 1) * per))
    got, want = grads(moe, mine), grads(ref_moe, mine)
    if dp_group is not None:  # data parallel: the replicas' gradients summed (sum loss, no averaging)
        for g in got.values():
            dist.all_reduce(g, group=dp_group)
    replicated = [name for name in got if not name.startswith("experts.")]  # router, shared experts
    for name in replicated:  # replicated over the experts' group too: each rank holds a partial sum
        dist.all_reduce(got[name], group=group)
    diffs = {"output": max_diff(y, ref[me]["y"]), "tokens.grad": max_diff(x.grad, ref[me]["x.grad"]),
             "router.grad": max_diff(got.pop("router.weight"), want.pop("router.weight"))}
    if moe.shared:
        diffs["shared grads"] = worst(max_diff(got.pop(k), want.pop(k)) for k in replicated[1:])
    diffs["experts' grads"] = worst(max_diff(got[k], want[k]) for k in got)
    dropped = int((~kept).sum())
    first_kept = {p: kept_mask(moe, ids, capacity, p)[:, 0] for p in PRIORITIES}  # same routing, both rules
    return {"diffs": diffs, "dropped": dropped, "priority": priority,
            "first_choices_dropped": {p: int((~k).sum()) for p, k in first_kept.items()},
            "first_choices_only_token_drops": int((~first_kept["token"] & first_kept["choice"]).sum()),
            "dropped_single": int((~ref[me]["kept"]).sum()),
            "zero_output_tokens": int((y.detach().abs().sum(1) == 0).sum()),
            "tokens_per_expert": torch.bincount(ids.reshape(-1), minlength=args.experts).tolist(),
            "rows_per_local_expert": rows_here.tolist(), "capacity": capacity,
            "aux_loss": load_balancing_loss(probs, ids, args.experts).item(), "kept": int(kept.sum()),
            "forward_calls": forward_calls, "backward_calls": backward_calls,
            "formula_bytes": costs.expert_parallel_all_to_all_bytes(args.tokens, args.top_k, args.hidden, n, 4)}


def timing(args, ctx, dev, ex11):
    """Median step time (forward + backward) of the expert-parallel layer, the median time this rank's experts
    took in forward, and the rows they processed."""
    capacity = None  # every assignment is processed: imbalance shows as work, not as drops
    moe = build(args, dev, ex11)
    x, gy = tokens_of(ctx.rank, args, dev)
    times, rows, parts = [], None, {"dispatch": [], "expert": []}
    for step in range(args.warmup + args.steps):
        dist.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, ids, w = moe.route(x, args.router[0])
        y, _, rows = moe_expert_parallel(moe, x, ids, w, capacity, times=parts)
        (y * gy).sum().backward()
        dist.barrier()  # the step ends when the slowest rank is done
        if dev.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        runtime.log(step=step)  # a dry run reports the last step logged
    median = {name: sorted(t[args.warmup:])[len(t[args.warmup:]) // 2] for name, t in parts.items()}
    return {"step_s": sorted(times)[len(times) // 2], "expert_s": median["expert"],
            "dispatch_s": median["dispatch"], "rows_here": int(rows.sum())}


def router_precision(args, ctx, dev, ex11) -> list[dict]:
    """The router of a bf16 layer (its input x in bf16) computed in bf16 and in fp32, against float64 on the
    same x, with the router's weights scaled so that the logits grow: tokens whose top-k set differs from
    float64's, the largest relative error of a chosen expert's gating weight, and the z-loss of the logits."""
    moe = build(args, dev, ex11)
    x = tokens_of(ctx.rank, args, dev)[0].bfloat16()  # what a bf16 layer hands its router
    out = []
    for scale in args.logit_scale:
        w = moe.router.weight.detach() * scale
        exact = x.double() @ w.double().t()
        want_ids = exact.topk(args.top_k).indices
        want_w = exact.softmax(-1).gather(1, want_ids)
        for dtype in (torch.bfloat16, torch.float32):
            logits = (x.to(dtype) @ w.to(dtype).t()).float()
            ids = logits.topk(args.top_k).indices
            flipped = (ids.sort(1).values != want_ids.sort(1).values).any(1)
            weight_err = ((logits.softmax(-1).double().gather(1, want_ids) - want_w).abs() / want_w).max()
            out.append({"scale": scale, "router_dtype": str(dtype).removeprefix("torch."),
                        "z_loss": z_loss(exact).item(), "max_abs_logit": exact.abs().max().item(),
                        "tokens_flipped": int(flipped.sum()), "weight_rel_err": weight_err.item()})
    return out


def balance(args, ctx, dev, ex11, method: str) -> dict:
    """A router skewed towards the first experts (a learnable logit bias starting at 4 ... 0) for args.steps steps
    of fresh tokens, balanced by `method`: "none"; "switch", SGD on alpha x the Switch loss (the router's
    gradients averaged over the ranks, as data parallelism would); "bias", DeepSeek-V3's auxiliary-loss-free
    rule: a per-expert bias added to the scores for the top-k choice only, moved by gamma towards balance after
    each step (minus if the expert was over the mean load, plus if under). The load is the whole batch's: every
    rank's assignments per expert, all-reduced. Only balancing trains here: no task loss."""
    n, E = ctx.world_size, args.experts
    moe = build(args, dev, ex11)
    logit_bias = torch.linspace(4.0, 0.0, E, device=dev).requires_grad_()
    select_bias = torch.zeros(E, device=dev)
    ratio, aux, bias_range = [], [], []
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(
            10_000 * (step + 1) + ctx.rank)).to(dev)
        probs = (moe.router(x) + logit_bias).softmax(-1)
        ids = (probs.detach() + select_bias).topk(args.top_k).indices  # the bias picks; probs stay the weights
        load = torch.bincount(ids.reshape(-1), minlength=E).float()
        dist.all_reduce(load)
        loss = load_balancing_loss(probs, ids, E)
        ratio.append((load.max() / load.mean()).item())
        aux.append(loss.item())
        if method == "switch":
            params = [moe.router.weight, logit_bias]
            grads_ = torch.autograd.grad(args.alpha * loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads_):
                    dist.all_reduce(g)
                    p -= args.lr * g / n
        elif method == "bias":
            select_bias += args.gamma * torch.sign(load.mean() - load)
        bias_range.append((select_bias.max() - select_bias.min()).item())
    return {"max_over_mean": ratio, "aux_loss": aux, "select_bias_range": bias_range}


def dropless_vs_padded(args, ctx, counter, dev, ex11) -> list[dict]:
    """The same tokens through the padded layer (capacity from the first --capacity-factor) and the dropless
    one, each checked against one process with the same rule, and each forward's FLOPs counted on this rank."""
    factor = args.capacity_factor[0]
    if factor <= 0:
        raise ValueError("--mode dropless compares with capacity and padding: give --capacity-factor > 0")
    out = []
    for name, layer, f in (("padded", moe_padded, factor), ("dropless", moe_expert_parallel, 0.0)):
        rec = check(args, ctx, counter, dev, ex11, args.router[0], f, layer=layer)
        moe = build(args, dev, ex11)
        x = tokens_of(ctx.rank, args, dev)[0]
        with torch.no_grad(), FlopCounterMode(display=False) as flops:
            _, ids, w = moe.route(x, args.router[0])
            layer(moe, x, ids, w, rec["capacity"])
        counter.take()
        out.append({"layer": name, "flops": flops.get_total_flops(), **rec})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default=str(exercises.exercises_dir() / "ex11_expert_parallel.py"),
                        help="the file defining kept_assignments and AllToAll (exercise ex11)")
    parser.add_argument("--mode", nargs="+", choices=("check", "timing", "mistake", "mesh", "router", "balance",
                                                      "dropless"), default=["check"], help="one or several")
    parser.add_argument("--router", nargs="+", choices=("learned", "skewed", "uniform"), default=["learned"],
                        help="check mode: one case per router and capacity factor; other modes: the first")
    parser.add_argument("--mistake", choices=("no-counts", "wrong-order", "silent-drop"))
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", nargs="+", type=float, default=[0.0],
                        help="0: no capacity (nothing dropped); several: check mode runs each")
    parser.add_argument("--priority", choices=PRIORITIES, default="token",
                        help="which assignments an expert over capacity keeps (check mode)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1, help="mesh mode: data-parallel degree")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared", type=int, default=0, help="shared experts: every token, on every rank")
    parser.add_argument("--fine", type=int, default=1,
                        help="split each expert this many ways: experts x M, ffn / M, top-k x M (DeepSeekMoE)")
    parser.add_argument("--logit-scale", nargs="+", type=float, default=[1.0, 4.0, 16.0],
                        help="router mode: the router's weights times each of these")
    parser.add_argument("--alpha", type=float, default=0.01, help="balance mode: the Switch loss's weight")
    parser.add_argument("--lr", type=float, default=50.0, help="balance mode: the router's SGD learning rate")
    parser.add_argument("--gamma", type=float, default=0.01, help="balance mode: the bias update speed")
    args = parser.parse_args()
    if args.fine < 1 or args.ffn % args.fine:
        parser.error(f"--fine {args.fine} must be >= 1 and divide --ffn {args.ffn}")
    args.experts, args.ffn, args.top_k = args.experts * args.fine, args.ffn // args.fine, args.top_k * args.fine
    ctx = runtime.setup(seed=0)
    dev = ctx.device
    runtime.assume(f"tokens per expert: every rank routes its {args.tokens} tokens as this rank does ({args.router[0]} "
                   "router): each receives from every rank the counts it sends its own experts")  # dry runs only
    if "mistake" in args.mode and not args.mistake:
        parser.error("--mode mistake needs --mistake no-counts, wrong-order or silent-drop")
    ep = ctx.world_size // args.dp if "mesh" in args.mode else ctx.world_size
    if "mesh" in args.mode and ctx.world_size % args.dp:
        raise ValueError(f"--dp {args.dp} does not divide the world size {ctx.world_size}")
    if args.experts % ep:
        raise ValueError(f"--experts {args.experts} is not divisible by the expert-parallel size {ep}: "
                         f"choose a multiple of {ep}")
    ex11, source = exercises.load_for_chapter(args.impl, "ex11_expert_parallel", partial(probe_ex11, dev=dev))
    if ex11 is None:
        raise SystemExit(f"this chapter's layer runs exercise ex11's kept_assignments and AllToAll: {source}")
    log = partial(runtime.log, impl=source)  # every record says whose ex11 pieces ran
    if runtime.dry_run():
        let_the_fake_group_move_rows_one_way()
    counter = CommCounter()
    for mode in args.mode:
        run_mode(mode, args, ctx, counter, dev, ex11, log, ep)
    if ctx.rank == 0:
        print(f"{ctx.world_size} rank(s): {' '.join(args.mode)} done ({', '.join(args.router)} router)", flush=True)
    runtime.teardown()


def run_mode(mode, args, ctx, counter, dev, ex11, log, ep) -> None:
    """One --mode's cases, each logged as a record with its "case"."""
    if mode == "timing":
        log(case=f"timing-{args.router[0]}", router=args.router[0], **timing(args, ctx, dev, ex11))
    elif mode == "router":
        for rec in router_precision(args, ctx, dev, ex11):
            log(case="router", **rec)
    elif mode == "balance":
        for method in ("none", "switch", "bias"):
            log(case="balance", method=method, **balance(args, ctx, dev, ex11, method))
    elif mode == "dropless":
        for rec in dropless_vs_padded(args, ctx, counter, dev, ex11):
            log(case="dropless", router=args.router[0], **rec)
    elif mode == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(dev.type, (args.dp, ep), mesh_dim_names=("dp", "ep"))
        ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
        # the reference: one process on the tokens of this rank's expert-parallel group
        ep_ranks = dist.get_process_group_ranks(ep_group)
        rec = check(args, ctx, counter, dev, ex11, args.router[0], args.capacity_factor[0], group=ep_group,
                    dp_group=dp_group, sources=list(range(ctx.world_size)))
        log(case="mesh", mesh=mesh.mesh.tolist(), ep_ranks=ep_ranks,
            dp_ranks=dist.get_process_group_ranks(dp_group), **rec)
    elif mode == "check":
        for router in args.router:
            for factor in args.capacity_factor:
                log(case="check", router=router, capacity_factor=factor, shared=args.shared, fine=args.fine,
                    **check(args, ctx, counter, dev, ex11, router, factor, priority=args.priority))
    else:
        log(case=f"mistake-{args.mistake}", router=args.router[0],
            **check(args, ctx, counter, dev, ex11, args.router[0], args.capacity_factor[0]))


if __name__ == "__main__":
    main()
