"""The 3-D capstone dry-run as Llama 3 405B on its published layout, beside the planner's figures. Not a test.

    python benchmarks/dryrun_llama3_405b.py [--steps 2] [--timeout 900] [--json report.json]

scripts/13_gpt_3d.py --arch llama at Llama 3 405B's shape (126 layers, d_model 16,384, 128 heads, 8 key/value
heads, SwiGLU 53,248, vocabulary 128,256, context 8,192; planner.SHAPES["llama3-405b"]) on 16,384 ranks, tp 8 x pp
16 x dp 128, Llama 3's uneven split (--split llama3: 7, 8 x 14, 7 layers), its global batch of 16M tokens (2,048
sequences: 16 micro-batches of one sequence per dp rank, 1F1B), bf16 parameters, gradients and Adam states,
fake tensors and a fake process group (gpucourse.dryrun): its first and its last rank, the first and the last
pipeline stage. Goal: <= 120 s wall for both ranks side by side and <= 4 GB peak RSS for a rank's process.

Printed per rank, each figure labelled: "dry run" (counted in the rank: torch's MemTracker, the course's recorder,
FlopCounterMode; nothing ran on a GPU, nothing was measured on one) and "modelled" (planner.plan_parallelism for
the same plan), and their ratio:
  memory at the rank's peak, by part (parameters, gradients, optimizer states, activations, other); the model
    states kept between steps;
  bytes and calls per process group (tp, dp, pp, with their global ranks) for one step (the second: the first
    also holds building the model and sharding it);
  FLOPs of a step.
How the script's plan is put to the planner: FSDP2 with reshard_after_forward=False under a pipeline (what Llama
3 describes) keeps parameters, gradients and Adam's states sharded between steps (planned at zero=3: "states") but
gathers the parameters once a step and keeps whole gradients until the last micro-batch (planned at zero=1: the
peak's parts and the collectives); recipe "bf16" (2 + 2 + 4 bytes a parameter, bf16 activations); no
recomputation; vocabulary-parallel embedding and head; sequence parallelism; and what torch's implementation keeps
where Megatron-LM's (the planner's default) differs, named: sp_saves="gathered" (DTensor's sequence parallelism
keeps the gathered input of wq/wk/wv and w1/w3), norm_kernel="composite" (the CPU's RMSNorm keeps fp32 copies; a
GPU's fused kernel would not), loss_parallel=False (the logits gathered whole). Where they differ, the line says
why (see also the docstring of scripts/13_gpt_3d.py).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpucourse  # noqa: E402
from dryrun_scale import PeakRss  # noqa: E402  (psutil sampling of the rank processes' RSS and CPU time)
from gpucourse.chapters import ch12  # noqa: E402
from gpucourse.models import planner  # noqa: E402

SCRIPT = ROOT / "scripts" / "13_gpt_3d.py"
SHAPE = planner.SHAPES["llama3-405b"]
JOB = ch12.llama_job("llama3-405b", **ch12.LLAMA3_405B)  # the script's arguments and the planner's two plans
TP, PP, DP, MICRO = (ch12.LLAMA3_405B[k] for k in ("tp", "pp", "dp", "micro"))
SEQ, WORLD = ch12.LLAMA3_405B["seq"], JOB["world"]
GOAL_S, GOAL_RSS = 120, 4e9
# Why a part or a group's figure differs from the planner's (what the dry run's torch does that the plan leaves out);
# checked on this plan (2026-11-29), see the report
WHY = {
    "grads": "the row-parallel embedding's weight gradient comes out of DTensor's backward (2.13) Replicate: all "
             "128,256 rows, 4.2 GB, on every tp rank, until FSDP keeps its shard: +3.68 GB at the first stage's "
             "peak, which falls in its backward; the planner counts the rank's rows",
    "activations": "a block keeps 160,320 B a token here, the planner 160,256 with torch's implementation named "
                   "(Megatron-LM's would be 78,336; the 64 left: attention's logsumexp). The first stage's peak "
                   "falls at the end of its first micro-batch's backward (when the embedding's whole gradient "
                   "appears, see grads), whose activations are freed by then: 15 of the 16 micro-batches the "
                   "planner counts in flight (0.9375). The last stage also holds torch's pipeline receive buffers, "
                   "one a micro-batch (16 x 33.6 MB), which the planner leaves out",
    "states": "FSDP2 cuts every parameter's first dimension in pieces of ceil(rows / dp): the last dp rank holds "
              "what remains of the vocabulary-parallel head, 30 of its 16,032 rows a tp rank against 126 on the "
              "others; the planner counts an even share",
    "other": "backward's temporaries (and the rotary tables, 4 MB), which the planner does not count",
    "dp": "FSDP2 gathers and reduce-scatters one unit a block plus the stage's root, the planner's ZeRO-1 one "
          "buffer (the same bytes); the last stage also all-reduces its logged loss",
}


def ranks_text(ranks: list[int]) -> str:
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 0
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] (step {step})" if len(ranks) > 3 else str(ranks)


def ratio(a, b) -> str:
    return f"{a / b:6.3f}" if b else "   -  "


def report(rank: dict, index: int) -> None:
    stage, states = JOB["plan"]["stages"][index], JOB["states"]["stages"][index]["states"]
    first, last = index == 0, index == 1
    print(f"\nrank {rank['rank']}: pipeline stage {0 if first else PP - 1} of {PP}, {stage['layers']} layers"
          f"{' + the embedding' if first else ' + the final norm and the head'}; step {rank['step']} "
          f"(of {rank['steps_logged']} logged)")
    print(f"  {'memory at the peak':34} {'dry run':>12} {'modelled':>12} {'dry/modelled':>13}")
    for part in ("params", "grads", "optimizer", "activations", "other"):
        got, want = rank["memory"][part], stage["memory"].get(part, 0)
        why = f"  ({WHY[part]})" if part in WHY and (not want or abs(got / want - 1) > 0.05) else ""
        print(f"  {part:34} {got / 1e9:9.3f} GB {want / 1e9:9.3f} GB {ratio(got, want):>13}{why}")
    print(f"  {'peak (tensors)':34} {rank['peak_bytes'] / 1e9:9.3f} GB {stage['total'] / 1e9:9.3f} GB "
          f"{ratio(rank['peak_bytes'], stage['total']):>13}")
    print("  model states between steps (FSDP's shards; modelled at zero=3)")
    for part in ("params", "grads", "optimizer"):
        got, want = rank["model_states"][part], states[part]
        why = f"  ({WHY['states']})" if abs(got / want - 1) > 0.05 else ""
        print(f"    {part:32} {got / 1e6:9.2f} MB {want / 1e6:9.2f} MB {ratio(got, want):>13}{why}")
    print("  collectives of one step, per process group (bytes in nccl-tests' convention)")
    counted = ch12.counted_groups(rank, JOB["layout"])
    planned = {(c["group"], c["op"]): c for c in stage["collectives"]}
    for key in sorted(set(counted) | set(planned), key=lambda k: ("tp", "dp", "pp").index(k[0])):
        got, want = counted.get(key, {"calls": 0, "bytes": 0, "ranks": None}), planned.get(key, {"calls": 0,
                                                                                               "bytes": 0})
        where = ranks_text(got["ranks"]) if got["ranks"] else ""
        differs = got["calls"] != want["calls"] or abs(got["bytes"] - want["bytes"]) > 0.01 * max(want["bytes"], 1)
        why = f"  ({WHY[key[0]]})" if differs and key[0] in WHY else ""
        print(f"    {key[0]} {key[1]:15} dry run {got['calls']:4} calls {got['bytes'] / 1e9:9.3f} GB | modelled "
              f"{want['calls']:4.0f} calls {want['bytes'] / 1e9:9.3f} GB | bytes {ratio(got['bytes'], want['bytes'])}"
              f"  {where}{why}")
    pal, counter = ch12.modelled_flops(JOB, index)
    print(f"  FLOPs of a step: dry run {rank['flops'] / 1e15:.4f} PFLOP; modelled 6N + 12LdT {pal / 1e15:.4f} "
          f"(ratio {ratio(rank['flops'], pal).strip()}), 6N + 14LdT {counter / 1e15:.4f} "
          f"(ratio {ratio(rank['flops'], counter).strip()})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2, help="steps the ranks run; the last one is reported")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="also write the dry run's report there")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load {load:.1f}: "
          f"scripts/13_gpt_3d.py as Llama 3 405B ({planner.shape_params(SHAPE)['total'] / 1e9:.1f} B parameters) "
          f"on {WORLD:,} ranks (tp {TP} x pp {PP} x dp {DP}), ranks 0 and {WORLD - 1}, fake tensors, "
          f"{MICRO} micro-batches of 1 x {SEQ:,} tokens a dp rank, bf16", flush=True)
    start = time.perf_counter()
    with PeakRss() as rss:
        result = gpucourse.dryrun(SCRIPT, world=WORLD, ranks=[0, WORLD - 1], fake_tensors=True, timeout=args.timeout,
                                  args=[*JOB["args"], "--steps", str(args.steps)], json_path=args.json)
    seconds = time.perf_counter() - start
    cpu = sorted(rss.cpu.values(), reverse=True)[:2]
    ok = seconds <= GOAL_S and rss.peak <= GOAL_RSS
    print(f"dry run: {seconds:.1f} s wall for both ranks side by side (goal <= {GOAL_S} s), "
          f"{' and '.join(f'{c:.0f}' for c in cpu)} CPU s in the two rank processes, peak RSS of a rank "
          f"{rss.peak / 1e9:.2f} GB (goal <= {GOAL_RSS / 1e9:.0f} GB); load {load:.1f} -> {os.getloadavg()[0]:.1f} "
          f"-> {'met' if ok else 'MISSED'}")
    for index, rank in enumerate(result["ranks"]):
        report(rank, index)
    print("\ndry run: counted in the rank's process with fake tensors, on no GPU; modelled: "
          "gpucourse.models.planner.plan_parallelism, same plan (zero=1 for the peak and collectives, zero=3 for "
          "the states between steps). Neither is a measurement.")


if __name__ == "__main__":
    main()
