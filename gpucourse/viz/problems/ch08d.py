"""Chapter 08d's problems: the samples your run lost while a replica group was out (training.replica_loss), the same
at Llama 3's scale (an audit), a returning group healing from a peer (planner's state bytes over a link), and DiLoCo
against data parallelism: the bytes each replica sends (costs.diloco_bytes) and its syncs over a slow link
(costs.collective_time)."""
from __future__ import annotations

from ...models import costs, planner, training
from .base import Problem

DAY = 86400
TCP = "100 GbE"  # torchft's checkpoint transport is HTTP: a healing rank receives over TCP
LLAMA3_FAULTS = ("Grattafiori et al., The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.2 (dp 128 of tp 8 x "
                 "pp 16) and 3.3.4 (419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs)")
DILOCO = "Douillard et al., DiLoCo: Distributed Low-Communication Training of Language Models, arXiv 2311.08105"


def _your_lost(replicas, steps, short):
    lost = training.replica_loss(replicas, short, steps)
    return {"answer": lost["samples"], "full_restart": lost["full_restart"], "batches": replicas * steps,
            "batches_lost": short}


def _llama_lost(replicas, days, unexpected, down_min):
    lost = training.replica_loss(replicas, down_min * 60, days * DAY, failures=unexpected)
    return {"answer": lost["samples"], "full_restart": lost["full_restart"], "down_h": unexpected * down_min / 60}


def _heal(model, shards):
    total = planner.shape_params(model)["total"]
    per_param = planner.BYTES["param"] + planner.BYTES["optimizer"]
    link = costs.INTERCONNECTS[TCP]
    mine = total * per_param / shards  # a rank receives its own shards only
    return {"answer": costs.collective_time("send_recv", mine, 2, link.alpha, link.beta), "per_param": per_param,
            "total_B": total / 1e9, "mine_GB": mine / 1e9, "link_GBs": link.bandwidth_bytes_per_s / 1e9,
            "whole": costs.collective_time("send_recv", mine * shards, 2, link.alpha, link.beta)}


def _diloco_bytes(model, steps, sync_every):
    fp32 = planner.shape_params(model)["total"] * 4
    return {"answer": costs.diloco_bytes(fp32, steps, sync_every), "ddp": costs.diloco_bytes(fp32, steps),
            "syncs": steps // sync_every, "fp32_GB": fp32 / 1e9}


def _diloco_link(model, sync_every, step_s, gbps, latency_ms, replicas):
    size = planner.shape_params(model)["total"] * 4  # one sync: the fp32 pseudo-gradient
    sync = costs.collective_time("all_reduce", size, replicas, latency_ms / 1e3, 8 / (gbps * 1e9))
    return {"answer": sync / (sync_every * step_s + sync), "sync_s": sync, "size_GB": size / 1e9,
            "ddp": sync / (step_s + sync), "inner_s": sync_every * step_s}


PROBLEMS = [
    Problem(
        "08d.your-samples-lost",
        "Your run: {replicas} replica groups committed {steps} steps, {short} of them with one group missing from the "
        "quorum (dead, restarting, healing). What share of an uninterrupted run's samples did it never train on?",
        inputs={"replicas": 2, "steps": 60, "short": 12}, own=("replicas", "steps", "short"), work=_your_lost,
        unit="%", scale=0.01, digits=2, level="your run",
        hint="an uninterrupted run trains one batch a group a step; each step short of a group misses that group's "
             "batch, and only that.",
        traps={"full_restart": "That is every group's share: a job that restarted whole would have lost those "
                               "steps on every group; here only the missing group's batches were lost."},
        solution="{short} batches missing of {replicas} x {steps} = {batches}: {answer} (a whole-job restart "
                 "lasting those {short} steps would have cost {full_restart:.2%} of the time)."),
    Problem(
        "08d.audit-replica-loss",
        "Audit the chapter's claim that a lost replica costs its share of the samples for as long as it is gone, "
        "not every replica's time, at Llama 3's scale: its 16,384 GPUs as {replicas} replica groups (its dp), its "
        "{unexpected} unexpected interruptions in {days} days, each taking one group out for {down_min} minutes "
        "(restart and heal). What share of the {days} days' samples does the job lose?",
        inputs={"replicas": 128, "days": 54, "unexpected": 419, "down_min": 10}, work=_llama_lost, unit="%",
        scale=0.01, digits=3, level="audit", source=LLAMA3_FAULTS,
        hint="the groups are out for (interruptions x minutes) in all; while one is out the job trains 1 / groups "
             "fewer samples a step.",
        traps={"full_restart": "That is what a whole-job restart of the same length costs: every group idle."},
        solution="{unexpected} x {down_min} min = {down_h:.1f} h of one group out, of {days} days: "
                 "{full_restart:.2%} of the time, x 1/{replicas} = {answer} of the samples (a whole-job restart "
                 "loses the {full_restart:.2%}, plus the work since its last checkpoint)."),
    Problem(
        "08d.heal-time",
        "A replica group of {model}, FSDP over its {shards} GPUs, comes back and heals: each rank receives its own "
        "shards of the weights (bf16) and of the optimizer state (fp32 master weights and Adam's two moments) from "
        "the same rank of a peer, over torchft's HTTP transport on {link}. How many seconds does it take?",
        inputs={"model": "llama3-70b", "shards": 64, "link": TCP}, unit="s", digits=2, level="combine",
        work=lambda model, shards, link: _heal(model, shards), source=f"{TCP}: {costs.INTERCONNECTS[TCP].source}",
        hint="14 bytes a parameter in all (2 of weights, 12 of optimizer state), split over the group's ranks: each "
             "receives its 1/shards at the link's rate, all ranks at once.",
        traps={"whole": "That sent the whole state to every rank: each receives its own shards only."},
        solution="{total_B:.1f} B parameters x {per_param} bytes / {shards} = {mine_GB:.2f} GB a rank at "
                 "{link_GBs:g} GB/s: {answer}, from a peer's memory, while the others train on."),
    Problem(
        "08d.diloco-bytes",
        "{model} trained {steps:,} steps by several replicas, all-reducing fp32 tensors as this chapter's run does. "
        "How many TB does each replica hand to the all-reduce with DiLoCo at H = {sync_every}?",
        inputs={"model": "llama3-8b", "steps": 10_000, "sync_every": 500}, work=_diloco_bytes, unit="TB", scale=1e12,
        digits=3, source=DILOCO,
        hint="DiLoCo all-reduces one pseudo-gradient, the parameters' size, every H inner steps; data parallelism "
             "a gradient of that size every step.",
        traps={"ddp": "That is data parallelism's: a gradient every step, H times more."},
        solution="{fp32_GB:.1f} GB of fp32 pseudo-gradient x {syncs} syncs = {answer} (data parallelism: "
                 "{steps:,} all-reduces, H times more)."),
    Problem(
        "08d.diloco-link",
        "Two replicas of {model} in two data centres, {gbps} Gb/s and {latency_ms} ms between them. DiLoCo at H = "
        "{sync_every} all-reduces the fp32 pseudo-gradient (a ring over the {replicas} replicas), not overlapped "
        "with training; an inner step takes {step_s} s. What share of the wall time do the syncs take?",
        inputs={"model": "llama3-8b", "sync_every": 500, "step_s": 1.0, "gbps": 100, "latency_ms": 10,
                "replicas": 2},
        work=_diloco_link, unit="%", scale=0.01, digits=2, level="combine",
        source=f"{DILOCO}; the link between the data centres: assumed",
        hint="one sync: a ring all-reduce of the parameters' fp32 bytes over the link (alpha-beta); it comes once "
             "every H steps.",
        traps={"ddp": "That synced every step, as data parallelism does: the link would dominate."},
        solution="a sync moves {size_GB:.1f} GB: {sync_s:.2f} s, once per {inner_s:g} s of inner steps: {answer} "
                 "of the time; synchronous data parallelism over the same link would spend {ddp:.0%}."),
]
