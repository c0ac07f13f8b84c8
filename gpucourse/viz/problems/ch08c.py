"""Chapter 08c's problems: the checkpoint interval from your own run's save (Young and Daly, Llama 3's failure rate
scaled to your GPUs), the goodput of a plan with its restarts (training.goodput), and an audit of rare hiccups on
many ranks (training.expected_step_with_stragglers)."""
from __future__ import annotations

from ...models import training
from .base import Problem

DAY = 86400
LLAMA3 = training.LLAMA3_FAILURES
SOURCE = ("Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.4: 419 unexpected "
          "interruptions in a 54-day snapshot on 16,384 H100 GPUs; Young, CACM 1974 and Daly, FGCS 2006")


def _mtbf(gpus):
    llama = training.mean_time_between_failures(LLAMA3["days"] * DAY, LLAMA3["unexpected"])
    return llama, training.scaled_mtbf(llama, LLAMA3["gpus"], gpus)


def _your_interval(save_ms, gpus):
    llama, mtbf = _mtbf(gpus)
    tau = training.young_daly_interval(save_ms / 1e3, mtbf)
    return {"answer": tau, "mtbf_h": mtbf / 3600, "llama_h": llama / 3600, "save_s": save_ms / 1e3,
            "unscaled": training.young_daly_interval(save_ms / 1e3, llama)}


def _goodput(interval_min, lost_s, mtbf_h, restart_min):
    args = (interval_min * 60, lost_s, mtbf_h * 3600)
    keep = training.goodput(*args, restart_min * 60)
    return {"answer": keep, "no_restart": training.goodput(*args), "saving": lost_s / (interval_min * 60 + lost_s)}


def _hiccups(step_s, delay_s, p, ranks):
    return {"answer": training.expected_step_with_stragglers(step_s, delay_s, p, ranks),
            "one_rank": training.expected_step_with_stragglers(step_s, delay_s, p, 1),
            "share": 1 - (1 - p) ** ranks}


PROBLEMS = [
    Problem(
        "08c.your-interval",
        "Your run's blocking save held the training loop {save_ms:g} ms. On {gpus:,} GPUs that fail at Llama 3's "
        "rate (its per-GPU rate, scaled to your count), how many minutes of training between checkpoints does "
        "Young and Daly's sqrt(2 C MTBF) give?",
        inputs={"save_ms": 250.0, "gpus": 1024}, own=("save_ms",), work=_your_interval, unit="min", scale=60,
        digits=2, level="your run", source=SOURCE,
        hint="Llama 3's MTBF is 54 days / 419 on 16,384 GPUs; each GPU fails at the same rate, so on fewer GPUs the "
             "MTBF grows by 16,384 / your count. C in seconds, MTBF in seconds, then the square root.",
        traps={"unscaled": "That used Llama 3's MTBF on 16,384 GPUs: scale it to your GPU count first."},
        solution="MTBF {llama_h:.2f} h on 16,384 GPUs is {mtbf_h:.1f} h on {gpus:,}; sqrt(2 x {save_s:g} s x "
                 "{mtbf_h:.1f} h) = {answer}."),
    Problem(
        "08c.goodput",
        "A job saves a checkpoint every {interval_min} minutes of training; each save costs the loop {lost_s} s; "
        "failures come every {mtbf_h} h on average and each costs a {restart_min}-minute restart plus the work "
        "since the last checkpoint. What share of the wall time is kept work (goodput)?",
        inputs={"interval_min": 30, "lost_s": 20, "mtbf_h": 20, "restart_min": 30}, work=_goodput, unit="%",
        scale=0.01, digits=2, tolerance=0.005, level="combine", source=SOURCE,
        hint="per period (interval + save), the interval is work; a failure costs the restart and half a period on "
             "average, once per MTBF: goodput = interval / period x (1 - (restart + period / 2) / MTBF).",
        traps={"no_restart": "That left out the restart each failure costs."},
        solution="saving costs {saving:.2%} of each period; failures cost ({restart_min} min + half a period) every "
                 "{mtbf_h} h: "
                 "{answer} kept ({no_restart:.2%} without the restarts)."),
    Problem(
        "08c.audit-hiccups",
        "Audit: \"a {delay_s} s hiccup on one GPU in {every:,} steps does not matter\". On {ranks:,} ranks, each "
        "hiccuping independently with probability {p:g} a step, what is the mean synchronous step, in seconds, "
        "for a {step_s} s step?",
        inputs={"step_s": 1.0, "delay_s": 0.4, "p": 1e-3, "every": 1000, "ranks": 16384}, digits=3,
        work=lambda step_s, delay_s, p, every, ranks: _hiccups(step_s, delay_s, p, ranks), unit="s",
        level="audit", source="training.expected_step_with_stragglers: the slowest rank sets a synchronous step's pace",
        hint="the step is slow whenever any rank hiccups: with probability 1 - (1 - p)^ranks.",
        traps={"one_rank": "That is one rank's chance: every step waits for the slowest of all the ranks."},
        solution="1 - (1 - {p:g})^{ranks:,} = {share:.4f} of the steps wait {delay_s} s: {answer} a step."),
]
