"""Chapter 01's problems: bus bandwidth, bytes on the wire, the alpha-beta model (costs.comms)."""
from __future__ import annotations

from ...models import costs
from .base import Problem

MiB = 2 ** 20
NVLINK = "NVLink 4 (H100 SXM)"
NDR = "InfiniBand NDR 400G"


def _busbw(size_mib, n, time_ms):
    size, seconds = size_mib * MiB, time_ms / 1e3
    return {"answer": costs.busbw("all_reduce", size, seconds, n), "algbw": costs.algbw(size, seconds),
            "factor": costs.busbw_factor("all_reduce", n)}


def _all_gather(size_mib, n, time_ms):
    size, seconds = size_mib * MiB, time_ms / 1e3
    return {"answer": costs.busbw("all_gather", size, seconds, n), "algbw": costs.algbw(size, seconds),
            "factor": costs.busbw_factor("all_gather", n), "as_all_reduce": costs.busbw("all_reduce", size, seconds, n)}


def _ring_time(size_mib, n, link):
    ic = costs.INTERCONNECTS[link]
    size = size_mib * MiB
    return {"answer": costs.collective_time("all_reduce", size, n, ic.alpha, ic.beta),
            "latency": costs.collective_time("all_reduce", size, n, ic.alpha, 0.0),
            "bandwidth": costs.collective_time("all_reduce", size, n, 0.0, ic.beta),
            "steps": 2 * (n - 1), "alpha_us": ic.alpha * 1e6, "bw_GBs": ic.bandwidth_bytes_per_s / 1e9,
            "sent_MB": costs.bytes_moved_per_rank("all_reduce", size, n) / 1e6,
            "one_pass": size * ic.beta}


def _crossover(n, link):
    ic = costs.INTERCONNECTS[link]
    per_byte = costs.collective_time("all_reduce", 1, n, 0.0, ic.beta)  # seconds per buffer byte
    fixed = costs.collective_time("all_reduce", 0, n, ic.alpha, ic.beta)  # the latency terms alone
    return {"answer": fixed / per_byte, "fixed_us": fixed * 1e6, "steps": 2 * (n - 1), "alpha_us": ic.alpha * 1e6,
            "factor": costs.busbw_factor("all_reduce", n), "bw_GBs": ic.bandwidth_bytes_per_s / 1e9}


def _gradients(params_b, n, link):
    ic = costs.INTERCONNECTS[link]
    size = params_b * 1e9 * 2  # bf16 gradients
    sent = costs.bytes_moved_per_rank("all_reduce", size, n)
    return {"answer": costs.collective_time("all_reduce", size, n, ic.alpha, ic.beta), "size_GB": size / 1e9,
            "sent_GB": sent / 1e9, "factor": costs.busbw_factor("all_reduce", n),
            "bw_GBs": ic.bandwidth_bytes_per_s / 1e9, "one_copy": size * ic.beta}


def _your_run(size_mib, n, time_ms, predict_mib, predict_n):
    measured = costs.busbw("all_reduce", size_mib * MiB, time_ms / 1e3, n)
    predicted = costs.collective_time("all_reduce", predict_mib * MiB, predict_n, 0.0, 1 / measured)
    return {"answer": predicted, "busbw_MBs": measured / 1e6,
            "factor": costs.busbw_factor("all_reduce", n), "factor2": costs.busbw_factor("all_reduce", predict_n),
            "scaled": time_ms / 1e3 * predict_mib / size_mib}


def _fit(small_kib, small_us, large_mib, large_ms, n):
    fit = costs.fit_alpha_beta([small_kib * 1024, large_mib * MiB], [small_us / 1e6, large_ms / 1e3], "all_reduce",
                               n=n)
    return {"answer": fit.alpha, "bw_MBs": fit.bandwidth / 1e6, "steps": 2 * (n - 1),
            "factor": costs.busbw_factor("all_reduce", n)}


PROBLEMS = [
    Problem(
        "01.busbw-all-reduce",
        "An all_reduce of {size_mib} MiB on {n} GPUs takes {time_ms} ms (nccl-tests' size: the one buffer). "
        "What bus bandwidth does nccl-tests print for it?",
        inputs={"size_mib": 256, "n": 8, "time_ms": 1.5}, work=_busbw, unit="GB/s", scale=1e9, digits=1,
        hint="algbw = size / time is not the number to compare with a link: multiply it by the all_reduce's bus "
             "factor 2(n-1)/n. And a MiB is 2^20 bytes.",
        traps={"algbw": "That is algbw, the buffer over the time, before the bus factor."},
        solution="algbw = {size_mib} MiB / {time_ms} ms = {algbw:.4g} B/s; busbw = algbw x 2(n-1)/n = algbw x "
                 "{factor:.3f} = {answer}."),
    Problem(
        "01.busbw-all-gather",
        "An all_gather whose output is {size_mib} MiB (nccl-tests' size for all_gather) takes {time_ms} ms on "
        "{n} GPUs. What is its bus bandwidth?",
        inputs={"size_mib": 1024, "n": 16, "time_ms": 3.0}, work=_all_gather, unit="GB/s", scale=1e9, digits=1,
        hint="an all_gather's bus factor is (n-1)/n, not the all_reduce's 2(n-1)/n: each rank receives every "
             "shard but its own, once.",
        traps={"as_all_reduce": "That used the all_reduce's factor 2(n-1)/n.",
               "algbw": "That is algbw, before the bus factor."},
        solution="algbw = {size_mib} MiB / {time_ms} ms = {algbw:.4g} B/s; all_gather's factor (n-1)/n = "
                 "{factor:.4f}; busbw = {answer}."),
    Problem(
        "01.ring-time-nvlink",
        "By the alpha-beta model, how long does a ring all_reduce of {size_mib} MiB take on {n} GPUs over "
        "{link}?",
        inputs={"size_mib": 64, "n": 8, "link": NVLINK}, work=_ring_time, unit="µs", scale=1e-6, digits=1,
        source=costs.INTERCONNECTS[NVLINK].source,
        hint="a ring all_reduce is a reduce-scatter then an all-gather: 2(n-1) messages (each costs alpha) and "
             "2(n-1)/n of the buffer sent by each rank, not the buffer once.",
        traps={"one_pass": "That is the buffer sent once at the link's rate: the ring sends 2(n-1)/n of it, plus "
                           "2(n-1) latencies."},
        solution="{steps} steps x alpha ({alpha_us:.1f} µs) = {latency:.3g} s; each rank sends 2(n-1)/n x "
                 "{size_mib} MiB = {sent_MB:.1f} MB at {bw_GBs:.0f} GB/s = {bandwidth:.4g} s; total {answer}."),
    Problem(
        "01.latency-crossover",
        "A ring all_reduce on {n} GPUs over {link}: at what buffer size do its latency terms cost as much as its "
        "bandwidth term?",
        inputs={"n": 16, "link": NDR}, work=_crossover, unit="KiB", scale=1024, digits=1, level="combine",
        source=costs.INTERCONNECTS[NDR].source,
        hint="set 2(n-1) alpha equal to 2(n-1)/n x S x beta and solve for S: the n-1 cancels, leaving S = n alpha "
             "/ beta, bigger with more GPUs.",
        solution="latency: {steps} x {alpha_us:.0f} µs = {fixed_us:.0f} µs; bandwidth: {factor:.4f} x S / "
                 "{bw_GBs:.0f} GB/s; equal at S = {answer}: below it, an all_reduce is mostly latency."),
    Problem(
        "01.gradients-all-reduce",
        "A {params_b} B-parameter model's bf16 gradients are all-reduced in one ring over {n} GPUs, every link "
        "{link}. How long does that take, by the alpha-beta model?",
        inputs={"params_b": 8.0, "n": 64, "link": NDR}, work=_gradients, unit="s", digits=3, level="combine",
        source=costs.INTERCONNECTS[NDR].source,
        hint="first the bytes: 2 bytes a parameter in bf16; then the ring sends 2(n-1)/n of them per rank, nearly "
             "twice the buffer.",
        traps={"one_copy": "That sends the gradients once: a ring all_reduce sends 2(n-1)/n of them."},
        solution="{params_b} B x 2 bytes = {size_GB:.1f} GB; each rank sends {factor:.4f} x that = {sent_GB:.2f} "
                 "GB at {bw_GBs:.0f} GB/s, plus 2(n-1) latencies: {answer}."),
    Problem(
        "01.your-busbw-predict",
        "Your chapter 01 run: an all_reduce of {size_mib} MiB on {n} ranks took {time_ms} ms. With the same "
        "busbw, how long would {predict_mib} MiB take on {predict_n} ranks (latency ignored)?",
        inputs={"size_mib": 64, "n": 2, "time_ms": 80.0, "predict_mib": 256, "predict_n": 4},
        own=("size_mib", "n", "time_ms"), work=_your_run, unit="ms", scale=1e-3, digits=0, level="your run",
        hint="the link's rate is the busbw, not the algbw: from 2 to 4 ranks the bytes each rank sends go from "
             "1 x to 1.5 x the buffer.",
        traps={"scaled": "That scaled the time by size alone: with 4 ranks each one sends 2(n-1)/n = 1.5 x the "
                         "buffer, against 1 x at 2 ranks."},
        solution="your busbw = {size_mib} MiB / {time_ms} ms x {factor:.2f} = {busbw_MBs:.1f} MB/s; {predict_mib} MiB "
                 "x {factor2:.2f} / busbw = {answer}."),
    Problem(
        "01.your-alpha",
        "Your run timed an all_reduce on {n} ranks: {small_kib} KiB in {small_us} µs and {large_mib} MiB in "
        "{large_ms} ms. Fit the alpha-beta model to these two points: what is alpha?",
        inputs={"small_kib": 4, "small_us": 150.0, "large_mib": 64, "large_ms": 80.0, "n": 2},
        own=("small_kib", "small_us", "large_mib", "large_ms", "n"), work=_fit, unit="µs", scale=1e-6, digits=1,
        level="your run",
        hint="two equations, t = 2(n-1) alpha + 2(n-1)/n S beta: solve the pair; alpha is per message, and the "
             "ring sends 2(n-1) of them, so alpha is the small time over 2(n-1), less its bytes' share.",
        solution="t = {steps} alpha + {factor:.2f} S beta at both sizes gives beta^-1 = {bw_MBs:.1f} MB/s and "
                 "alpha = {answer}."),
]
