"""Chapter 08b's problems: what a hang idles at torch's default timeout (training.hang_gpu_hours), and on Llama 3's
record; how many steps the Flight Recorder's buffer holds on a 3-D job (the planner's collectives); a rank-0-only save
against the watchdog's timeout (planner); and what your run's uneven shards cost under Join (training.uneven_shards).
"""
from __future__ import annotations

from ...models import planner, training
from ...run.forensics import FR_ENTRIES
from .base import Problem
from .ch13 import LLAMA, LLAMA3_LAYOUT, llama3_plan

DAY = 86400
LLAMA3 = training.LLAMA3_FAILURES
TIMEOUTS = training.DEFAULT_TIMEOUTS_S
TORCH_TIMEOUTS = ("torch.distributed.constants (default_pg_timeout, default_pg_nccl_timeout): what init_process_group "
                  "waits with no timeout given, 30 min for gloo, 10 for NCCL; chapter 08 reads them from torch")
LLAMA3_FAULTS = ("Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.4: 419 unexpected "
                 "interruptions in a 54-day snapshot on 16,384 H100 GPUs")


def _hang(gpus, restart_min):
    wait = TIMEOUTS["nccl"] + restart_min * 60
    return {"answer": training.hang_gpu_hours(gpus, wait), "timeout_min": TIMEOUTS["nccl"] / 60,
            "wait_min": wait / 60, "gloo": training.hang_gpu_hours(gpus, TIMEOUTS["gloo"] + restart_min * 60),
            "no_restart": training.hang_gpu_hours(gpus, TIMEOUTS["nccl"])}


def _shorter_timeout(timeout_min, days, unexpected, gpus):
    saved_s = TIMEOUTS["nccl"] - timeout_min * 60  # per hang
    per_hang = training.hang_gpu_hours(gpus, saved_s)
    return {"answer": unexpected * per_hang, "per_hang": per_hang, "saved_min": saved_s / 60,
            "default_min": TIMEOUTS["nccl"] / 60, "share": unexpected * saved_s / (days * DAY)}


def _fr_steps(entries, model, tp, pp, dp, seq, global_batch, micro):
    stage = llama3_plan(model, tp, pp, dp, seq, global_batch, micro)["stages"][0]
    per_step = sum(c["calls"] for c in stage["collectives"])
    calls = {f"{c['group']}_{c['op']}": c["calls"] for c in stage["collectives"]}
    return {"answer": entries / per_step, "per_step": per_step, "one_micro": entries / (per_step / micro), **calls}


def _rank0_save(model, write_gbs):
    total = planner.shape_params(model)["total"]
    b = planner.BYTES
    size = total * (b["param"] + b["optimizer"])
    wait = size / (write_gbs * 1e9)
    return {"answer": wait, "size_TB": size / 1e12, "total_B": total / 1e9, "per_param": b["param"] + b["optimizer"],
            "default_min": TIMEOUTS["nccl"] / 60,
            "over_min": (wait - TIMEOUTS["nccl"]) / 60, "with_grads": total * sum(b.values()) / (write_gbs * 1e9)}


def _join(most, fewest):
    cost = training.uneven_shards([most, fewest])
    return {"answer": cost["idle_share"], **cost}


PROBLEMS = [
    Problem(
        "08b.hang-gpu-hours",
        "A {gpus:,}-GPU job hangs: one rank skipped a collective and the others wait in it. Nothing notices but NCCL's "
        "watchdog, at torch's default timeout for NCCL; then the job restarts, which takes {restart_min} minutes. "
        "How many GPU-hours does the hang idle?",
        inputs={"gpus": 1024, "restart_min": 5}, work=_hang, unit="GPU-h", digits=1, source=TORCH_TIMEOUTS,
        hint="every GPU waits the whole time: NCCL's default timeout (10 minutes; gloo's is 30) plus the restart, "
             "times the GPUs.",
        traps={"gloo": "That used gloo's default timeout (30 minutes): NCCL's is 10.",
               "no_restart": "That left out the restart after the watchdog ends the job."},
        solution="{timeout_min:g} min to the timeout + {restart_min} min to restart = {wait_min:g} min, on "
                 "{gpus:,} GPUs: {answer}."),
    Problem(
        "08b.audit-timeout",
        "Audit: \"shortening NCCL's timeout from its default to {timeout_min} minutes saves nothing worth the risk\". "
        "Had each of Llama 3's {unexpected} unexpected interruptions in {days} days on {gpus:,} GPUs left the job "
        "hung until the watchdog fired (assumed), how many GPU-hours would the shorter timeout have saved?",
        inputs={"timeout_min": 2, "days": 54, "unexpected": 419, "gpus": 16384}, work=_shorter_timeout,
        unit="GPU-h", digits=0, level="audit", source=f"{LLAMA3_FAULTS}; {TORCH_TIMEOUTS}",
        hint="each hang ends (default - shorter) minutes sooner, on every GPU; then once per interruption.",
        traps={"per_hang": "That is one hang's saving: there were hundreds of interruptions."},
        solution="{saved_min:g} min sooner ({default_min:g} min default) on {gpus:,} GPUs = {per_hang:,.0f} GPU-h a "
                 "hang, x {unexpected} = {answer}: {share:.1%} of the {days} days, if every interruption hung. The "
                 "risk is the other side: a timeout shorter than the slowest legitimate wait ends healthy jobs."),
    Problem(
        "08b.fr-buffer-steps",
        "The launcher keeps {entries:,} Flight Recorder entries a rank. A first-stage rank of {model} on tp {tp} x pp "
        "{pp} x dp {dp} ({micro} micro-batches a step, sequence parallel) records one entry per collective, send and "
        "receive, as the planner counts them. How many steps back does its dump reach?",
        inputs={"entries": FR_ENTRIES, **LLAMA}, work=_fr_steps, unit="steps", digits=2, level="combine",
        source=LLAMA3_LAYOUT,
        hint="count a step's calls in every group the rank is in: tp's all-gathers and reduce-scatters (per layer "
             "and micro-batch), dp's once a step, pp's sends and receives per micro-batch.",
        traps={"one_micro": "That counted one micro-batch's calls: a step runs them all."},
        solution="tp {tp_all_gather} all-gathers + {tp_reduce_scatter} reduce-scatters, dp {dp_all_gather} + "
                 "{dp_reduce_scatter}, pp {pp_send} sends + {pp_recv} receives = {per_step} entries a step: "
                 "{entries:,} hold {answer}. Size the buffer to hold a few steps of the largest job."),
    Problem(
        "08b.rank0-save",
        "A job gathers {model}'s whole state to rank 0 (bf16 weights, fp32 master weights and Adam's two moments), "
        "which writes it alone at {write_gbs} GB/s while every other rank waits in the next collective. How many "
        "minutes do they wait?",
        inputs={"model": "llama3-70b", "write_gbs": 1.0}, work=_rank0_save, unit="min", scale=60, digits=1,
        level="combine", source="Llama 3 70B's shape: Grattafiori et al. 2024, Table 3 (planner.SHAPES); "
                                + TORCH_TIMEOUTS,
        hint="the state is 14 bytes a parameter (2 of weights, 12 of optimizer: the gradients are not saved); its "
             "size over the write rate is the wait. Then compare it with NCCL's default timeout.",
        traps={"with_grads": "That saved the fp32 gradients too: a checkpoint leaves them out."},
        solution="{total_B:.1f} B parameters x {per_param} bytes = {size_TB:.2f} TB at {write_gbs} GB/s: {answer}, "
                 "{over_min:.1f} min past NCCL's default {default_min:g}-minute timeout: the watchdog ends a healthy "
                 "job. Raise the timeout above the slowest legitimate wait, or save sharded (dcp.save, chapter 08)."),
    Problem(
        "08b.your-uneven-join",
        "Your run's two ranks held {most} and {fewest} training batches. Your fix trains the steps every rank can. "
        "torch's Join trains every batch instead: a rank out of batches joins the others' all-reduces with zeros "
        "until the last rank is done. Under Join, what share of the ranks' steps trains nothing?",
        inputs={"most": 7, "fewest": 4}, own=("most", "fewest"), work=_join, unit="%", scale=0.01, digits=1,
        level="your run",
        hint="under Join every rank steps as often as the rank with the most batches; the others' extra steps "
             "shadow it with zeros.",
        traps={"dropped_share": "That is the share of the data your fix never trains on: under Join every batch "
                                "is trained, and the cost is the steps the finished rank idles."},
        solution="Join runs {join_steps} steps on each of 2 ranks; {shadowed} of those {join_steps} x 2 train "
                 "nothing: {answer}. Your fix runs {common_steps} steps and leaves {dropped} batches out "
                 "({dropped_share:.1%} of the data)."),
]
