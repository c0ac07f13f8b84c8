"""Chapter 08c's problems: the checkpoint interval from your own run's save (Young and Daly, Llama 3's failure rate
scaled to your GPUs), the goodput of a plan with its restarts (training.goodput), what an asynchronous save gains
at each save's own interval, one slow rank's cost to every step (training.synchronous_step_time), and an audit of
rare hiccups on many ranks (training.expected_step_with_stragglers)."""
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


def _async_gain(gpus, blocking_s, async_s, lag_s):
    _, mtbf = _mtbf(gpus)
    tau_b, tau_a = training.young_daly_interval(blocking_s, mtbf), training.young_daly_interval(async_s, mtbf)
    blocking = training.goodput(tau_b, blocking_s, mtbf)
    kept = training.goodput(tau_a, async_s, mtbf, lag_s=lag_s)
    return {"answer": kept - blocking, "blocking": blocking, "async": kept, "tau_b_min": tau_b / 60,
            "tau_a_min": tau_a / 60, "mtbf_h": mtbf / 3600,
            "same_interval": training.goodput(tau_b, async_s, mtbf, lag_s=lag_s) - blocking}


def _one_slow(ranks, busy_s, sync_s, slow_pct):
    slowed = busy_s * (1 + slow_pct / 100)
    healthy = training.synchronous_step_time([busy_s] * ranks, sync_s)
    step = training.synchronous_step_time([slowed] + [busy_s] * (ranks - 1), sync_s)
    mean = training.synchronous_step_time([busy_s + (slowed - busy_s) / ranks], sync_s)  # the slip: averaged
    return {"answer": step / healthy - 1, "healthy_s": healthy, "step_s": step, "slowed_s": slowed,
            "mean": mean / healthy - 1}


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
        "08c.async-gain",
        "On {gpus:,} GPUs failing at Llama 3's rate (scaled to your count), a blocking save costs the loop "
        "{blocking_s} s; an asynchronous one {async_s} s, and its files are complete {lag_s} s later. Each saved at "
        "its own Young/Daly interval, sqrt(2 x cost x MTBF), by how many percentage points is the asynchronous "
        "save's goodput higher?",
        inputs={"gpus": 1024, "blocking_s": 20.0, "async_s": 0.5, "lag_s": 30.0}, work=_async_gain, unit="pp",
        scale=0.01, digits=2, level="combine", source=SOURCE,
        hint="first the MTBF on your GPUs, then each save's own interval; goodput = interval / period x (1 - "
             "(period / 2 + lag) / MTBF), the asynchronous save's lag counted as work a failure can lose.",
        traps={"same_interval": "That kept the blocking save's interval for both: a cheaper save is taken more "
                                "often, which also loses less work per failure."},
        solution="MTBF {mtbf_h:.1f} h; blocking every {tau_b_min:.1f} min: {blocking:.3%}; asynchronous every "
                 "{tau_a_min:.1f} min: {async:.3%}: {answer} more."),
    Problem(
        "08c.one-slow-rank",
        "A {ranks:,}-GPU synchronous job: each rank's own work takes {busy_s} s a step, and the gradient all-reduce "
        "{sync_s} s once every rank has arrived. One GPU throttles and its work takes {slow_pct} % longer. How much "
        "longer is every step, in percent?",
        inputs={"ranks": 1024, "busy_s": 0.8, "sync_s": 0.2, "slow_pct": 20}, work=_one_slow, unit="%", scale=0.01,
        digits=1, level="apply",
        source="training.synchronous_step_time: the slowest rank sets a synchronous step's pace",
        hint="every rank waits in the all-reduce for the slowest: the step is the slow rank's work plus the "
             "all-reduce, whatever the others do.",
        traps={"mean": "That spread the slow rank over all the ranks: every step waits for the slowest one."},
        solution="{healthy_s:.2f} s healthy; the slow rank's {slowed_s:.2f} s + {sync_s} s = {step_s:.2f} s: "
                 "{answer} longer, for one GPU of {ranks:,} (the all-reduce does not slow: only the work did)."),
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
