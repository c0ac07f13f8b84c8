"""Chapter 06's problems: the bytes each tensor-parallel rank sends per all-reduce and per block, what the four
all-reduces of a layer cost against its compute over NVLink and InfiniBand (costs.comms), the weights a GPU
keeps, your run's count, and an audit of a DGX H100's two links."""
from __future__ import annotations

from ...models import costs, planner
from .base import Problem

NVLINK = "NVLink 4 (H100 SXM)"
NDR = "InfiniBand NDR 400G"
BIG = {"batch": 1, "seq": 2048, "hidden": 12288}  # chapter 06's BIG: a GPT-3-175B-sized layer, bf16
DGX_H100 = ("NVIDIA DGX H100 datasheet, https://www.nvidia.com/en-us/data-center/dgx-h100/: 8 H100 SXM GPUs, NVLink "
            "900 GB/s GPU-to-GPU (both directions), 8 single-port ConnectX-7 VPI at 400 Gb/s, one per GPU")


def _act_bytes(batch, seq, hidden):
    return batch * seq * hidden * 2  # bf16 activations


def _all_reduce_bytes(batch, seq, hidden, tp):
    size = _act_bytes(batch, seq, hidden)
    return {"answer": costs.bytes_moved_per_rank("all_reduce", size, tp), "size_MB": size / 1e6,
            "factor": costs.busbw_factor("all_reduce", tp), "buffer": size, "split": size / tp}


def _layer(batch, seq, hidden, tp, link, tflops):
    ic = costs.INTERCONNECTS[link]
    size = _act_bytes(batch, seq, hidden)
    flops = batch * seq * costs.model_flops_per_token(12 * hidden ** 2, 1, hidden, seq)  # 3 x (24bsh^2 + 4bs^2h)
    compute = flops / tp / (tflops * 1e12)
    one = costs.collective_time("all_reduce", size, tp, ic.alpha, ic.beta)
    nv = costs.INTERCONNECTS[NVLINK]
    return {"answer": 4 * one / compute, "compute_ms": compute * 1e3, "comm_ms": 4 * one * 1e3,
            "one_ms": one * 1e3, "TFLOP": flops / 1e12, "comm": 4 * one, "two": 2 * one,
            "nvlink": 4 * costs.collective_time("all_reduce", size, tp, nv.alpha, nv.beta) / compute}


def _four_all_reduces(batch, seq, hidden, tp, link):
    out = _layer(batch, seq, hidden, tp, link, 400)
    return {**out, "answer": out["comm"]}


def _weights(model, tp):
    p, shape = planner.shape_params(model), planner.shape_of(model)
    per_gpu = shape["layers"] * (p["layer_split"] / tp + p["layer_whole"])
    return {"answer": per_gpu * planner.BYTES["param"], "layer_M": p["layer_dense"] / 1e6, "layers": shape["layers"],
            "whole": shape["layers"] * p["layer_dense"] * planner.BYTES["param"], "bytes": planner.BYTES["param"]}


def _your_block(size_bytes, n):
    once = costs.bytes_moved_per_rank("all_reduce", size_bytes, n)
    return {"answer": 2 * once, "once": once, "factor": costs.busbw_factor("all_reduce", n),
            "buffer_twice": 2 * size_bytes}


def _dgx(size_mb):
    inside, across = costs.INTERCONNECTS[NVLINK], costs.INTERCONNECTS[NDR]
    t_in = costs.collective_time("send_recv", size_mb * 1e6, 2, 0.0, inside.beta)
    t_out = costs.collective_time("send_recv", size_mb * 1e6, 2, 0.0, across.beta)
    return {"answer": t_out / t_in, "in_ms": t_in * 1e3, "out_ms": t_out * 1e3,
            "nv_GBs": inside.bandwidth_bytes_per_s / 1e9, "ib_GBs": across.bandwidth_bytes_per_s / 1e9,
            "bits_as_bytes": 900 / 400, "bidirectional": 900 / (across.bandwidth_bytes_per_s / 1e9)}


PROBLEMS = [
    Problem(
        "06.all-reduce-bytes",
        "A tensor-parallel block of a GPT-3-sized layer (hidden {hidden:,}, sequence {seq:,}, micro-batch {batch}, "
        "bf16 activations) at tp = {tp}: how many MB does each rank send in the block's forward all-reduce?",
        inputs={**BIG, "tp": 8}, work=_all_reduce_bytes, unit="MB", scale=1e6, digits=1,
        hint="the all-reduce's buffer is the whole activation b x s x h (every rank holds a partial sum of full "
             "shape), and a ring sends 2(n-1)/n of it per rank, whatever the degree.",
        traps={"buffer": "That is the buffer once: a ring all-reduce sends 2(n-1)/n of it.",
               "split": "That divided the activation by tp: the partial sums are full-size on every rank."},
        solution="b x s x h x 2 bytes = {size_MB:.2f} MB; x 2(n-1)/n = {factor:.3f}: {answer} a rank."),
    Problem(
        "06.four-all-reduces",
        "The same layer (hidden {hidden:,}, sequence {seq:,}, bf16) at tp = {tp} over {link}: how long do its four "
        "all-reduces (two forward, two backward) take per micro-batch, by the alpha-beta model?",
        inputs={**BIG, "tp": 8, "link": NVLINK}, work=_four_all_reduces, unit="ms", scale=1e-3, digits=3,
        source=costs.INTERCONNECTS[NVLINK].source,
        hint="attention and the MLP each have one all-reduce in forward (g) and one in backward (f): four ring "
             "all-reduces of the activations.",
        traps={"two": "That counted the forward's two only: f all-reduces the input gradient in backward, twice "
                      "more."},
        solution="one all-reduce: {one_ms:.3f} ms; four: {answer}."),
    Problem(
        "06.comm-over-compute",
        "That layer at tp = {tp}, but across nodes over {link}, the matrix products at an assumed {tflops} TFLOP/s a "
        "GPU: what is the ratio of the four all-reduces' time to the layer's compute (forward + backward)?",
        inputs={**BIG, "tp": 8, "link": NDR, "tflops": 400}, work=_layer, unit="x", digits=2, level="combine",
        source=costs.INTERCONNECTS[NDR].source,
        hint="compute: 3 x (24 b s h^2 + 4 b s^2 h) FLOPs for forward + backward, split over the tp ranks; "
             "communication: four ring all-reduces of b s h values, which do not shrink with tp.",
        traps={"nvlink": "That is the ratio over NVLink inside a node: across nodes the link is 9 times slower."},
        solution="compute {TFLOP:.2f} TFLOP / {tp} / {tflops} TFLOP/s = {compute_ms:.2f} ms; four all-reduces "
                 "{comm_ms:.2f} ms; ratio {answer} (over NVLink: {nvlink:.2f})."),
    Problem(
        "06.weights-per-gpu",
        "{model}'s transformer layers (no embedding or head) at tp = {tp}, bf16: how many GB of layer weights does "
        "each GPU hold?",
        inputs={"model": "llama3-70b", "tp": 8}, work=_weights, unit="GB", scale=1e9, digits=2,
        source="Llama 3 70B's shape: Grattafiori et al. 2024, Table 3 (planner.SHAPES)",
        hint="column- and row-parallel layers split every weight matrix of a layer over the tp ranks: 1/tp of each "
             "layer's parameters, 2 bytes each.",
        traps={"whole": "That is every layer whole on each GPU: tensor parallelism splits them."},
        solution="{layers} layers x {layer_M:.1f} M parameters / {tp} x {bytes} bytes = {answer}."),
    Problem(
        "06.your-block-bytes",
        "Your chapter 06 run: on {n} ranks the mlp case's forward all-reduce was {size_bytes:,} bytes. How many KiB "
        "does each rank send for one block, forward and backward together?",
        inputs={"size_bytes": 4 * 16 * 64 * 4, "n": 4}, own=("size_bytes", "n"), work=_your_block, unit="KiB",
        scale=1024, digits=1, level="your run",
        hint="one all-reduce in forward (g), one in backward (f), each of the activations' size; each rank sends "
             "2(n-1)/n of the buffer per all-reduce.",
        traps={"buffer_twice": "That is the buffer twice: a ring sends 2(n-1)/n of it per all-reduce.",
               "once": "That is the forward's all-reduce alone: f adds one in backward."},
        solution="one all-reduce: {size_bytes:,} x {factor:.2f} = {once:,.0f} bytes; two: {answer}."),
    Problem(
        "06.audit-dgx-links",
        "Audit: a DGX H100 gives each GPU NVLink at \"900 GB/s\" and a ConnectX-7 network card at \"400 Gb/s\". "
        "Per direction, how many times longer does sending {size_mb} MB to a GPU of another node take than to one "
        "of the same node (bandwidth alone)?",
        inputs={"size_mb": 100}, work=_dgx, unit="x", digits=1, level="audit", source=DGX_H100,
        hint="two unit traps: NVLink's 900 GB/s counts both directions (450 GB/s each way), and the card's 400 Gb/s "
             "is bits (50 GB/s).",
        traps={"bits_as_bytes": "That divided 900 by 400: gigabits are not gigabytes (400 Gb/s is 50 GB/s).",
               "bidirectional": "That used NVLink's 900 GB/s, both directions together: one way is 450 GB/s."},
        solution="{size_mb} MB at {nv_GBs:.0f} GB/s: {in_ms:.3f} ms; at {ib_GBs:.0f} GB/s: {out_ms:.3f} ms; "
                 "{answer} longer."),
]
