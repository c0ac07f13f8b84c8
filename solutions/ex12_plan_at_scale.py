"""Exercise 12: plan a training job at scale.

Task
----
Chapter 12 fitted Llama 3 70B on 1,024 H100s with tp 8 and the fewest pipeline stages (planner.smallest_fitting):
a plan that fits, not the fastest. Write `plan_training(model, gpus, system, seq, global_batch)`: the fastest
plan that keeps the rules below, as a dict of plan_parallelism's keyword arguments,

    {"dp": 128, "tp": 8, "pp": 1, "cp": 1, "micro_batch": 2, "recompute": "selective", "zero": 1,
     "schedule": "1f1b", "virtual_stages": 1}

for training `model` (a planner.SHAPES name or a shape dict) on `gpus` GPUs of `system` (costs.SYSTEMS) with
sequences of `seq` tokens and `global_batch` sequences a step. Search the layouts with
`gpucourse.models.planner.plan_parallelism`, which models each plan's memory per GPU and its MFU. Every choice
has a price in the planner: more pipeline stages save memory and cost a bubble (shrunk by an interleaved,
zero-bubble or DualPipeV schedule, which cost pipeline sends or memory of their own); recomputation saves
activations and runs the forward again; ZeRO shards the model states over the data-parallel ranks, and with
several micro-batches a step stages 2 and 3 pay their gradient reduce-scatter (and ZeRO-3 its weight
all-gathers) on every micro-batch.

Rules
-----
The grader checks each one itself, with the planner, on every case:
- A plan sets dp, tp and pp, and may set cp, micro_batch, recompute, zero, schedule and virtual_stages (the
  planner's defaults otherwise); plan_parallelism must accept it.
- dp x tp x pp x cp == gpus, all whole numbers; cp = 1 (every case is 8K tokens or fewer, where Llama 3 used
  no context parallelism).
- Tensor parallelism stays inside a node: tp divides the node size (costs.SYSTEMS[system]["node_size"]), and
  the attention heads (and the key/value heads, or is a multiple of them).
- The pipeline fills: global_batch / (dp x micro_batch) micro-batches a step, at least pp of them (DualPipeV
  needs 2 x pp: the planner refuses fewer).
- recompute one of planner.RECOMPUTE; zero 0, 1, 2 or 3; schedule one of planner.SCHEDULES, with
  virtual_stages chunks per rank: a power of two, at least 2 for "interleaved" (at most one layer a chunk) and
  1 otherwise. With pp = 1 there is no pipeline to schedule: the schedule is "1f1b".
- The plan fits: plan_parallelism(...)["fits"], its reserved bytes per GPU (the peak plus headroom for the CUDA
  context, NCCL's buffers and fragmentation) within the device's 80 GiB.
- It is fast: its modelled MFU is at least 90 % of the best MFU a plan that keeps these rules reaches. The
  grader holds that best MFU per case as a number; finding the plan that reaches it is the exercise.

Graded by `gpucourse grade ex12`: a 1-rank job calls your function on each case (Llama 3 70B on 1,024 H100s,
Llama 3 8B on 64, Llama 3 405B on 16,384, a 1.3 B GPT on 8, and chapter 09's capstone on 1,024) and records the
plans; the grader process judges them with the planner. The capstone's plan is also dry-run for real
(`gpucourse.dryrun`, its first and last rank at world 1,024): it must run, fit, and keep each TP group in a node.
For the big models memory is the planner's model: a fake-tensor dry run of each candidate would take minutes
(benchmarks/dryrun_scale.py), too long for a grading. Trying every plan the rules allow takes about a second.
"""
from gpucourse import costs
from gpucourse.models import planner


def divisors(n: int) -> list[int]:
    """Every whole number that divides n, smallest first."""
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_training(model, gpus: int, system: str = "h100-sxm", seq: int = 8192, global_batch: int = 512) -> dict:
    """The fastest plan (modelled MFU) that keeps the rules and fits: a dict of plan_parallelism's arguments."""
    ### BEGIN SOLUTION
    ### HINT: loop over tp (divisors of the node size that split the heads), pp, micro_batch, schedule (and virtual_stages), recompute and zero; keep the plan that fits with the highest plan_parallelism(...)["mfu"]
    shape = planner.shape_of(model)
    node = costs.SYSTEMS[system]["node_size"]
    best, best_mfu = None, float("-inf")
    for tp in divisors(node):
        if shape["heads"] % tp or shape["kv_heads"] % tp and tp % shape["kv_heads"]:
            continue  # each tp rank takes whole heads
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if pp > shape["layers"] or global_batch % dp:
                continue
            schedules = [("1f1b", 1)]
            if pp > 1:  # a pipeline's schedules; interleaved with every power of two chunks its layers allow
                schedules += [("zero-bubble", 1), ("dualpipev", 1)]
                schedules += [("interleaved", v) for v in (2, 4, 8, 16, 32, 64) if pp * v <= shape["layers"]]
            for micro_batch in divisors(global_batch // dp):
                if global_batch // (dp * micro_batch) < pp:
                    continue  # fewer micro-batches than stages: the pipeline never fills
                for schedule, virtual_stages in schedules:
                    for recompute in planner.RECOMPUTE:
                        for zero in (0, 1, 2, 3):
                            plan = {"dp": dp, "tp": tp, "pp": pp, "cp": 1, "micro_batch": micro_batch,
                                    "recompute": recompute, "zero": zero, "schedule": schedule,
                                    "virtual_stages": virtual_stages}
                            try:
                                got = planner.plan_parallelism(model, gpus=gpus, seq=seq, global_batch=global_batch,
                                                               system=system, **plan)
                            except ValueError:
                                continue  # e.g. DualPipeV with fewer than 2 x pp micro-batches
                            if got["fits"] and got["mfu"] > best_mfu:
                                best, best_mfu = plan, got["mfu"]
    if best is None:
        raise ValueError(f"no plan for {gpus} GPUs fits in memory: more GPUs, or a smaller model")
    return best
    ### END SOLUTION
