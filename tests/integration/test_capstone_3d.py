"""The 3-D capstone (scripts/13_gpt_3d.py): pipeline x FSDP x tensor parallel at world 8 (2 x 2 x 2, gloo, float64)
computes what one process computes, and communicates what the formulas say, per process group.

The run is chapter 13's own (its smoke run, which CI executes anyway: `smoke_chapter`), with the course's counter
on ($GPUCOURSE_COUNT_FILE: each rank's collectives and point-to-point calls of the last step, by op and process
group) in a launch of the right code alone; its arguments are checked to be these tests'. Another launch trains
chapter 13's six silent bugs, then the right code (--bug ...,none), uncounted: the tests read the right code's
records. The script itself trains the one-process model beside the 3-D one and compares every step's loss and
every gradient (its own shard of it). Then a fake-tensor dry run of its first and last ranks, held to the same
counts.
"""
import importlib.util
import json

import pytest

from tests.conftest import ROOT, chapter, chapter_run

CHAPTER = ROOT / "notebooks" / "13_3d_parallel_and_silent_bugs.ipynb"
SCRIPT = ROOT / "scripts" / "13_gpt_3d.py"
PP, DP, TP, MICRO, STEPS = 2, 2, 2, 2, 2
LAYERS, D_MODEL, HEADS, CONTEXT, BATCH = 2, 32, 2, 16, 8
ARGS = ["--pp", PP, "--dp", DP, "--tp", TP, "--micro", MICRO, "--steps", STEPS, "--layers", LAYERS,
        "--d-model", D_MODEL, "--heads", HEADS, "--context", CONTEXT, "--batch", BATCH, "--schedule", "1f1b",
        "--clip-norm", 1.0]
WORLD = PP * DP * TP
pytestmark = [pytest.mark.timeout(900), *chapter(CHAPTER.stem)]  # one worker runs the chapter, once


def load_script():
    spec = importlib.util.spec_from_file_location("gpt_3d", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(smoke_chapter):
    result, runs = smoke_chapter(CHAPTER)
    assert result.status == "ok", f"chapter 13 failed in cell {result.failing_cell}: {result.error}"
    res = chapter_run(runs, "13-gpt-3d")
    assert res.ok, f"{res.run_dir.name}: {res.error.summary if res.error else res.status}"
    given = json.loads((res.run_dir / "manifest.json").read_text())["args"]
    pairs, ours = dict(zip(given[::2], given[1::2])), {str(k): str(v) for k, v in zip(ARGS[::2], ARGS[1::2])}
    assert ours.items() <= pairs.items(), f"chapter 13's run is not these tests' sizes: {given}"
    return res


@pytest.fixture(scope="module")
def counted(run, smoke_chapter):
    """Chapter 13's counted launch: the right code alone, the same arguments, the counter on."""
    _, runs = smoke_chapter(CHAPTER)
    res = chapter_run(runs, "13-gpt-3d-counted")
    assert res.ok, f"{res.run_dir.name}: {res.error.summary if res.error else res.status}"
    given = json.loads((res.run_dir / "manifest.json").read_text())["args"]
    pairs, ours = dict(zip(given[::2], given[1::2])), {str(k): str(v) for k, v in zip(ARGS[::2], ARGS[1::2])}
    assert ours.items() <= pairs.items(), f"chapter 13's counted run is not these tests' sizes: {given}"
    assert (res.run_dir / "counts" / "rank0.json").exists(), "chapter 13's counted run no longer counts"
    return res


@pytest.fixture(scope="module")
def counts(counted):
    """{rank: {(op, group): (calls, bytes)}} of the last step."""
    found = {}
    for r in range(WORLD):
        rec = json.loads((counted.run_dir / "counts" / f"rank{r}.json").read_text())
        assert rec["step"] == STEPS - 1 and not rec["dry"]
        found[r] = {(c["op"], tuple(c["group"])): (c["calls"], c["bytes"]) for c in rec["comms"]}
    return found


def coords(rank):
    """(pp, dp, tp) of a global rank: tp innermost."""
    return rank // (DP * TP), rank // TP % DP, rank % TP


def test_every_loss_and_gradient_equals_one_process(run):
    for rank in range(WORLD):
        pp = coords(rank)[0]
        steps = [m for m in run.metrics[rank] if "step" in m and m["bug"] == "none"]
        assert [m["step"] for m in steps] == list(range(STEPS))
        assert all(m["grad_diff"] <= 1e-10 and m["grads_compared"] > 0 for m in steps), (rank, steps)
        if pp == PP - 1:  # the last stage computes the loss
            assert all(m["loss_diff"] <= 1e-10 for m in steps), (rank, steps)
            assert all(m["loss"] == pytest.approx(m["ref_loss"], abs=1e-10) for m in steps)
        (summary,) = [m for m in run.metrics[rank] if m.get("summary") and m["bug"] == "none"]
        assert summary["checked"] and summary["max_grad_diff"] <= 1e-10


def test_the_stages_hold_every_parameter_of_the_model_once(run):
    gpt = load_script()
    model = gpt.GPT(64, CONTEXT, D_MODEL, HEADS, LAYERS)
    names = {n for n, _ in model.named_parameters()}
    per_stage = {}
    for rank in range(WORLD):
        (header,) = [m for m in run.metrics[rank] if m.get("header") and m["bug"] == "none"]
        assert header["vocab"] == 64 and (header["pp_rank"], header["dp_rank"], header["tp_rank"]) == coords(rank)
        per_stage.setdefault(header["pp_rank"], set(header["stage_params"]))
        assert set(header["stage_params"]) == per_stage[header["pp_rank"]]  # the same part on a stage's ranks
    assert set.union(*per_stage.values()) == names and sum(map(len, per_stage.values())) == len(names)


def test_pipeline_sends_one_activation_per_micro_batch_to_the_same_tp_rank_of_the_next_stage(counts):
    """1F1B at 2 stages: stage 0 sends each micro-batch's activation and receives its gradient; in the steady
    state the schedule fuses a send with a receive in one batch_isend_irecv. A message is a tp rank's slice of the
    sequence: micro-batch x context / tp x d_model, float64."""
    message = BATCH // DP // MICRO * CONTEXT // TP * D_MODEL * 8
    for rank in range(WORLD):
        pp, dp, tp = coords(rank)
        group = tuple(sorted({rank, (1 - pp) * DP * TP + dp * TP + tp}))
        p2p = {op: v for (op, g), v in counts[rank].items() if op in ("isend", "irecv", "batch_isend_irecv")}
        assert all(g == group for (op, g) in counts[rank] if op in p2p), counts[rank]
        fused = p2p.get("batch_isend_irecv", (0, 0))[0]
        sends, recvs = p2p.get("isend", (0, 0)), p2p.get("irecv", (0, 0))
        assert sends[0] + fused == MICRO and recvs[0] + fused == MICRO, p2p
        assert sends[1] == sends[0] * message and recvs[1] == recvs[0] * message, p2p


def test_tensor_parallel_collectives_are_the_sequence_parallel_formulas(counts):
    """Per block and micro-batch, forward: the sequence all-gathered before attention and the MLP, reduce-scattered
    after out and proj; backward the opposite: 4 all-gathers and 4 reduce-scatters. The first stage's embedding
    output is cut into sequence slices (backward: 1 all-gather a micro-batch); the last stage's head all-gathers its
    input and its vocabulary-sharded logits (2), and reduce-scatters its input's gradient (1). The norms' replicated
    weights and biases (partial sums over the tp ranks' slices) are all-reduced once a step."""
    per = LAYERS // PP
    act = BATCH // DP // MICRO * CONTEXT * D_MODEL * 8  # a whole micro-batch activation (the gathered buffer)
    logits = BATCH // DP // MICRO * CONTEXT * 64 * 8
    for rank in range(WORLD):
        pp, _, _ = coords(rank)
        first, last = pp == 0, pp == PP - 1
        group = tuple(range(rank - rank % TP, rank - rank % TP + TP))
        got = {op: v for (op, g), v in counts[rank].items() if g == group}
        gathers = 4 * per * MICRO + MICRO * first + 2 * MICRO * last
        scatters = 4 * per * MICRO + MICRO * last
        norms = 2 * (2 * per + last)
        assert got == {"all_gather_single": (gathers, (gathers - MICRO * last) * act + MICRO * last * logits),
                       "reduce_scatter_single": (scatters, scatters * act),
                       "all_reduce": (norms, norms * D_MODEL * 8)}, (rank, got)


def test_clipping_sums_its_norm_once_over_every_rank(counts):
    """Gradient clipping needs the whole model's gradient norm: each rank's sum of squares, all-reduced once over
    every rank (8 bytes, float64); no other collective spans the stages."""
    for rank in range(WORLD):
        whole = {op: v for (op, g), v in counts[rank].items() if g == tuple(range(WORLD))}
        assert whole == {"all_reduce": (1, 8)}, (rank, counts[rank])


def test_fsdp_gathers_and_reduces_each_unit_once_a_step_over_dp(counts):
    """reshard_after_forward=False: each FSDP unit (a block, the stage's root) is all-gathered once a step, and its
    gradients reduce-scattered once, after the last micro-batch (the schedule turns gradient sync off before).
    The last stage also averages its loss over dp (1 all-reduce)."""
    units = LAYERS // PP + 1
    for rank in range(WORLD):
        pp, dp, tp = coords(rank)
        group = tuple(sorted(pp * DP * TP + d * TP + tp for d in range(DP)))
        got = {op: v[0] for (op, g), v in counts[rank].items() if g == group}
        assert got == {"all_gather_single": units, "reduce_scatter_single": units,
                       **({"all_reduce": 1} if pp == PP - 1 else {})}, (rank, got)


def test_a_fake_tensor_dry_run_counts_what_the_real_run_does(counted):
    """gpucourse dryrun, --fake-tensors, the first and the last rank (first and last stage) of the same world and
    sizes: the same calls and bytes per process group, the same model states as the gloo run counted. (FLOPs are
    not compared: the real run also trains the one-process model; a dry run leaves the check out.)"""
    from gpucourse.run import dryrun as dr

    dry = dr.dryrun(SCRIPT, world=WORLD, ranks=[0, WORLD - 1], args=[str(a) for a in ARGS], timeout=300,
                    fake_tensors=True)
    assert dry["fake_tensors"]
    for rank in dry["ranks"]:
        real = json.loads((counted.run_dir / "counts" / f"rank{rank['rank']}.json").read_text())
        assert rank["dry"] and rank["step"] == real["step"] == STEPS - 1
        assert rank["comms"] == real["comms"] and rank["model_states"] == real["model_states"]
