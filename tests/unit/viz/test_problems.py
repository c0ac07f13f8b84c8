"""Numeric problems: every answer is a call into the course's models and every worked solution states the numbers
that call computes; a typed answer is refused; the widget marks right, gives the hint, then the worked solution;
answers are recorded in the learner's workspace and `gpucourse progress` reads them."""
import json
import math
import re

import numpy as np
import pytest

from gpucourse.models import costs, memory, planner, published, recompute, training
from gpucourse.viz import problems
from gpucourse.viz.problems import base
from gpucourse.viz.problems.base import LEVELS, Problem, parse_number, progress_file

from tests.conftest import run_cli

ALL = problems.all_problems()
H100 = costs.SYSTEMS["h100-sxm"]["device"]
MiB = 2 ** 20


@pytest.fixture(autouse=True)
def progress(tmp_path, monkeypatch):
    """Every test records into its own file, never into a real workspace."""
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv(base.PROGRESS_ENV, str(path))
    return path


def flops(model, seq, **kw):
    s, p = planner.shape_of(model), planner.shape_params(model)
    if kw:
        return costs.hardware_flops_per_token(p["matmul"], s["layers"], s["d_model"], seq, **kw)
    return costs.model_flops_per_token(p["matmul"], s["layers"], s["d_model"], seq)


def gives_away(problem, text):
    """The answer, as shown, standing alone in text (not '6 micro-batches' inside '16 micro-batches')."""
    return re.search(r"(?<![\d.,])" + re.escape(problem.answer_text()), text) is not None


def first_stage_states():
    plan = planner.plan_parallelism("llama3-70b", gpus=1024, dp=32, tp=8, pp=4, zero=1)
    return sum(plan["stages"][0]["memory"][k] for k in ("params", "grads", "optimizer"))


CH07B = dict(batch=4, layers=4, width=64, matmul_params=4 * 12 * 64 ** 2 + 65 * 64,
             block_matmul_params=4 * 12 * 64 ** 2)


def mixtral_active():
    """Mixtral 8x7B per token: attention (q, out 4096^2; k, v 4096 x 1024), router 4096 x 8, two experts of three
    4096 x 14336 matrices, in each of 32 layers; embedding and head 32000 x 4096 each."""
    layer = 2 * 4096 ** 2 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 3 * 4096 * 14336
    return 32 * layer + 2 * 32000 * 4096


# Each problem's answer, in its unit, written again here straight from the course's functions with the numbers the
# problem states: a problem whose inputs or work drift from what it asks fails here.
WIDGET = {"layers": 32, "d_model": 4096, "ffn": 16384, "heads": 32, "kv_heads": 32, "vocab": 30522,
          "mlp_matrices": 2, "tied": True}
EXPECTED = {
    "01.busbw-all-reduce": lambda: costs.busbw("all_reduce", 256 * MiB, 1.5e-3, 8) / 1e9,
    "01.busbw-all-gather": lambda: costs.busbw("all_gather", 1024 * MiB, 3e-3, 16) / 1e9,
    "01.ring-time-nvlink": lambda: costs.collective_time("all_reduce", 64 * MiB, 8, 3e-6, 1 / 450e9) / 1e-6,
    "01.latency-crossover": lambda: 16 * 6e-6 * 50e9 / 1024,  # S = n alpha / beta
    "01.gradients-all-reduce": lambda: costs.collective_time("all_reduce", 16e9, 64, 6e-6, 1 / 50e9),
    "01.your-busbw-predict": lambda: 256 * MiB * 1.5 / costs.busbw("all_reduce", 64 * MiB, 0.08, 2) / 1e-3,
    "01.your-alpha": lambda: costs.fit_alpha_beta([4096, 64 * MiB], [150e-6, 0.08], n=2).alpha / 1e-6,
    "02.sampler-padding": lambda: 64 * 782 - 50_000,  # ceil(50,000 / 64) = 782 a rank
    "02.steps-per-epoch": lambda: 3907,  # 125,000 a rank in batches of 32, the last one kept
    "02.accumulation-bytes": lambda: 8 * costs.bytes_moved_per_rank("all_reduce", 1e9, 8) / 1e9,
    "02.no-sync-saves": lambda: 7 * costs.collective_time("all_reduce", 1e9, 8, 6e-6, 1 / 50e9),
    "02.compress-hook-bytes": lambda: costs.bytes_moved_per_rank("all_reduce", 350e6 * 2, 16) / 1e6,
    "02.your-accumulation": lambda: 4 * 1.75 * 2_099_712 * 4 / MiB,
    "02.audit-ddp-buckets": lambda: math.ceil(1.5e9 * 4 / (25 * MiB)),
    "03.scaling-efficiency": lambda: 100 * 2900 / (8 * 410),
    "03.ddp-step": lambda: costs.ddp_step_time(0.1, 1.4e9, 64, 6e-6, 1 / 50e9).step / 1e-3,
    "03.last-bucket": lambda: costs.collective_time("all_reduce", 1.4e9 - 53 * 25 * MiB, 64, 6e-6, 1 / 50e9) / 1e-3,
    "03.comm-bound-world": lambda: 1024,
    "03.your-overlap-cost": lambda: (49 - 40) / 12,
    "03.audit-megatron-76": lambda: 100 * costs.scaling_efficiency(15.1e15, 39e12, 512),
    "04.warmup-steps": lambda: 0.5 * training.steps_per_epoch(16384, 32, 4),
    "04.steps-over-minimum": lambda: 1 + 2000 / 512,
    "04.fewer-steps": lambda: (1 + 2000 / 1024) / (1 + 2000 / 8192),
    "04.your-noise-scale": lambda: (1 + 400 / 32) / (1 + 400 / 128),
    "04.audit-goyal-warmup": lambda: 5 * math.ceil(math.ceil(1_281_167 / 256) / 32),
    "06.all-reduce-bytes": lambda: 1.75 * 2048 * 12288 * 2 / 1e6,
    "06.four-all-reduces": lambda: 4 * costs.collective_time("all_reduce", 2048 * 12288 * 2, 8, 3e-6, 1 / 450e9) / 1e-3,
    "06.comm-over-compute": lambda: (4 * costs.collective_time("all_reduce", 2048 * 12288 * 2, 8, 6e-6, 1 / 50e9)
                                     / (3 * (24 * 2048 * 12288 ** 2 + 4 * 2048 ** 2 * 12288) / 8 / 400e12)),
    "06.weights-per-gpu": lambda: 80 * planner.shape_params("llama3-70b")["layer_dense"] * 2 / 8 / 1e9,
    "06.your-block-bytes": lambda: 2 * 1.5 * 16384 / 1024,
    "06.audit-dgx-links": lambda: 9.0,  # 450 GB/s one way over NVLink, 400 Gb/s = 50 GB/s over the card
    "07b.bf16-states": lambda: 7e9 * 8 / 1e9,
    "07b.layer-activations": lambda: 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288) / 1e9,
    "07b.full-recompute-kept": lambda: 96 * 2 * 2048 * 12288 / 1e9,
    "07b.recompute-flops": lambda: 100 * (flops("llama3-8b", 8192, recompute="full") / flops("llama3-8b", 8192) - 1),
    "07b.fp8-speedup": lambda: 1 / (0.3 + 0.7 / 2),
    "07b.your-recompute-time": lambda: 30 * (recompute.expected_flops(256, "full", **CH07B)
                                             / recompute.expected_flops(256, "none", **CH07B)),
    "07b.audit-korthikanti-hfu": lambda: 42.1 * flops("megatron-530b", 2048, recompute="full")
                                         / flops("megatron-530b", 2048),
    "08.tp-across-nodes": lambda: 128 * (costs.collective_time("all_reduce", 4096 * 4096 * 2, 8, 6e-6, 1 / 50e9)
                                         - costs.collective_time("all_reduce", 4096 * 4096 * 2, 8, 3e-6, 1 / 450e9)
                                         ) / 1e-3,
    "08.checkpoint-size": lambda: planner.shape_params("llama3-405b")["total"] * 14 / 1e12,
    "08.llama3-mtbf": lambda: 54 * 24 / 419,
    "08.young-daly-llama3": lambda: math.sqrt(2 * planner.shape_params("llama3-405b")["total"] * 14 / 2e12
                                              * 54 * 86400 / 419) / 60,
    "08.audit-effective-time": lambda: 100 * (2 * math.sqrt(planner.shape_params("llama3-405b")["total"] * 14 / 2e12
                                                            / (2 * 54 * 86400 / 419)) + 600 / (54 * 86400 / 419)),
    "08.your-redone-steps": lambda: 100 * 2.5 / 40,
    "09.flops-per-token": lambda: (6 * (12 * 12 * 768 ** 2 + 65 * 768) + 12 * 12 * 768 * 1024) / 1e6,
    "09.your-mfu": lambda: 100 * 400_000 * (6 * (12 * 12 * 768 ** 2 + 65 * 768) + 12 * 12 * 768 * 1024)
                           / (8 * costs.peak_flops(H100)),
    # a block's weights 12 d^2 and column-parallel biases (q, k, v, fc: 7 d) over tp 2; its 2 LayerNorms and the
    # out and proj biases (6 d) whole; then FSDP over dp 2, 16 bytes a parameter
    "09.block-states": lambda: 12 * ((12 * 768 ** 2 + 7 * 768) / 2 + 6 * 768) / 2 * 16 / 1e6,
    "09.tp-bytes-per-step": lambda: 6 * 12 * 8 * 1024 * 768 * 4 / 1e6,  # tp 2: each rank sends the buffer once
    "09.audit-palm-mfu": lambda: 100 * costs.mfu(costs.model_flops_per_token(540.35e9, 118, 48 * 256, 2048) * 238_300,
                                                 n_devices=6144, peak=275e12),
    "10.ring-bytes": lambda: 7 * 2 * 4096 * 32 * 128 * 2 / 1e6,
    "10.ulysses-bytes": lambda: 4 * 7 / 8 * 4096 * 32 * 128 * 2 / 1e6,
    "10.llama3-gather": lambda: 15 * 2 * 8192 * 8 * 128 * 2 / 1e6,
    "10.hop-hides": lambda: 8 / 128 * 2 * costs.peak_flops(H100) / (2 * 50e9),
    "10.your-ring-overlap": lambda: 128 * 2.0 / 0.5,  # compute grows as c^2, the hop as c
    "10.audit-ulysses-constant": lambda: (15 / 16) / (7 / 8),
    "11.capacity": lambda: costs.moe_capacity(4096, 2, 64, 1.25),
    "11.all-to-all-bytes": lambda: 4096 * 2 * 4096 * 2 * 7 / 8 / 1e6,
    "11.all-to-all-time": lambda: 128 * costs.collective_time("all_to_all", 4096 * 2 * 4096 * 2, 8, 6e-6,
                                                              1 / 50e9) / 1e-3,
    "11.overlap-chunks": lambda: 2.0 + 2 * 0.8 / 4,
    "11.your-kept-bytes": lambda: 64 * 2 * 0.9 * 32 * 4 * 3 / 4 / 1024,
    "11.audit-mixtral-active": lambda: mixtral_active() / 1e9,
    "05.bubble-1f1b": lambda: 100 * costs.pipeline_bubble_fraction(4, 8),
    "05.bubble-ratio": lambda: 100 * costs.pipeline_bubble_ratio(8, 32),
    "05.bubble-interleaved": lambda: 100 * costs.pipeline_bubble_fraction(4, 8, 2),
    "05.fewest-micro-batches": lambda: 63,  # 7 / (m + 7) <= 0.1
    "05.in-flight-1f1b": lambda: costs.pipeline_peak_activations(8, 16, rank=2),
    "05.interleaved-memory": lambda: costs.pipeline_peak_activations(4, 8, 2, 0, "Interleaved1F1B") / 2 * 3.0,
    "05.your-step-more-micro-batches": lambda: 0.7 * (1 - 3 / 7) / 4 * 8 / (1 - 3 / 11),
    "07.zero2-7b5": lambda: costs.zero_memory_bytes(7.5e9, 64, 2) / 1e9,
    "07.zero1-7b5": lambda: costs.zero_memory_bytes(7.5e9, 64, 1) / 1e9,
    "07.largest-zero3": lambda: memory.largest_model(80e9, 64, 3) / 1e9,
    "07.zero3-comm": lambda: costs.zero_comm_volume(7.5e9, 3) / 1e9,
    "07.batch-that-fits": lambda: (80e9 - costs.zero_memory_bytes(7.5e9, 8, 1)) // 4e9,
    "07.audit-widget-vocab": lambda: (planner.shape_params("llama3-8b")["total"]
                                      - planner.shape_params(WIDGET)["total"]) / 1e9,
    "07.audit-widget-tp": lambda: planner.shape_params("llama3-8b")["total"] * 2 / 8 / 1e9,
    "12.zero1-fp32-grads": lambda: costs.zero_memory_bytes(planner.shape_params("llama3-8b")["total"], 64, 1,
                                                           grad_bytes=4) / 1e9,
    "12.first-stage-states": lambda: first_stage_states() / 2 ** 30,
    "12.interleaved-bubble": lambda: 100 * costs.pipeline_bubble_fraction(16, 2048 // 128, 4),
    "12.mfu": lambda: 100 * costs.mfu(900 * flops("llama3-70b", 4096), H100),
    "12.hfu": lambda: 100 * costs.hfu(900 * flops("llama3-70b", 4096, recompute="full"), H100),
    "12.published-step": lambda: 2048 * 8192 * flops("llama3-405b", 8192) / (16384 * 400e12),
    "12.megatron-mfu": lambda: 100 * published.read_published("Megatron-LM 1T (Narayanan et al. 2021)")["reported_mfu"],
    "12.audit-max-context": lambda: 100 * (flops("gpt-1.3b", 2048) / flops("gpt-1.3b", 1024) - 1),
    "12.audit-sparse-peak": lambda: 100 * 400e12 / costs.peak_flops(H100),
    # Llama 3's MTBF (54 days / 419) per GPU, scaled from 16,384 to 1,024 GPUs; Young/Daly in minutes
    "08c.your-interval": lambda: (2 * 0.25 * 54 * 86400 / 419 * 16384 / 1024) ** 0.5 / 60,
    "08c.goodput": lambda: 100 * 1800 / 1820 * (1 - (1800 + 1820 / 2) / (20 * 3600)),
    "08c.audit-hiccups": lambda: 1.0 + 0.4 * (1 - 0.999 ** 16384),
    "08c.async-gain": lambda: 100 * (async_goodput(0.5, 30.0) - async_goodput(20.0, 0.0)),
    "08c.one-slow-rank": lambda: 100 * ((0.8 * 1.2 + 0.2) / (0.8 + 0.2) - 1),  # the slowest rank's work + the sync
    # NCCL's default timeout (10 min) + a 5-minute restart, on 1,024 GPUs; 8 minutes saved a hang, 419 hangs
    "08b.hang-gpu-hours": lambda: 1024 * (600 + 300) / 3600,
    "08b.audit-timeout": lambda: 419 * 16384 * (600 - 120) / 3600,
    # a first-stage rank: tp 7 layers x 16 micro-batches x 4, all-gathers and reduce-scatters; dp 1 + 1; pp 16 + 16
    # tp: 4 all-gathers and 4 reduce-scatters a layer and micro-batch, and the embedding's two a micro-batch; dp: one
    # all-gather and one reduce-scatter a step; pp: a send and a receive a micro-batch
    "08b.fr-buffer-steps": lambda: 2000 / (2 * (7 * 16 * 4 + 16) + 1 + 1 + 2 * 16),
    "08b.rank0-save": lambda: planner.shape_params("llama3-70b")["total"] * 14 / 1e9 / 60,
    "08b.your-uneven-join": lambda: 100 * (7 - 4) / (2 * 7),  # Join: 7 steps on 2 ranks, rank 1 shadows 3
    "08d.your-samples-lost": lambda: 100 * 12 / (2 * 60),
    "08d.audit-replica-loss": lambda: 100 * 419 * 600 / (54 * 86400) / 128,
    "08d.heal-time": lambda: 30e-6 + planner.shape_params("llama3-70b")["total"] * 14 / 64 / 12.5e9,  # 100 GbE
    "08d.diloco-bytes": lambda: planner.shape_params("llama3-8b")["total"] * 4 * (10_000 // 500) / 1e12,
    "08d.diloco-link": lambda: 100 * diloco_sync() / (500 * 1.0 + diloco_sync()),
    # Llama 3 405B, tp 8 x pp 16 x dp 128, 16 micro-batches of one 8K sequence; the first stage holds 7 layers
    "13.pp-send": lambda: 16 * 8192 * 16384 * 2 / 8 / 1e9,  # a send a micro-batch, 1/tp of the sequence
    # 2 forward + 2 backward a layer and micro-batch, and the embedding's gradient gathered once a micro-batch
    "13.tp-gathers": lambda: (7 * 4 + 1) * 16 * 8192 * 16384 * 2 / 1e9,
    "13.audit-last-shard": lambda: 128256 // 8 - 126 * 127,  # pieces of ceil(16,032 / 128) = 126
    # the first stage's tp shard (7 layers and the embedding over tp 8): bf16 gathered, fp32 reduce-scattered
    "13.dp-traffic": lambda: first_stage_tp_shard() * (2 + 4) / 1e9,
    # per micro-batch 7 layers x 8 whole-sequence buffers and the embedding's 2, against 1/tp of one
    "13.tp-over-pp": lambda: (7 * 8 + 2) * 8,
}


def first_stage_tp_shard():
    """Llama 3 405B's first stage (7 layers and the embedding), one tp rank's eighth: its parameters."""
    return (7 * planner.shape_params("llama3-405b")["layer_dense"] + 128256 * 16384) / 8


def async_goodput(lost_s, lag_s, gpus=1024):
    """Goodput at Young/Daly's interval, Llama 3's MTBF (54 days / 419 on 16,384 GPUs) scaled to `gpus`."""
    mtbf = 54 * 86400 / 419 * 16384 / gpus
    tau = math.sqrt(2 * lost_s * mtbf)
    return tau / (tau + lost_s) * (1 - ((tau + lost_s) / 2 + lag_s) / mtbf)


def diloco_sync():
    """One sync of Llama 3 8B's fp32 pseudo-gradient, a 2-rank ring all-reduce over 100 Gb/s, 10 ms a message."""
    return 2 * 0.01 + planner.shape_params("llama3-8b")["total"] * 4 / 12.5e9


# Published figures the answers must agree with (the ZeRO paper's Figure 1, Llama 3's parameter count, the
# memory calculator's preset): the course's formulas reproduce them.
PUBLISHED_FIGURES = {"07.zero1-7b5": 31.4, "07.zero2-7b5": 16.6, "07.audit-widget-vocab": 8.03 - 6.57,
                     "12.interleaved-bubble": 100 * 3.75 / 19.75, "09.audit-palm-mfu": 46.2}


def test_each_chapter_has_five_problems_or_more_and_three_audits_in_all():
    assert set(problems.CHAPTERS) == {"01", "02", "03", "04", "05", "06", "07", "07b", "08", "08b", "08c", "08d",
                                      "09", "10", "11", "12", "13"}
    for chapter, ps in problems.CHAPTERS.items():
        assert len(ps) >= 5, chapter
    for chapter in ("02", "03", "04", "06", "07b", "08", "08b", "08c", "08d", "09", "10", "11"):  # one of each
        assert {"your run", "audit"} <= {p.level for p in problems.CHAPTERS[chapter]}, chapter
    assert sum(p.level == "audit" for p in ALL) >= 3
    assert len({p.id for p in ALL}) == len(ALL)  # ids unique
    assert {p.level for p in ALL} == set(LEVELS)
    assert all(p.chapter == ch for ch, ps in problems.CHAPTERS.items() for p in ps)


@pytest.mark.parametrize("problem", ALL, ids=lambda p: p.id)
def test_the_answer_is_the_courses_call(problem):
    assert callable(problem.work) and base.course_calls(problem.work)
    assert problem.answer == pytest.approx(problem.values()["answer"] / problem.scale)
    assert problem.answer == pytest.approx(EXPECTED[problem.id](), rel=1e-9)
    if problem.id in PUBLISHED_FIGURES:
        assert problem.answer == pytest.approx(PUBLISHED_FIGURES[problem.id], abs=0.06)


def test_every_problem_has_an_expected_value_here():
    assert set(EXPECTED) == {p.id for p in ALL}


@pytest.mark.parametrize("problem", ALL, ids=lambda p: p.id)
def test_the_worked_solution_states_the_computed_numbers(problem):
    text = problem.solution_text()
    assert problem.answer_text() in text
    values = {**problem.inputs, **problem.values()}
    for name in base.fields(problem.solution) - {"answer"}:  # each step named in the template, as computed
        assert name in values, f"{problem.id}: {name} is neither an input nor a computed value"
    assert "{" not in text and "}" not in text
    assert "gpucourse.models:" in text
    assert not gives_away(problem, problem.question_text())  # the question gives the inputs, never the answer
    assert problem.hint and problem.hint not in text


@pytest.mark.parametrize("problem", ALL, ids=lambda p: p.id)
def test_every_problem_is_marked_right_hint_then_solution(problem):
    p = problem.given()
    right = p.check(p.format(p.answer))
    assert right.correct and right.kind == "right" and p.answer_text() in right.text
    wrong = p.answer * 3 + 7
    first = p.check(wrong)
    assert not first.correct and first.kind == "hint" and p.hint in first.text and p.answer_text() not in first.text
    second = p.check(wrong)
    assert second.kind == "solution" and p.solution_text() in second.text


@pytest.mark.parametrize("problem", [p for p in ALL if p.traps], ids=lambda p: p.id)
def test_a_known_slip_is_named(problem):
    for key, message in problem.traps.items():
        p = problem.given()
        slip = p.values()[key] / p.scale
        assert not p.is_right(slip), f"{p.id}: the slip {key} gives the right answer"
        assert message in p.check(slip, record=False).text


def test_a_typed_answer_is_refused():
    kw = dict(question="q {x}", inputs={"x": 1}, unit="GB", hint="h", solution="{answer}")
    with pytest.raises(ValueError, match="not a typed value"):
        Problem("07.typed", work=42.0, **kw)
    with pytest.raises(ValueError, match="calls nothing from gpucourse.models"):
        Problem("07.typed", work=lambda x: {"answer": 42.0}, **kw)
    Problem("07.computed", work=lambda x: {"answer": costs.zero_comm_volume(x, 0)}, **kw)  # a call: accepted


@pytest.mark.parametrize("change, match", [({"id": "zero"}, "NN.slug"), ({"level": "hard"}, "level"),
                                           ({"solution": "no answer"}, "answer"), ({"question": "{y}"}, "inputs"),
                                           ({"own": ("y",)}, "own")])
def test_a_malformed_problem_is_refused(change, match):
    kw = dict(id="07.ok", question="q {x}", inputs={"x": 1.0}, work=lambda x: {"answer": costs.zero_comm_volume(x, 0)},
              unit="GB", hint="h", solution="{answer}")
    with pytest.raises(ValueError, match=match):
        Problem(**{**kw, **change})


@pytest.mark.parametrize("typed, unit, value", [("1,234.5", "GB", 1234.5), ("16.6 GB", "GB", 16.6), ("19 %", "%", 19),
                                                ("1.2e3", "µs", 1200.0), (7, "", 7.0)])
def test_numbers_are_read_as_learners_type_them(typed, unit, value):
    assert parse_number(typed, unit) == value


def test_unreadable_input_is_not_counted_or_recorded(progress):
    p = problems.get("05.bubble-1f1b")
    fb = p.check("about a third")
    assert fb.kind == "unread" and p.wrong_tries == 0 and not progress.exists()


def test_own_run_inputs_replace_the_defaults():
    mine = problems.show("01.your-busbw-predict", time_ms=40.0)
    assert mine.answer == pytest.approx(problems.get("01.your-busbw-predict").answer / 2)
    assert "40.0 ms" in mine.question_text() and "time_ms" in mine.text()
    with pytest.raises(ValueError, match="no input"):
        problems.show("01.your-busbw-predict", nope=1)
    with pytest.raises(ValueError, match="no problem"):
        problems.show("12.no-such-problem")
    with pytest.raises(ValueError, match="no problems for chapter"):
        problems.show("99")


def test_a_chapter_passes_its_own_run_numbers_to_its_your_run_problems(monkeypatch):
    chapter = problems.show("01", mine={"your-busbw-predict": {"time_ms": 40.0, "size_mib": 64.0},
                                        "01.your-alpha": {"small_us": np.float64(123.456789)}})
    mine = {p.id: p for p in chapter}
    predict = mine["01.your-busbw-predict"]
    assert predict.answer == pytest.approx(problems.get("01.your-busbw-predict").answer / 2)
    assert predict.measured == ("size_mib", "time_ms") and predict.inputs["size_mib"] == 64  # a whole number stays int
    assert "64 MiB" in predict.question_text() and "40.0 ms" in predict.question_text()
    assert "Your own run's numbers, measured in this chapter: size_mib = 64, time_ms = 40.0" in predict.text()
    assert "Illustrative, not from your run: n; pass your own with problems.show('01', mine=" in predict.text()
    alpha = mine["01.your-alpha"]  # kept to 4 significant figures: the question shows what the answer uses
    assert alpha.inputs["small_us"] == 123.5 and "123.5 µs" in alpha.question_text()
    assert alpha.answer == pytest.approx(costs.fit_alpha_beta([4096, 64 * MiB], [123.5e-6, 0.08], n=2).alpha / 1e-6)
    untouched = problems.show("01")
    assert all(not p.measured for p in untouched) and "Illustrative, not from your run" in str(untouched)
    assert "Your own run's numbers" not in str(untouched) and "Your own run's numbers" not in str(mine["01.ring-time-nvlink"])
    title = predict.widget().children[0].value
    assert "Your own run&#x27;s numbers" in title and "time_ms = 40.0" in title
    assert predict.given(time_ms=80.0).measured == ("size_mib",)  # an input replaced is no longer the run's


def test_a_runs_shapes_change_the_answer_as_the_formulas_say():
    """The inputs a chapter's run gives besides its times (07b's model, 10's heads and head_dim) enter the answer."""
    mine = problems.show("07b", mine={"your-recompute-time": {"layers": 2, "width": 128, "none_ms": 12.0}})
    p = {q.id: q for q in mine}["07b.your-recompute-time"]
    sizes = dict(batch=4, layers=2, width=128, matmul_params=2 * 12 * 128 ** 2 + 65 * 128,
                 block_matmul_params=2 * 12 * 128 ** 2)
    ratio = recompute.expected_flops(256, "full", **sizes) / recompute.expected_flops(256, "none", **sizes)
    assert p.answer == pytest.approx(12.0 * ratio) and "2-layer GPT of width 128" in p.question_text()
    ring = problems.show("10", mine={"your-ring-overlap": {"block_tokens": 32, "head_dim": 16, "kv_heads": 2,
                                                           "compute_ms": 0.25, "hop_ms": 1.5}})
    assert {q.id: q for q in ring}["10.your-ring-overlap"].answer == pytest.approx(32 * 1.5 / 0.25)  # c x hop / compute


def test_08b_and_08d_take_their_runs_counts_as_the_formulas_say():
    """08b's uneven shards (ch08b.shard_batches) and 08d's committed steps (ch08d.short_steps) enter the answer."""
    join = {p.id: p for p in problems.show("08b", mine={"your-uneven-join": {"most": 5, "fewest": 5}})}
    assert join["08b.your-uneven-join"].answer == 0  # even shards: Join idles no step
    join = {p.id: p for p in problems.show("08b", mine={"your-uneven-join": {"most": 9, "fewest": 3}})}
    assert join["08b.your-uneven-join"].answer == pytest.approx(100 * 6 / 18)
    lost = {p.id: p for p in problems.show("08d", mine={"your-samples-lost": {"replicas": 2, "steps": 9,
                                                                              "short": 3}})}
    p = lost["08d.your-samples-lost"]
    assert p.answer == pytest.approx(100 * 3 / 18) and p.measured == ("replicas", "steps", "short")
    assert "2 replica groups committed 9 steps, 3 of them" in p.question_text()
    wrong = p.check(50)
    assert wrong.kind == "hint" and p.hint in wrong.text
    assert "3 batches missing of 2 x 9 = 18: 16.67 %" in p.check(50).text  # the second: the worked solution


@pytest.mark.parametrize("mine, error, match", [
    ({"no-such": {"n": 2}}, ValueError, r"no problem 'no-such'; chapter 01's your-run problems: your-busbw-predict"),
    ({"your-accumulation": {"accum": 2}}, ValueError, r"02.your-accumulation is chapter 02's, not chapter 01's"),
    ({"02.your-accumulation": {"accum": 2}}, ValueError, r"chapter 02's, not chapter 01's"),
    ({"busbw-all-reduce": {"n": 2}}, ValueError, r"takes no numbers from your run: it is an 'apply' problem"),
    ({"your-alpha": {"nope": 1}}, ValueError, r"01.your-alpha has no input nope; the ones from your run: small_kib"),
    ({"your-busbw-predict": {"predict_n": 8}}, ValueError, r"predict_n is part of the question, not read off your run"),
    ({"your-alpha": {"n": "2"}}, TypeError, r"n must be a number from your run, got str"),
    ({"your-alpha": {"n": True}}, TypeError, r"n must be a number from your run, got bool"),
    ({"your-alpha": {"n": 2.5}}, TypeError, r"n counts whole things, got 2.5"),
    ({"your-alpha": {"small_us": float("nan")}}, ValueError, r"small_us must be a finite number >= 0"),
    ({"your-alpha": {"small_us": -3.0}}, ValueError, r"finite number >= 0"),
    ({"your-alpha": [("n", 2)]}, TypeError, r"as a dict of input: value"),
    ([("your-alpha", {"n": 2})], TypeError, r"mine must be a dict"),
    ({"your-alpha": {"n": 2}, "01.your-alpha": {"n": 4}}, ValueError, r"given twice"),
])
def test_a_chapters_run_numbers_are_refused_with_what_was_wrong(mine, error, match):
    with pytest.raises(error, match=match):
        problems.show("01", mine=mine)


def test_a_tensor_from_a_run_is_refused_with_how_to_pass_it():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"pass float\(x\) or x.item\(\)"):
        problems.show("01", mine={"your-alpha": {"small_us": torch.tensor(3.0)}})
    assert problems.show("01", mine={"your-alpha": {"n": np.int64(4)}}).problems[-1].inputs["n"] == 4
    with pytest.raises(ValueError, match="mine= goes with a chapter"):
        problems.show("01.your-alpha", mine={"n": 2})
    with pytest.raises(ValueError, match=r"mine=\{problem"):
        problems.show("01", n=2)


def test_widget_marks_wrong_with_the_hint_then_the_solution_then_right(monkeypatch, progress):
    p = problems.show("12.interleaved-bubble")
    title, row, feedback = p.widget().children
    answer, unit, button = row.children
    assert "pipeline bubble" in title.value and unit.value == "%" and p.source[:20] in title.value
    button.click()
    assert "Type a number" in feedback.value
    answer.value = "48.4"  # plain 1F1B's bubble: the slip is named, then the hint
    button.click()
    assert "#c62828" in feedback.value and "interleaving" in feedback.value and "Hint" in feedback.value
    answer.value = "25"
    button.click()
    assert "Worked solution" in feedback.value and "19.0 %" in feedback.value and "Hint" not in feedback.value
    answer.value = "19.0"
    button.click()
    assert "#2e7d32" in feedback.value and "Correct" in feedback.value
    assert [r["right"] for r in problems.read_progress(progress)] == [False, False, True]
    monkeypatch.setattr(base, "in_kernel", lambda: True)
    assert "application/vnd.jupyter.widget-view+json" in p._repr_mimebundle_()


def test_a_chapter_shows_as_one_set():
    chapter = problems.show("12")
    assert len(chapter) == len(problems.CHAPTERS["12"]) and len(chapter.widget().children) == len(chapter) + 1
    text = str(chapter)
    assert "12.mfu" in text and not any(gives_away(p, text) for p in chapter)
    assert chapter._repr_mimebundle_() == {"text/plain": text}  # no kernel here: text only


def test_progress_goes_to_the_workspace_never_the_course_notebooks(tmp_path, monkeypatch):
    monkeypatch.delenv(base.PROGRESS_ENV)
    checkout = tmp_path / "course"
    (checkout / "notebooks").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text('name = "gpucourse"\n')
    (checkout / "mywork").mkdir()
    assert progress_file(checkout / "notebooks") == checkout / "mywork" / base.PROGRESS_FILE
    assert progress_file(checkout / "mywork") == checkout / "mywork" / base.PROGRESS_FILE
    assert progress_file(tmp_path / "notebooks") == tmp_path / "mywork" / base.PROGRESS_FILE
    elsewhere = tmp_path / "colab"
    elsewhere.mkdir()
    assert progress_file(elsewhere) == elsewhere / base.PROGRESS_FILE
    monkeypatch.chdir(checkout / "notebooks")
    path = base.record_answer(problems.get("07.zero1-7b5"), "31.4", True)
    assert path == checkout / "mywork" / base.PROGRESS_FILE and not list((checkout / "notebooks").iterdir())


def test_gpucourse_progress_counts_problems_answered_right_per_chapter(progress, tmp_path):
    for pid, typed in [("07.zero1-7b5", "30"), ("07.zero1-7b5", "31.4"), ("07.zero2-7b5", "16.64"),
                       ("12.mfu", "54.5"), ("01.busbw-all-reduce", "313.2")]:
        problems.get(pid).check(typed)
    progress.open("a").write("a torn line\n")
    summary = problems.progress(progress)
    assert summary["07"] == {"problems": len(problems.CHAPTERS["07"]), "tried": 2, "right": 2}
    assert summary["12"]["right"] == 0 and summary["12"]["tried"] == 1 and summary["05"]["tried"] == 0
    out = run_cli("progress", env={base.PROGRESS_ENV: str(progress)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"chapter 07: 2 of {len(problems.CHAPTERS['07'])} right (2 tried)" in out.stdout
    assert "chapter 01: 1 of" in out.stdout and "chapter 12: 0 of" in out.stdout and str(progress) in out.stdout
    lines = [json.loads(x) for x in progress.read_text().splitlines()[:-1]]
    assert {"time", "chapter", "problem", "typed", "right"} <= set(lines[0])
    empty = run_cli("progress", "--file", tmp_path / "none.jsonl", cwd=tmp_path)
    assert empty.returncode == 0 and "No answers recorded yet" in empty.stdout


def test_course_calls_reads_the_models_functions_a_work_uses():
    calls = base.course_calls(problems.get("12.megatron-mfu").work)
    assert "published.read_published" in calls and "published.megatron_flops_per_iteration" in calls
    assert "planner.shape_of" in calls and not any(c.startswith("published.shape_of") for c in calls)
    assert not math.isnan(problems.get("12.megatron-mfu").answer)


# What a chapter's problems cell cannot pass: 09's run is not GPT-2 small on H100s (its tokens/s and GPUs would be
# another model's on another machine), so only its vocabulary goes in.
NOT_FROM_THE_RUN = {"09.your-mfu": {"tokens_per_s", "gpus"}}


def test_each_chapter_passes_its_run_numbers_to_its_your_run_problems():
    """Each chapter's problems.show cell names every your-run problem of the chapter in mine=, with every input
    its run gives (read from the cell's text: the values are computed there, from the chapter's own results)."""
    import ast

    import nbformat

    from gpucourse.tools.course import chapter_key, find_notebooks

    for path in find_notebooks():
        chapter = chapter_key(path)
        yours = [p for p in problems.CHAPTERS.get(chapter, []) if p.own]
        if not yours:
            continue
        cells = [c.source for c in nbformat.read(path, as_version=4).cells
                 if c.cell_type == "code" and f'problems.show("{chapter}"' in c.source]
        assert len(cells) == 1, f"{path.name}: one problems.show({chapter!r}) cell"
        tree = ast.parse(cells[0])
        show = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "show"][0]
        mine = [k.value for k in show.keywords if k.arg == "mine"]
        assert mine, f"{path.name}: problems.show({chapter!r}) passes no mine="
        named = {ast.literal_eval(k): v for d in ast.walk(mine[0]) if isinstance(d, ast.Dict)
                 for k, v in zip(d.keys, d.values) if k is not None and isinstance(k, ast.Constant)}
        for p in yours:
            slug = p.id.partition(".")[2]
            assert slug in named or p.id in named, f"{path.name}: {p.id} gets none of the run's numbers"
            words = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            given = words | {f"{w}_ms" for w in words}  # 03 builds its names: f"{k}_ms" for k in ("compute", ...)
            missing = set(p.own) - given - NOT_FROM_THE_RUN.get(p.id, set())
            assert not missing, f"{path.name}: {p.id} is not given {sorted(missing)} from the run"
