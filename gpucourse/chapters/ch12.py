"""Chapter 12, at scale, on your laptop: the tables it shows from its runs.

`notebooks/12_at_scale_on_your_laptop.ipynb` imports it by its short name:

    from gpucourse.chapters import ch12
    ch12.dry_vs_real(dry, real)          # the same script dry and real, per rank and group
    job = ch12.llama_job("llama3-405b", **ch12.LLAMA3_405B)   # the 3-D script's arguments and the planner's plans
    ch12.counted_memory(dry, job), ch12.counted_comms(dry, job)   # a dry run of it beside the plans

A table is a `viz.tables.Table` (`@as_table`: the course's one formatting rule, units in its headers).
"""
from __future__ import annotations

import pandas as pd

from ..models import costs, planner
from ..viz.tables import as_table, frame, group_text

# Llama 3 405B's published layout (Grattafiori et al. 2024, section 3.3.2 and Table 4): tp 8 x pp 16 x dp 128 on
# 16,384 H100s, 8K tokens, 16M tokens a step (2,048 sequences: 16 micro-batches of one sequence a dp rank), 1F1B
LLAMA3_405B = {"tp": 8, "pp": 16, "dp": 128, "seq": 8192, "global_batch": 2048, "micro": 16}
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "other")


@as_table
def dry_vs_real(dry: list[dict], real: list[dict]) -> pd.DataFrame:
    """The same script at the same world size, dry (fake process group) and real (a launched job counting with
    $GPUCOURSE_COUNT_FILE): per rank, op and group, the calls and bytes each counted, and whether they agree."""
    rows = []
    for d, r in zip(dry, real):
        real_by = {(c["op"], tuple(c["group"] or [])): c for c in r["comms"]}
        for c in d["comms"]:
            other = real_by.get((c["op"], tuple(c["group"] or [])), {})
            rows.append({"rank": d["rank"], "op": c["op"], "group": group_text(c["group"] or []),
                         "calls, dry": c["calls"], "calls, real": other.get("calls"),
                         "bytes, dry": c["bytes"], "bytes, real": other.get("bytes"),
                         "equal": other.get("calls") == c["calls"] and other.get("bytes") == c["bytes"]})
    return pd.DataFrame(rows).set_index("rank")


@as_table
def plan_memory(plan: dict) -> pd.DataFrame:
    """A plan (models.planner.plan_parallelism), MODELLED: one row per pipeline stage shown (first, last), its
    layers, parameters held, memory by part and in all, in GiB (a device's "80 GB" is 80 GiB)."""
    rows = [{"stage (modelled)": st["stage"], "layers": st["layers"],
             "params held (billions)": round(st["params"] / 1e9, 2),
             **{f"{k} (GiB)": round(v / 2**30, 1) for k, v in st["memory"].items()},
             "total (GiB)": round(st["total"] / 2**30, 1)} for st in plan["stages"]]
    return pd.DataFrame(rows).set_index("stage (modelled)")


@as_table
def published_runs(readings: list[dict]) -> pd.DataFrame:
    """Published runs (models.published.read_published) beside the planner's estimate of the same layout: the
    paper's figures in the "reported" column, the model's in the "modelled" ones, throughput counted the paper's
    way (Megatron-LM's and MT-NLG's hardware FLOPs include the recomputed forward; Llama 3's are model FLOPs)."""
    rows = []
    for r in readings:
        p, lay = r["plan"], r["plan"]["layout"]
        schedule = p["schedule"] + (f", v {p['virtual_stages']}" if p["schedule"] == "interleaved" else "")
        rows.append({"run": r["name"], "GPUs": f"{p['gpus']:,}",
                     "dp×tp×pp×cp": "×".join(str(lay[k]) for k in ("dp", "tp", "pp", "cp")),
                     "schedule": schedule, "micro-batches": p["micro_batches"],
                     "reported (TFLOP/s a GPU)": r["reported"]["tflops_per_gpu"],
                     "modelled (TFLOP/s a GPU)": round(r["modelled_tflops"]),
                     "modelled / reported": round(r["ratio"], 2), "modelled MFU (%)": round(100 * p["mfu"], 1),
                     "assumed": r["assumed"]})
    return pd.DataFrame(rows).set_index("run")


@as_table
def step_terms(plan: dict) -> pd.DataFrame:
    """What each term of a plan's step-time estimate (models.planner.plan_parallelism) costs: seconds a step and
    share of the step, largest first; terms that cost nothing are left out."""
    rows = [{"term (modelled)": k, "seconds a step": round(v, 3), "share (%)": round(100 * v / plan["step_s"], 1)}
            for k, v in sorted(plan["terms"].items(), key=lambda kv: -kv[1]) if v > 0]
    return pd.DataFrame(rows).set_index("term (modelled)")


def llama_job(model, *, tp: int, pp: int, dp: int, seq: int, global_batch: int, micro: int,
              norm_kernel: str = "composite") -> dict:
    """scripts/13_gpt_3d.py --arch llama as `model` (a planner.SHAPES name or a shape dict) on tp x pp x dp ranks,
    and the same job put to the planner: {"world", "args" (the script's, for gpucourse.dryrun), "plan", "states"}.

    The script's plan in the planner's terms: FSDP2 with reshard_after_forward=False under a pipeline (what Llama
    3 describes) keeps parameters, gradients and Adam's states sharded between steps ("states": planned at zero=3)
    but gathers the parameters once a step and keeps whole gradients until the last micro-batch ("plan": zero=1,
    for the peak's parts and the collectives); recipe bf16 (2 + 2 + 4 bytes a parameter, bf16 activations), no
    recomputation, a vocabulary-parallel embedding and head, sequence parallelism, Llama 3's uneven split. The
    planner's options name what torch's implementation keeps where Megatron-LM's (the planner's default) differs:
    sp_saves "gathered" (DTensor's sequence parallelism keeps the gathered input of wq/wk/wv and w1/w3), loss_parallel
    False (the head's logits gathered whole, the plain cross-entropy) and, for a dry run on the CPU, norm_kernel
    "composite" (torch's CPU RMSNorm keeps fp32 copies; a GPU's fused kernel, norm_kernel="fused", does not). The
    shape's norms are the script's RMSNorms."""
    shape = planner.SHAPES[model] if isinstance(model, str) else model
    shape = {"norm": "rmsnorm", **shape}
    split = planner.llama3_stage_layers(shape["layers"], pp)
    args = ["--arch", "llama", "--pp", pp, "--dp", dp, "--tp", tp, "--layers", shape["layers"], "--split", "llama3",
            "--d-model", shape["d_model"], "--heads", shape["heads"], "--kv-heads", shape["kv_heads"],
            "--ffn", shape["ffn"], "--vocab", shape["vocab"], "--context", seq, "--batch", global_batch,
            "--micro", micro, "--schedule", "1f1b", "--dtype", "bfloat16", "--no-check", "--steps", 2]
    plan = dict(gpus=tp * pp * dp, dp=dp, tp=tp, pp=pp, seq=seq, global_batch=global_batch,
                micro_batch=global_batch // dp // micro, schedule="1f1b", recompute="none", recipe="bf16",
                vocab_parallel=True, sequence_parallel=True, stage_layers=split, sp_saves="gathered",
                norm_kernel=norm_kernel, loss_parallel=False)
    return {"world": tp * pp * dp, "args": [str(a) for a in args], "shape": shape,
            "layout": {"tp": tp, "pp": pp, "dp": dp}, "plan": planner.plan_parallelism(shape, zero=1, **plan),
            "states": planner.plan_parallelism(shape, zero=3, **plan), "seq": seq, "tokens": global_batch // dp * seq}


def _ratio(a, b):
    return round(a / b, 3) if b else None


@as_table
def counted_memory(dry: dict, job: dict) -> pd.DataFrame:
    """A dry run of llama_job's script (its first and last rank) beside the planner's plan of the same job: memory
    at the rank's peak by part and the model states kept between steps, counted (dry run) and modelled, in
    decimal bytes, and their ratio."""
    rows = []
    for index, rank in enumerate(dry["ranks"]):
        stage, states = job["plan"]["stages"][index], job["states"]["stages"][index]["states"]
        parts = [(f"{part} at the peak", rank["memory"][part], stage["memory"].get(part, 0)) for part in MEMORY_PARTS]
        parts += [("peak", rank["peak_bytes"], stage["total"])]
        parts += [(f"{part} between steps", rank["model_states"][part], states[part])
                  for part in ("params", "grads", "optimizer")]
        rows += [{"rank": rank["rank"], "what": what, "dry run": got, "modelled": want,
                  "dry run / modelled": _ratio(got, want)} for what, got, want in parts]
    return frame(rows, ["rank", "what"], bytes_columns=["dry run", "modelled"], decimal=True)


def counted_groups(rank: dict, layout: dict) -> dict:
    """{(group, op): {"calls", "bytes", "ranks"}} of a dry-run rank's step, groups named by their ranks' stride on
    the (pp, dp, tp) mesh (tp innermost: 1, dp: tp, pp: tp x dp) and ops as the planner names them. A fused send +
    receive (batch_isend_irecv, 1F1B's steady state) is one send and one receive; the recorder counts its calls,
    not its bytes: each gets the size of the stage's plain sends."""
    tp, dp, pp = layout["tp"], layout["dp"], layout["pp"]
    by_stride = {stride: dim for dim, degree, stride in (("pp", pp, tp * dp), ("dp", dp, tp), ("tp", tp, 1))
                 if degree > 1}

    def name(group):
        return by_stride[group[1] - group[0]]

    out, fused = {}, []
    for c in rank["comms"]:
        if c["op"] == "batch_isend_irecv":
            fused.append(c)
            continue
        op = {"isend": "send", "irecv": "recv"}.get(c["op"], c["op"].removesuffix("_single"))
        row = out.setdefault((name(c["group"]), op), {"calls": 0, "bytes": 0, "ranks": c["group"]})
        row["calls"] += c["calls"]
        row["bytes"] += c["bytes"]
    message = next((r["bytes"] / r["calls"] for (g, _), r in out.items() if g == "pp" and r["calls"]), 0)
    for c in fused:
        for op in ("send", "recv"):
            row = out.setdefault(("pp", op), {"calls": 0, "bytes": 0, "ranks": c["group"]})
            row["calls"] += c["calls"]
            row["bytes"] += c["calls"] * message
    return out


@as_table
def counted_comms(dry: dict, job: dict) -> pd.DataFrame:
    """Per rank and process group, the collectives of one step, counted (dry run: calls and bytes in nccl-tests'
    convention) and modelled (the plan's), with the bytes' ratio."""
    rows = []
    for index, rank in enumerate(dry["ranks"]):
        counted = counted_groups(rank, job["layout"])
        planned = {(c["group"], c["op"]): c for c in job["plan"]["stages"][index]["collectives"]}
        for key in sorted(set(counted) | set(planned), key=lambda k: (("tp", "dp", "pp").index(k[0]), k[1])):
            got = counted.get(key, {"calls": 0, "bytes": 0, "ranks": []})
            want = planned.get(key, {"calls": 0, "bytes": 0})
            rows.append({"rank": rank["rank"], "group": key[0], "op": key[1], "ranks": group_text(got["ranks"] or []),
                         "calls, dry run": got["calls"], "calls, modelled": round(want["calls"]),
                         "bytes, dry run": got["bytes"], "bytes, modelled": want["bytes"],
                         "bytes: dry run / modelled": _ratio(got["bytes"], want["bytes"])})
    return frame(rows, ["rank", "group", "op"], bytes_columns=["bytes, dry run", "bytes, modelled"], decimal=True)


def modelled_flops(job: dict, index: int) -> tuple[float, float]:
    """FLOPs of one step on one rank of stage `index` (0: the first shown, 1: the last), modelled two ways: 6 N +
    12 L d T a token (costs.model_flops_per_token, PaLM's convention, the planner's) over the stage's matmul weights
    and layers on one tp rank, and 6 N + 14 L d T (what FlopCounterMode counts: the flash kernel's backward
    recomputes the scores, 5 matmuls against 2 forward)."""
    shape, tp = job["shape"], job["layout"]["tp"]
    layers = job["plan"]["stages"][index]["layers"]
    p = planner.shape_params(shape)
    n = (layers * p["layer_active"] + (p["head"] if index == 1 else 0)) / tp
    pal = costs.model_flops_per_token(n, layers, shape["d_model"] / tp, job["seq"]) * job["tokens"]
    return pal, pal + 2 * layers * shape["d_model"] / tp * job["seq"] * job["tokens"]


def agreement(dry: dict, job: dict) -> dict:
    """{rank: {quantity: counted / modelled}} for what a dry run of llama_job's script and the planner both give:
    the model states between steps (the worst of the three), the bytes of the tp, the dp and the pp group, the
    FLOPs (against 6 N + 14 L d T, what FlopCounterMode counts) and the activations at the peak."""
    out = {}
    for index, rank in enumerate(dry["ranks"]):
        stage, states = job["plan"]["stages"][index], job["states"]["stages"][index]["states"]
        counted = counted_groups(rank, job["layout"])
        planned = {}
        for c in stage["collectives"]:
            planned[c["group"]] = planned.get(c["group"], 0) + c["bytes"]
        moved = {g: sum(r["bytes"] for (grp, _), r in counted.items() if grp == g) for g in ("tp", "dp", "pp")}
        worst = max((rank["model_states"][k] / states[k] for k in ("params", "grads", "optimizer")),
                    key=lambda r: abs(r - 1))
        out[rank["rank"]] = {"model states": worst,
                             **{f"{g} bytes": _ratio(moved[g], planned.get(g, 0)) for g in ("tp", "dp", "pp")},
                             "FLOPs": rank["flops"] / modelled_flops(job, index)[1],
                             "activations": rank["memory"]["activations"] / stage["memory"]["activations"]}
    return out
