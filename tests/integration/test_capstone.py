"""Chapter 09's script: a GPT trained on a dp x tp mesh computes what one process computes on the whole batch.

The reference is trained here, in the test process, with a loop written independently of the script's
(plain model, no process group): same seed, same global batches, same optimizer. The 2 x 2 run is chapter 09's own
(its smoke run, which CI executes anyway: `smoke_chapter`); the other meshes are launched here, side by side.
"""
import importlib.util
from types import SimpleNamespace

import pytest
import torch

import gpucourse
from gpucourse.tools.course import smoke_parameters

from tests.conftest import ROOT, chapter, chapter_run

CHAPTER = ROOT / "notebooks" / "09_capstone_2d_parallel.ipynb"
pytestmark = chapter(CHAPTER.stem)  # one worker: the chapter and the launches its tests share are run once

SCRIPT = ROOT / "scripts" / "09_gpt_2d.py"
STEPS, TOL = smoke_parameters(CHAPTER)["STEPS"], 1e-4  # the steps of the chapter's smoke runs, and so of ours
MESHES = [(2, 2, "fsdp"), (1, 2, "fsdp"), (2, 1, "allreduce")]  # (dp, tp, how the dp dimension is done)
FROM_CHAPTER = {(2, 2, "fsdp"): "09-gpt-2x2-fsdp"}  # meshes chapter 09's smoke run trains: its runs are read
# What a run's arguments set that shapes its losses and counts (the rest: timing, profiling, text sample, evaluation)
TRAINING = ("dp", "tp", "dp_mode", "layers", "d_model", "heads", "context", "batch", "steps", "lr", "dtype", "data",
            "seed")


def load_script():
    spec = importlib.util.spec_from_file_location("gpt_2d", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_losses(gpt, args) -> list[float]:
    """One process, the whole global batch, the script's defaults for everything not in `args`."""
    torch.manual_seed(args.seed)  # what runtime.setup(seed=..., seed_per_rank=False) does on every rank
    data = gpt.CharData(args.data)
    model = gpt.GPT(data.vocab_size, args.context, args.d_model, args.heads, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = data.batch("train", args.batch, args.context, seed=args.seed * 100_003 + step)
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_args(mesh) -> list[str]:
    dp, tp, mode = mesh
    return ["--dp", str(dp), "--tp", str(tp), "--dp-mode", mode, "--steps", str(STEPS), "--warmup-steps", "1",
            "--eval-batches", "0", "--sample", "0"]


def train(mesh):
    dp, tp, mode = mesh
    return gpucourse.launch(SCRIPT, nproc=dp * tp, timeout=240, name=f"capstone-{dp}x{tp}-{mode}",
                            args=train_args(mesh), env={"OMP_NUM_THREADS": "1"}, check=False)


@pytest.fixture(scope="module")
def runs(launched, smoke_chapter, gpt):
    """The three meshes' runs: the chapter's where it makes one, the others launched side by side once."""
    own = [mesh for mesh in MESHES if mesh not in FROM_CHAPTER]
    found = dict(zip(own, launched(train, *own, parallel=len(own))))
    _, folder = smoke_chapter(CHAPTER)
    for mesh, name in FROM_CHAPTER.items():
        found[mesh] = chapter_run(folder, name)
        ran, ours = (vars(gpt.parse_args(a)) for a in (found[mesh].manifest["args"], train_args(mesh)))
        assert {k: ran[k] for k in TRAINING} == {k: ours[k] for k in TRAINING}, (
            f"chapter 09's {name} no longer trains what this test's {mesh} run would: align its smoke sizes")
    return found


@pytest.fixture(scope="module")
def gpt():
    return load_script()


@pytest.fixture(scope="module")
def reference(gpt):
    return reference_losses(gpt, gpt.parse_args([]))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}-{m[2]}")
def test_mesh_run_matches_single_process(runs, reference, mesh):
    res = runs[mesh]
    assert res.ok, f"{res.run_dir.name}: {res.error.summary if res.error else res.status}"
    assert reference[-1] < reference[0] - 0.1, f"the reference does not learn: {reference}"
    for rank in range(mesh[0] * mesh[1]):
        losses = res.metric("loss", rank=rank)
        assert len(losses) == STEPS, f"rank {rank} logged {len(losses)} losses, expected {STEPS}"
        diff = max(abs(a - b) for a, b in zip(losses, reference))
        assert diff < TOL, f"{mesh} rank {rank}: losses {losses} vs one process {reference} (max diff {diff:.2e})"


TP_SHARDED = ("attn.q.", "attn.k.", "attn.v.", "mlp.fc.", "attn.out.weight", "mlp.proj.weight")  # not row biases


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}-{m[2]}")
def test_memory_counts_local_shards(runs, gpt, mesh):
    """Each rank holds 1/tp of the TP-split tensors, 1/dp of everything under FSDP (whole copies under the
    plain all-reduce), a gradient per parameter and AdamW's two moments."""
    dp, tp, mode = mesh
    args = gpt.parse_args([])
    model = gpt.GPT(gpt.CharData(args.data).vocab_size, args.context, args.d_model, args.heads, args.layers)
    expected = sum(p.numel() * 4 / (tp if any(k in name for k in TP_SHARDED) else 1) / (dp if mode == "fsdp" else 1)
                   for name, p in model.named_parameters())
    for rank in range(dp * tp):
        summary = next(m for m in runs[mesh].metrics[rank] if m.get("summary"))
        params = summary["param_bytes"]
        assert params == pytest.approx(expected, rel=0.01), (
            f"{mesh} rank {rank}: {params} parameter bytes, expected {expected:.0f} (local shards only)")
        assert summary["grad_bytes"] == params, f"{mesh} rank {rank}: every parameter should have its gradient"
        assert summary["optim_bytes"] == 2 * params, f"{mesh} rank {rank}: AdamW state should be 2x the params"
        assert summary["tokens_per_s"] > 0


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}-{m[2]}")
def test_tp_all_reduces_per_block_are_two_forward_four_backward(runs, mesh):
    """With q, k, v as three column-parallel layers, backward all-reduces the input gradient of each of them and
    of fc: 4 (Megatron's fused QKV would make it 2); forward sums out and proj: 2. tp = 1: nothing to sum."""
    dp, tp, _ = mesh
    want = {"forward": 2, "backward": 4} if tp > 1 else {"forward": 0, "backward": 0}
    for rank in range(dp * tp):
        blocks = next(m["block_all_reduces"] for m in runs[mesh].metrics[rank] if "block_all_reduces" in m)
        assert blocks and all(b == want for b in blocks), f"{mesh} rank {rank}: {blocks}, expected {want} per block"


@pytest.mark.parametrize("dp, tp, heads, batch, words", [(2, 2, 4, 16, "ranks"), (1, 3, 4, 16, "--heads"),
                                                         (2, 1, 4, 15, "--batch")])
def test_bad_sizes_get_a_clear_error(gpt, dp, tp, heads, batch, words):
    args = SimpleNamespace(dp=dp, tp=tp, heads=heads, d_model=64, batch=batch)
    with pytest.raises(ValueError, match=words):
        gpt.check_sizes(args, world_size=3 if words == "ranks" else dp * tp)


@pytest.mark.parametrize("layers,d_model,heads,context,batch", [(2, 64, 4, 64, 3), (3, 48, 6, 40, 2)])
def test_flops_per_token_is_what_flop_counter_mode_counts(gpt, layers, d_model, heads, context, batch):
    """6 N + 12 L d T, per token, is exactly what torch's FlopCounterMode counts in one forward + backward of the
    chapter's model, with attention computed by the math path (matmuls it sees). The counter ignores the causal
    mask (it counts the full T x T scores), like PaLM's convention: causal=True is a different, smaller count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    vocab = 65
    model = gpt.GPT(vocab, context, d_model, heads, layers)
    x, y = torch.randint(vocab, (batch, context)), torch.randint(vocab, (batch, context))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(x, y)[1].backward()
    tokens = batch * context
    assert counter.get_total_flops() == gpt.flops_per_token(model) * tokens
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert gpt.flops_per_token(model) == 6 * linear_weights + 12 * layers * d_model * context  # by hand
    assert gpt.flops_per_token(model, causal=True) == 6 * linear_weights + 6 * layers * d_model * (context + 1)


def test_compile_flag_compiles_the_training_steps(tmp_path):
    """--compile must compile the model the steps call. Compiled before the all-reduce count, its first call ran
    under CommDebugMode (a dispatch mode), and Dynamo skipped the forward for good: the flag did nothing (seen on
    an H100 as no speed-up and no compile time). Dynamo's 'eager' backend here: tracing without code generation."""
    import subprocess
    import sys

    code = f"""
import functools, runpy, sys, torch, torch._dynamo.utils as utils
torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend="eager")
sys.argv = ["09_gpt_2d.py", "--compile", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16",
            "--batch", "2", "--steps", "2", "--eval-batches", "0", "--sample", "0"]
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
print("FRAMES_OK", utils.counters["frames"]["ok"])
"""
    env = {**__import__("os").environ, "GPUCOURSE_RUNS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    frames = int(out.stdout.split("FRAMES_OK")[-1])
    assert frames >= 1, f"--compile traced no frame: the model ran eager\n{out.stdout[-2000:]}"
