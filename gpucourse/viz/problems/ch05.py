"""Chapter 05's problems: the pipeline bubble and the activations a stage holds (costs.pipeline_parallel)."""
from __future__ import annotations

from ...models import costs
from .base import Problem


def _fraction(p, m):
    return {"answer": costs.pipeline_bubble_fraction(p, m), "ratio": costs.pipeline_bubble_ratio(p, m),
            "slots": p - 1, "total": m + p - 1}


def _ratio(p, m):
    return {"answer": costs.pipeline_bubble_ratio(p, m), "fraction": costs.pipeline_bubble_fraction(p, m),
            "slots": p - 1, "total": m + p - 1}


def _interleaved(p, m, v):
    return {"answer": costs.pipeline_bubble_fraction(p, m, v), "plain": costs.pipeline_bubble_fraction(p, m),
            "ratio": costs.pipeline_bubble_ratio(p, m, v), "slots": (p - 1) / v, "total": m + (p - 1) / v}


def _fewest_micro_batches(p, target_pct):
    m = next(m for m in range(1, 100 * p) if costs.pipeline_bubble_fraction(p, m) <= target_pct / 100)
    return {"answer": m, "at": costs.pipeline_bubble_fraction(p, m), "before": costs.pipeline_bubble_fraction(p, m - 1),
            "ratio_m": next(k for k in range(1, 100 * p) if costs.pipeline_bubble_ratio(p, k) <= target_pct / 100)}


def _in_flight(p, m, rank):
    return {"answer": costs.pipeline_peak_activations(p, m, rank=rank, schedule="1F1B"),
            "gpipe": costs.pipeline_peak_activations(p, m, rank=rank, schedule="GPipe"), "warmup": p - rank - 1}


def _interleaved_memory(p, m, v, gib_per_micro_batch):
    chunks = costs.pipeline_peak_activations(p, m, v, rank=0, schedule="Interleaved1F1B")
    plain = costs.pipeline_peak_activations(p, m, 1, rank=0, schedule="1F1B")
    return {"answer": chunks / v * gib_per_micro_batch * 2 ** 30, "chunks": chunks, "worth": chunks / v,
            "plain": plain, "plain_gib": plain * gib_per_micro_batch, "naive": chunks * gib_per_micro_batch * 2 ** 30}


def _your_step(p, m, step_ms, new_m):
    idle = costs.pipeline_bubble_fraction(p, m)
    per_micro_batch = step_ms * (1 - idle) / m
    new_idle = costs.pipeline_bubble_fraction(p, new_m)
    return {"answer": per_micro_batch * new_m / (1 - new_idle) / 1e3, "idle": idle, "per_mb": per_micro_batch,
            "new_idle": new_idle, "linear": step_ms * new_m / m / 1e3}


PROBLEMS = [
    Problem(
        "05.bubble-1f1b",
        "A {p}-stage pipeline runs {m} micro-batches a step with 1F1B. Which share of the step is each stage "
        "idle, by the formula?",
        inputs={"p": 4, "m": 8}, work=_fraction, unit="%", scale=0.01, digits=1,
        hint="the p-1 fill-and-drain slots are out of m + p - 1 slots in all, not out of m: (p-1)/m is the bubble "
             "against the ideal step, not the share of the step.",
        traps={"ratio": "That is (p-1)/m, the bubble against the ideal step; the share of the whole step divides by "
                        "m + p - 1."},
        solution="(p-1)/(m+p-1) = {slots}/{total} = {answer} of the step ((p-1)/m = {ratio:.1%} on top of the "
                 "ideal step)."),
    Problem(
        "05.bubble-ratio",
        "The same bubble, as Narayanan et al. write it: for {p} stages and {m} micro-batches, how long is the "
        "bubble compared with the ideal, bubble-free step?",
        inputs={"p": 8, "m": 32}, work=_ratio, unit="%", scale=0.01, digits=2,
        hint="against the ideal step the denominator is the m micro-batches' work alone: (p-1)/m.",
        traps={"fraction": "That is the share of the whole step, (p-1)/(m+p-1)."},
        solution="(p-1)/m = {slots}/{m} = {answer} on top of the ideal step; as a share of the whole step, "
                 "(p-1)/(m+p-1) = {slots}/{total} = {fraction:.2%}."),
    Problem(
        "05.bubble-interleaved",
        "Interleaved 1F1B: {p} ranks, {v} stages per rank, {m} micro-batches. Which share of the step is idle?",
        inputs={"p": 4, "m": 8, "v": 2}, work=_interleaved, unit="%", scale=0.01, digits=1,
        hint="with v stages a rank each slot is 1/v as long: the fill and drain cost (p-1)/v micro-batch times, "
             "out of m + (p-1)/v.",
        traps={"plain": "That is plain 1F1B's bubble: interleaving divides the p-1 slots by v."},
        solution="(p-1)/(v m + p - 1) = {slots:.2f} / {total:.2f} micro-batch times = {answer} (1F1B: "
                 "{plain:.1%})."),
    Problem(
        "05.fewest-micro-batches",
        "With {p} stages and 1F1B, how many micro-batches a step does it take to bring the idle share of the step "
        "to {target_pct} % or less?",
        inputs={"p": 8, "target_pct": 10}, work=_fewest_micro_batches, unit="micro-batches", digits=0,
        tolerance=0, level="combine",
        hint="solve (p-1)/(m+p-1) <= target for m: m >= (p-1)(1/target - 1), then round up.",
        traps={"ratio_m": "That solved (p-1)/m <= target, the bubble against the ideal step, not the share of it."},
        solution="(p-1)/(m+p-1) <= {target_pct} % needs m >= {answer}: at m = {answer} the idle share is {at:.2%}, "
                 "one fewer gives {before:.2%}."),
    Problem(
        "05.in-flight-1f1b",
        "{p} stages, {m} micro-batches, 1F1B. Rank {rank}: at most how many micro-batches' activations does it hold "
        "at once?",
        inputs={"p": 8, "m": 16, "rank": 2}, work=_in_flight, unit="micro-batches", digits=0, tolerance=0,
        hint="1F1B runs p - rank - 1 warm-up forwards, then one more forward before its first backward frees one: "
             "p - rank, whatever m is (m >= p).",
        traps={"gpipe": "That is GPipe's count, every forward before any backward: 1F1B caps it at p - rank.",
               "warmup": "That is the warm-up forwards alone: the forward before the first backward adds one."},
        solution="warm-up forwards: p - rank - 1 = {warmup}; plus the one before the first backward: {answer} "
                 "(GPipe: {gpipe})."),
    Problem(
        "05.interleaved-memory",
        "Interleaved 1F1B, {p} ranks, {v} stages per rank, {m} micro-batches. One micro-batch through all of rank "
        "0's layers keeps {gib_per_micro_batch} GiB of activations. How much does rank 0 hold at its peak?",
        inputs={"p": 4, "m": 8, "v": 2, "gib_per_micro_batch": 3.0}, work=_interleaved_memory, unit="GiB",
        scale=2 ** 30, digits=1, level="combine",
        hint="count chunks, then convert: a chunk is one micro-batch through 1/v of the rank's layers, so the "
             "chunks in flight are worth chunks / v micro-batches.",
        traps={"naive": "That counted each chunk as a whole micro-batch: a chunk holds 1/v of the rank's layers."},
        solution="chunks in flight on rank 0: (v-1) x m/(m // p) + 2(p-1) + 1 = {chunks}; worth {chunks} / {v} = "
                 "{worth:.1f} micro-batches x {gib_per_micro_batch} GiB = {answer} (1F1B: {plain} micro-batches, "
                 "{plain_gib:.1f} GiB)."),
    Problem(
        "05.your-step-more-micro-batches",
        "Your chapter 05 run: {p} stages, {m} micro-batches with 1F1B, a step of {step_ms} ms. If the bubble is the "
        "only idle time, how long would a step of {new_m} micro-batches (the same size) take?",
        inputs={"p": 4, "m": 4, "step_ms": 700.0, "new_m": 8}, own=("p", "m", "step_ms"), work=_your_step, unit="s",
        digits=2, level="your run",
        hint="take the bubble out first: the work per micro-batch is step x (1 - bubble share) / m; then put the new "
             "bubble back on the new work.",
        traps={"linear": "That doubled the whole step: the bubble's p-1 slots stay the same length, so it grows less."},
        solution="idle share at m = {m}: {idle:.1%}; work per micro-batch {per_mb:.1f} ms; {new_m} of them "
                 "/ (1 - {new_idle:.1%}) = {answer}."),
]
