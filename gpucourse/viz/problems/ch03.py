"""Chapter 03's problems: scaling efficiency, the DDP step with its buckets hidden behind backward, the world size
where a ring turns communication-bound (costs.data_parallel), the overlap cost of your own run (ddpsteps), and an audit
of Megatron-LM's 76 % scaling efficiency."""
from __future__ import annotations

from ...models import costs, ddpsteps
from .base import Problem

NDR = "InfiniBand NDR 400G"
MiB = 2 ** 20
MEGATRON_2019 = ("Shoeybi et al., Megatron-LM: Training Multi-Billion Parameter Language Models Using Model "
                 "Parallelism, arXiv 1909.08053, abstract: 15.1 PetaFLOPs on 512 GPUs, 76 % scaling efficiency "
                 "against a single GPU sustaining 39 TeraFLOPs")


def _efficiency(base_per_s, n, per_s):
    return {"answer": costs.scaling_efficiency(per_s, base_per_s, n), "speedup": per_s / base_per_s,
            "ideal": n * base_per_s}


def _step(compute_ms, params_m, n, link, bucket_mib):
    ic = costs.INTERCONNECTS[link]
    grad = params_m * 1e6 * 4
    kw = dict(bucket_bytes=bucket_mib * MiB)
    step = costs.ddp_step_time(compute_ms / 1e3, grad, n, ic.alpha, ic.beta, **kw)
    alone = costs.ddp_step_time(compute_ms / 1e3, grad, n, ic.alpha, ic.beta, overlap=False, **kw)
    return {"answer": step.step, "comm_ms": step.comm * 1e3, "backward_ms": step.backward * 1e3,
            "exposed_ms": step.exposed * 1e3, "buckets": step.num_buckets, "grad_GB": grad / 1e9,
            "no_overlap": alone.step, "compute_only": compute_ms / 1e3}


def _last_bucket(compute_ms, params_m, n, link, bucket_mib):
    out = _step(compute_ms, params_m, n, link, bucket_mib)
    return {**out, "answer": out["exposed_ms"] / 1e3, "all_comm": out["comm_ms"] / 1e3}


def _comm_bound(compute_ms, params_m, link, bucket_mib):
    ic = costs.INTERCONNECTS[link]
    grad = params_m * 1e6 * 2  # bf16 gradients
    worlds = [2 ** k for k in range(1, 20)]
    steps = {n: costs.ddp_step_time(compute_ms / 1e3, grad, n, ic.alpha, ic.beta, bucket_bytes=bucket_mib * MiB)
             for n in worlds}
    first = next(n for n in worlds if steps[n].efficiency < 0.5)
    before = first // 2
    return {"answer": first, "eff": steps[first].efficiency, "eff_before": steps[before].efficiency,
            "before": before, "exposed_ms": steps[first].exposed * 1e3, "buckets": steps[first].num_buckets,
            "comm_ms": steps[first].comm * 1e3, "backward_ms": steps[first].backward * 1e3,
            "latency_ms": steps[first].num_buckets * costs.collective_time("all_reduce", 0, first, ic.alpha, 0.0)
            * 1e3}


def _overlap(compute_ms, comm_ms, both_ms):
    measured, clipped = ddpsteps.overlap_cost({"compute": compute_ms, "comm": comm_ms, "both": both_ms})
    return {"answer": clipped, "measured": measured, "longer": max(compute_ms, comm_ms),
            "shorter": min(compute_ms, comm_ms), "over_sum": both_ms / (compute_ms + comm_ms)}


def _megatron(job_pflops, gpus, one_gpu_tflops):
    return {"answer": costs.scaling_efficiency(job_pflops * 1e15, one_gpu_tflops * 1e12, gpus),
            "ideal_PF": gpus * one_gpu_tflops / 1e3}


PROBLEMS = [
    Problem(
        "03.scaling-efficiency",
        "Weak scaling, the batch per GPU fixed: one GPU trains {base_per_s} samples/s, {n} GPUs together train "
        "{per_s:,} samples/s. What is the scaling efficiency?",
        inputs={"base_per_s": 410, "n": 8, "per_s": 2900}, work=_efficiency, unit="%", scale=0.01, digits=1,
        hint="compare with perfect scaling, n times one GPU's throughput: throughput(n) / (n x throughput(1)).",
        solution="ideal: {n} x {base_per_s} = {ideal:,} samples/s; {per_s:,} / {ideal:,} = {answer} (a speed-up of "
                 "{speedup:.2f} on {n} GPUs)."),
    Problem(
        "03.ddp-step",
        "DDP, fp32 gradients of a {params_m} M-parameter model, {n} GPUs over {link}, {bucket_mib} MiB buckets, "
        "forward + backward {compute_ms} ms (backward 2/3 of it), overlap on. By costs.ddp_step_time, how long is a "
        "step?",
        inputs={"compute_ms": 100, "params_m": 350, "n": 64, "link": NDR, "bucket_mib": 25}, work=_step, unit="ms",
        scale=1e-3, digits=1, level="combine", source=costs.INTERCONNECTS[NDR].source,
        hint="the buckets can hide behind backward only (2/3 of the compute), and never the last one: exposed = "
             "max(last bucket, all buckets - backward).",
        traps={"no_overlap": "That added all the communication: with overlap, backward hides part of it.",
               "compute_only": "That hid all the communication: only backward's share can hide it, and here the "
                               "all-reduces take longer than backward."},
        solution="{grad_GB:.1f} GB in {buckets} buckets: {comm_ms:.1f} ms of all-reduces; backward {backward_ms:.1f} "
                 "ms hides all but {exposed_ms:.1f} ms; step {compute_ms} + {exposed_ms:.1f} = {answer}."),
    Problem(
        "03.last-bucket",
        "The same model with a slower forward + backward of {compute_ms} ms ({n} GPUs, {link}, {bucket_mib} MiB "
        "buckets): how much communication is exposed per step?",
        inputs={"compute_ms": 300, "params_m": 350, "n": 64, "link": NDR, "bucket_mib": 25}, work=_last_bucket,
        unit="ms", scale=1e-3, digits=2, source=costs.INTERCONNECTS[NDR].source,
        hint="backward is now longer than all the all-reduces, so only the last bucket, ready when backward ends, "
             "is left: one bucket's all-reduce.",
        traps={"all_comm": "That is all the buckets' all-reduces: the ones before the last ran during backward."},
        solution="all-reduces {comm_ms:.1f} ms < backward {backward_ms:.0f} ms: only the last bucket is exposed, "
                 "{answer}."),
    Problem(
        "03.comm-bound-world",
        "Weak scaling of a {params_m} M-parameter model (bf16 gradients, {bucket_mib} MiB buckets, compute "
        "{compute_ms} ms a step) with one flat ring over {link}: from which world size (a power of 2) is the "
        "efficiency below 50 %?",
        inputs={"compute_ms": 50, "params_m": 100, "link": NDR, "bucket_mib": 25}, work=_comm_bound,
        unit="GPUs", digits=0, tolerance=0, level="combine", source=costs.INTERCONNECTS[NDR].source,
        hint="the bandwidth term saturates at 2 S beta, but each bucket's 2(n-1) alpha grows with n: find where the "
             "exposed communication passes the compute.",
        solution="at {before:,} GPUs the efficiency is {eff_before:.1%}; at {answer} {eff:.1%}: {buckets} buckets "
                 "x 2(n-1) alpha alone take {latency_ms:.1f} ms of the {comm_ms:.1f} ms of all-reduces; backward "
                 "hides {backward_ms:.1f} ms, {exposed_ms:.1f} ms stay exposed against {compute_ms} ms of compute."),
    Problem(
        "03.your-overlap-cost",
        "Your chapter 03 overlap benchmark: compute alone {compute_ms} ms, the all-reduces alone {comm_ms} ms, both "
        "at once {both_ms} ms (medians). What overlap cost does ddpsteps.overlap_cost give (0 to 1)?",
        inputs={"compute_ms": 40.0, "comm_ms": 12.0, "both_ms": 49.0}, own=("compute_ms", "comm_ms", "both_ms"),
        work=_overlap, unit="", digits=2, tolerance=0.05, level="your run",
        hint="side by side should cost the longer of the two; what it costs beyond that, over the shorter one, is "
             "the overlap cost: 0 free, 1 no better than one after the other.",
        traps={"over_sum": "That is both over compute + comm, not the share of the shorter one that was lost."},
        solution="(both - longer) / shorter = ({both_ms} - {longer}) / {shorter} = {answer}."),
    Problem(
        "03.audit-megatron-76",
        "Audit: Megatron-LM (2019) sustains {job_pflops} PFLOP/s on {gpus} GPUs against a single GPU sustaining "
        "{one_gpu_tflops} TFLOP/s, and calls it 76 % scaling efficiency. What does costs.scaling_efficiency give?",
        inputs={"job_pflops": 15.1, "gpus": 512, "one_gpu_tflops": 39}, work=_megatron, unit="%", scale=0.01,
        digits=1, level="audit", source=MEGATRON_2019,
        hint="a FLOP rate scales like a throughput: the job's rate over gpus x the one GPU's (a weak-scaling "
             "efficiency: the model and batch grew with the GPUs).",
        solution="ideal: {gpus} x {one_gpu_tflops} TFLOP/s = {ideal_PF:.2f} PFLOP/s; {job_pflops} / {ideal_PF:.2f} = "
                 "{answer}: the paper's 76 %, rounded."),
]
