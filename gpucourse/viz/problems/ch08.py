"""Chapter 08's problems: where each parallelism goes (costs.collective_time inside and across nodes), a
checkpoint's size (planner), the mean time between failures and the Young/Daly checkpoint interval from Llama 3's
record, the time lost to checkpoints and failures (training), and your run's redone steps."""
from __future__ import annotations

from ...models import costs, planner, training
from .base import Problem

NVLINK = "NVLink 4 (H100 SXM)"
NDR = "InfiniBand NDR 400G"
DAY = 86400
LLAMA3_FAULTS = ("Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.4: 466 job "
                 "interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs, 47 planned and 419 "
                 "unexpected; section 3.3.1: Tectonic storage sustains 2 TB/s (7 TB/s peak), checkpoints of 1 MB to "
                 "4 GB a GPU; Young, CACM 1974 and Daly, FGCS 2006 for the interval")


def _tp_across(layers, seq, hidden, tp):
    size = seq * hidden * 2  # one micro-batch's bf16 activations
    inside, across = costs.INTERCONNECTS[NVLINK], costs.INTERCONNECTS[NDR]
    t_in = 4 * layers * costs.collective_time("all_reduce", size, tp, inside.alpha, inside.beta)
    t_out = 4 * layers * costs.collective_time("all_reduce", size, tp, across.alpha, across.beta)
    return {"answer": t_out - t_in, "inside_ms": t_in * 1e3, "across_ms": t_out * 1e3, "size_MiB": size / 2 ** 20,
            "calls": 4 * layers, "across": t_out}


def _checkpoint(model):
    total = planner.shape_params(model)["total"]
    b = planner.BYTES
    return {"answer": total * (b["param"] + b["optimizer"]), "total_B": total / 1e9, "param": b["param"],
            "optimizer": b["optimizer"], "with_grads": total * sum(b.values()), "per_gpu_MB":
            total * (b["param"] + b["optimizer"]) / 16384 / 1e6}


def _mtbf(days, unexpected, planned):
    return {"answer": training.mean_time_between_failures(days * DAY, unexpected), "hours": days * 24,
            "all": training.mean_time_between_failures(days * DAY, unexpected + planned)}


def _interval(model, days, unexpected, storage_tbs):
    ckpt = _checkpoint(model)["answer"]
    save = ckpt / (storage_tbs * 1e12)
    mtbf = training.mean_time_between_failures(days * DAY, unexpected)
    return {"answer": training.young_daly_interval(save, mtbf), "save_s": save, "mtbf_h": mtbf / 3600,
            "size_TB": ckpt / 1e12, "mtbf_s": mtbf, "naive": 2 * save * mtbf}


def _lost(model, days, unexpected, storage_tbs, restart_min):
    step = _interval(model, days, unexpected, storage_tbs)
    lost = training.checkpoint_overhead(step["answer"], step["save_s"], step["mtbf_s"], restart_min * 60)
    return {**lost, "answer": lost["total"], "tau_min": step["answer"] / 60, "save_s": step["save_s"],
            "mtbf_h": step["mtbf_h"], "no_restart": lost["saving"] + lost["rework"]}


def _your_redone(ckpt_every, steps, redone):
    expected = training.checkpoint_overhead(ckpt_every, 0.0, steps)["rework"]  # one failure in `steps` steps
    return {"answer": expected, "half": ckpt_every / 2, "actual": redone / steps}


PROBLEMS = [
    Problem(
        "08.tp-across-nodes",
        "A {layers}-layer model, hidden {hidden:,}, sequence {seq:,}, one sequence a micro-batch, bf16, tp = {tp}. "
        "Its four all-reduces a layer per micro-batch: how many ms more do they take across nodes ({ndr}) than "
        "inside one ({nvlink})?",
        inputs={"layers": 32, "seq": 4096, "hidden": 4096, "tp": 8, "ndr": NDR, "nvlink": NVLINK},
        work=lambda layers, seq, hidden, tp, ndr, nvlink: _tp_across(layers, seq, hidden, tp), unit="ms",
        scale=1e-3, digits=1, source=costs.INTERCONNECTS[NDR].source,
        hint="4 ring all-reduces of the activations (s x h x 2 bytes) per layer, on every layer: price each with "
             "alpha-beta on both links and take the difference.",
        traps={"across": "That is the whole time across nodes: the question asks how much more than inside."},
        solution="{calls} all-reduces of {size_MiB:.0f} MiB: {inside_ms:.1f} ms over NVLink, {across_ms:.1f} ms "
                 "over InfiniBand: {answer} more per micro-batch, exposed."),
    Problem(
        "08.checkpoint-size",
        "A checkpoint of {model} holds the bf16 weights and the optimizer's fp32 master weights and Adam's two "
        "moments (the gradients are not saved). How many TB is it?",
        inputs={"model": "llama3-405b"}, work=_checkpoint, unit="TB", scale=1e12, digits=2,
        source="Llama 3 405B's shape: Grattafiori et al. 2024, Table 3 (planner.SHAPES)",
        hint="2 bytes of weights plus 12 of optimizer state (4 master + 4 + 4) a parameter: 14 bytes, not the 18 "
             "of model states in training (the fp32 gradients are recomputed, not saved).",
        traps={"with_grads": "That saved the fp32 gradients too: a step recomputes them, a checkpoint leaves them "
                             "out."},
        solution="{total_B:.1f} B parameters x ({param} + {optimizer}) bytes = {answer} ({per_gpu_MB:.0f} MB a GPU "
                 "over 16,384)."),
    Problem(
        "08.llama3-mtbf",
        "Llama 3 405B's pre-training saw {unexpected} unexpected interruptions (and {planned} planned ones) in a "
        "{days}-day snapshot. What is the mean time between unexpected failures of the job, in hours?",
        inputs={"days": 54, "unexpected": 419, "planned": 47}, work=_mtbf, unit="h", scale=3600, digits=2,
        source=LLAMA3_FAULTS,
        hint="divide the time by the failures; planned interruptions (maintenance) are scheduled, not failures a "
             "checkpoint interval has to absorb.",
        traps={"all": "That counted the planned interruptions too."},
        solution="{hours:,} h / {unexpected} = {answer}."),
    Problem(
        "08.young-daly-llama3",
        "{model}'s checkpoint (bf16 weights + fp32 master and Adam's moments) written at Llama 3's sustained storage "
        "rate of {storage_tbs} TB/s, failures at Llama 3's rate ({unexpected} in {days} days): by Young and Daly's "
        "sqrt(2 C MTBF), how many minutes of training between checkpoints?",
        inputs={"model": "llama3-405b", "days": 54, "unexpected": 419, "storage_tbs": 2}, work=_interval,
        unit="min", scale=60, digits=1, level="combine", source=LLAMA3_FAULTS,
        hint="C is the seconds one save takes (the checkpoint's bytes over the storage's rate), MTBF the seconds "
             "between failures; both in seconds, then the square root.",
        traps={"naive": "That is 2 C MTBF without its square root."},
        solution="C = {size_TB:.2f} TB / {storage_tbs} TB/s = {save_s:.2f} s; MTBF = {mtbf_h:.2f} h; sqrt(2 x "
                 "{save_s:.2f} s x {mtbf_s:,.0f} s) = {answer}."),
    Problem(
        "08.audit-effective-time",
        "Audit: Llama 3 reports more than 90 % effective training time. With the Young/Daly interval above, a "
        "{restart_min}-minute restart after each failure (assumed), saving blocking training: what share of the "
        "time is lost, to first order?",
        inputs={"model": "llama3-405b", "days": 54, "unexpected": 419, "storage_tbs": 2, "restart_min": 10},
        work=_lost, unit="%", scale=0.01, digits=1, level="audit", source=LLAMA3_FAULTS,
        hint="three terms: C / tau (saving), tau / 2 / MTBF (work redone, half an interval a failure on average), "
             "and restart / MTBF; at the Young/Daly interval the first two are equal.",
        traps={"no_restart": "That left out the restart after each failure, the largest term here."},
        solution="tau = {tau_min:.1f} min: saving {saving:.2%} + redone work {rework:.2%} + restarts {restart:.2%} = "
                 "{answer} lost, about {no_restart:.1%} without the restarts: consistent with more than 90 % "
                 "effective."),
    Problem(
        "08.your-redone-steps",
        "Your chapter 08 run checkpoints every {ckpt_every} steps of {steps}, and after the kill it redid {redone} "
        "steps. If a job fails once at a random step, what share of its steps does it redo on average?",
        inputs={"ckpt_every": 5, "steps": 40, "redone": 3}, own=("ckpt_every", "steps", "redone"),
        work=_your_redone, unit="%", scale=0.01, digits=2, level="your run",
        hint="a failure redoes the steps since the last checkpoint: uniformly between 0 and the interval, half an "
             "interval on average.",
        traps={"actual": "That is what your run redid, for its one kill: the average over where a failure falls is "
                         "half an interval."},
        solution="half an interval, {half:g} steps, of {steps}: {answer} (your run's kill: {actual:.2%})."),
]
