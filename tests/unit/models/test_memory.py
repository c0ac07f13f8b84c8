"""Chapter 07's memory calculator: per-device model-state bytes against the ZeRO paper and hand-computed
formulas, per optimizer and precision; offload; the widget built headless and redrawn on a control change.

Expected values are written out as arithmetic, never computed with the function under test.
"""
import pytest

from gpucourse import costs
from gpucourse.models.memory import PARTS, gb, largest_model, model_state_bytes, model_states, stages_table
from gpucourse.viz.widgets import memory_calculator

from tests.conftest import ROOT

PSI, N = 7.5e9, 64  # the ZeRO paper's example: 7.5B parameters on 64 GPUs, mixed-precision Adam (K = 12)


@pytest.mark.parametrize("stage, paper_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_table(stage, paper_gb):
    assert abs(model_states(PSI, N, stage)["total"] / 1e9 - paper_gb) <= 0.05


def test_parts_by_hand_for_mixed_precision_adam():
    # 2 B params, 2 B grads, 12 B optimizer (fp32 master 4 + m 4 + v 4); stage s shards the first s of (O, G, P)
    s1 = model_states(PSI, N, 1)
    assert (s1["parameters"], s1["gradients"], s1["optimizer states"]) == pytest.approx(
        (2 * 7.5e9, 2 * 7.5e9, 12 * 7.5e9 / 64))
    s2 = model_states(PSI, N, 2)
    assert (s2["parameters"], s2["gradients"], s2["optimizer states"]) == pytest.approx(
        (15e9, 2 * 7.5e9 / 64, 12 * 7.5e9 / 64))
    s3 = model_states(PSI, N, 3)
    assert (s3["parameters"], s3["gradients"], s3["optimizer states"]) == pytest.approx(
        (15e9 / 64, 15e9 / 64, 90e9 / 64))
    for stage in range(4):
        row = model_states(PSI, N, stage)
        assert sum(row[p] for p in PARTS) == pytest.approx(row["total"])
        assert row["total"] == pytest.approx(costs.zero_memory_bytes(PSI, N, stage))


@pytest.mark.parametrize("optimizer, precision, per_param", [
    ("adam", "fp32", (4, 4, 8)),            # fp32 params are the master copy: m and v only
    ("sgd_momentum", "fp32", (4, 4, 4)),    # one momentum buffer
    ("sgd", "fp32", (4, 4, 0)),
    ("sgd_momentum", "mixed", (2, 2, 8)),   # fp32 master 4 + momentum 4
    ("adamw", "mixed", (2, 2, 12)),
])
def test_bytes_per_param_by_optimizer_and_precision(optimizer, precision, per_param):
    p, g, o = per_param
    psi, n = 1e6, 4
    assert costs.state_bytes_per_param(optimizer, precision) == {"param_bytes": p, "grad_bytes": g,
                                                                 "optimizer_bytes": o}
    assert model_states(psi, n, 0, optimizer=optimizer, precision=precision)["total"] == pytest.approx(
        (p + g + o) * 1e6)
    assert model_states(psi, n, 1, optimizer=optimizer, precision=precision)["total"] == pytest.approx(
        (p + g) * 1e6 + o * 1e6 / 4)
    assert model_states(psi, n, 3, optimizer=optimizer, precision=precision)["total"] == pytest.approx(
        (p + g + o) * 1e6 / 4)



# --- model states counted from the tensors (chapter 07's mixed-precision run checks its recipes with this) --------

def _stepped(model, opt, master=()):
    import torch

    model(torch.randn(2, 4, dtype=next(model.parameters()).dtype)).float().sum().backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    return model, opt


def test_model_state_bytes_of_fp32_adamw_by_hand():
    import torch

    model = torch.nn.Linear(4, 3)  # 12 + 3 = 15 parameters in 2 tensors
    model, opt = _stepped(model, torch.optim.AdamW(model.parameters()))
    assert model_state_bytes(model.parameters(), opt) == {
        "parameters": 15 * 4, "gradients": 15 * 4, "master weights": 0, "optimizer states": 2 * 15 * 4,
        "step counters": 2 * 4}


def test_model_state_bytes_of_bf16_params_with_an_fp32_master_by_hand():
    import torch

    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    master = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    model, opt = _stepped(model, torch.optim.AdamW(master), master)
    counted = model_state_bytes(model.parameters(), opt, master)
    # the master's fp32 gradients are still held here: they count as gradients, 2 + 4 bytes each
    assert counted == {"parameters": 15 * 2, "gradients": 15 * (2 + 4), "master weights": 15 * 4,
                       "optimizer states": 2 * 15 * 4, "step counters": 2 * 4}
    for m in master:
        m.grad = None
    assert model_state_bytes(model.parameters(), opt, master)["gradients"] == 15 * 2


def test_model_state_bytes_counts_a_storage_once_and_sgd_states_by_shape():
    import torch

    layer = torch.nn.Linear(4, 4, bias=False)
    twice = [layer.weight, layer.weight]  # a tied weight listed twice holds its memory once
    opt = torch.optim.SGD(twice[:1], lr=0.1, momentum=0.9)
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert model_state_bytes(twice, opt) == {"parameters": 16 * 4, "gradients": 16 * 4, "master weights": 0,
                                             "optimizer states": 16 * 4, "step counters": 0}


@pytest.mark.parametrize("call, match", [
    (lambda: model_state_bytes([1.0], __import__("torch").optim.SGD([__import__("torch").zeros(1)], lr=1)), "params"),
    (lambda: model_state_bytes([], object()), "optimizer"),
])
def test_model_state_bytes_rejects_what_it_cannot_count(call, match):
    with pytest.raises(ValueError, match=match):
        call()

def test_offload_moves_optimizer_then_gradients_to_cpu():
    psi, n = 1e9, 8
    s1 = model_states(psi, n, 1, offload=True)
    assert s1["optimizer states"] == 0 and s1["cpu"] == pytest.approx(12e9 / 8)
    assert s1["total"] == pytest.approx(4e9)  # fp16 params + grads stay on the GPU
    s2 = model_states(psi, n, 2, offload=True)
    assert s2["gradients"] == 0 and s2["cpu"] == pytest.approx(14e9 / 8) and s2["total"] == pytest.approx(2e9)
    s3 = model_states(psi, n, 3, offload=True)
    assert s3["total"] == pytest.approx(2e9 / 8) and s3["cpu"] == pytest.approx(14e9 / 8)
    # the bytes are moved, not lost: device + CPU = the stage's memory without offload
    for stage in (1, 2, 3):
        on, off = model_states(psi, n, stage, offload=True), model_states(psi, n, stage)
        assert on["total"] + on["cpu"] == pytest.approx(off["total"])


def test_communication_stage3_is_one_and_a_half_times_data_parallel():
    vols = [model_states(1e9, 8, s)["comm"] for s in range(4)]
    assert vols[0] == vols[1] == vols[2] == pytest.approx(2 * 1e9 * 2)   # 2Ψ elements of 2 bytes
    assert vols[3] == pytest.approx(1.5 * vols[0])
    assert model_states(1e9, 8, 0, precision="fp32")["comm"] == pytest.approx(2 * 1e9 * 4)


def test_largest_model_inverts_the_formula():
    # stage 3, 64 GPUs, 16 B/param / 64 = 0.25 B/param per GPU: 80 GB holds 320e9 parameters
    assert largest_model(80e9, 64, 3) == pytest.approx(320e9)
    # stage 0: 16 B/param on every GPU whatever N: 5e9
    assert largest_model(80e9, 1024, 0) == pytest.approx(5e9)


def test_stages_table_ignores_offload_at_stage_0():
    rows = stages_table(1e9, 8, offload=True)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["cpu"] == 0 and rows[0]["total"] == pytest.approx(16e9)
    assert rows[1]["cpu"] > 0


def test_gb_formatting():
    assert gb(31.40625e9) == "31.4 GB"
    assert gb(1.875e9) == "1.88 GB"
    assert gb(512e6) == "512 MB"
    assert gb(12) == "12 B"


@pytest.mark.parametrize("call, match", [
    (lambda: model_states(-1, 8, 1), "num_params"),
    (lambda: model_states(1e9, 0, 1), "world_size"),
    (lambda: model_states(1e9, 8, 4), "stage"),
    (lambda: model_states(1e9, 8, 1, optimizer="lion"), "optimizer"),
    (lambda: model_states(1e9, 8, 1, precision="fp8"), "precision"),
    (lambda: model_states(1e9, 8, 0, offload=True), "offload"),
    (lambda: largest_model(0, 8, 1), "device_bytes"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_widget_builds_and_redraws():
    calc = memory_calculator()
    assert "application/vnd.jupyter.widget-view+json" in calc._repr_mimebundle_()
    assert "ZeRO-3" in calc.summary.value and "1.88 GB" in calc.summary.value  # 7.5e9 on 64, stage 3
    assert len(calc.out.outputs) == 1  # one figure
    assert calc.params.step is None  # the browser keeps 7.5e9 (with a step it snapped to 7.94e9)
    calc.stage.value = 1
    assert "ZeRO-1" in calc.summary.value and "31.4 GB" in calc.summary.value
    calc.device_gb.value = 16
    assert "does <b>not</b> fit" in calc.summary.value
    calc.offload.value = True
    assert "in CPU memory" in calc.summary.value
    calc.stage.value = 0
    assert "ignored" in calc.summary.value


@pytest.mark.parametrize("settings", [
    {},                                          # chapter 07's call: the 129-character title ran off both sides
    {"world_size": 1},                           # every bar 120 GB long: the lower-right legend sat on them
    {"offload": True, "stage": 1},               # five legend entries
    {"optimizer": "sgd", "precision": "fp32"},
])
def test_plot_keeps_title_and_legend_inside_and_off_the_bars(settings):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    fig = memory_calculator(**{"num_params": 7.5e9, "world_size": 64, **settings}).figure
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox.padded(0.5)  # half a pixel of rounding
    [ax] = fig.axes
    [legend] = fig.legends + ([ax.get_legend()] if ax.get_legend() else [])  # one, wherever it is attached
    [title] = [t for t in fig.findobj(Text) if t.get_text() and "Model states per device" in t.get_text()]
    labels = ax.texts  # "120 GB" at the end of each bar
    for artist in [title, legend, *labels]:
        box = artist.get_window_extent(renderer)
        assert inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1), (artist, box, fig.bbox)
    legend_box = legend.get_window_extent(renderer)
    bars = [p for p in ax.patches if p.get_width() > 0]
    for artist in [*bars, *labels, title]:
        assert not legend_box.overlaps(artist.get_window_extent(renderer)), artist


def test_dropdowns_are_wide_enough_for_their_longest_option():
    """Rule: a dropdown's layout width >= its description width + 40 px (select border, padding and arrow: a
    300 px one left 112 px for text) + 7 px per character of its longest option (JupyterLab's 13 px font:
    138 px measured for the 23 characters of 'bf16/fp16 + fp32 master', 6 px a character)."""
    calc = memory_calculator()
    for dropdown in (calc.optimizer, calc.precision):
        longest = max(len(label) for label, _ in dropdown.options)
        description = int(dropdown.style.description_width.removesuffix("px"))
        assert description == 150  # kept: the controls' labels line up
        assert (dropdown.layout.width or "").endswith("px"), dropdown.layout.width  # None: 300 px from CSS
        width = int(dropdown.layout.width.removesuffix("px"))
        assert width >= description + 40 + 7 * longest, (dropdown.description, width, longest)


# --- activations saved for backward, counted with saved-tensor hooks ---------------------------------------------

def _mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))


def test_saved_bytes_of_a_small_mlp_by_hand():
    import torch

    from gpucourse.models.memory import SavedTensorBytes

    model, x = _mlp(), torch.randn(4, 3)
    with SavedTensorBytes(exclude=model.parameters(), layers=model) as saved:
        model(x).sum().backward()
    # Linear 1 keeps its input for its weight's gradient: 4 x 3 floats; ReLU keeps its output (4 x 5), which is
    # also Linear 2's input: one storage, counted once, in the layer that saved it first. The weights (saved by
    # both Linears for their input's gradient) are parameters: not activations.
    assert saved.per_layer == [4 * 3 * 4, 4 * 5 * 4, 0]
    assert saved.total == 4 * 3 * 4 + 4 * 5 * 4 and saved.outside == 0


def test_saved_bytes_under_full_and_selective_checkpointing_by_hand():
    import functools

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from gpucourse.models.memory import SavedTensorBytes

    model, x = _mlp(), torch.randn(4, 3)
    with SavedTensorBytes(exclude=model.parameters()) as saved:
        out = checkpoint(model, x, use_reentrant=False)
    out.sum().backward()
    assert saved.total == 4 * 3 * 4  # full recomputation keeps only the checkpointed region's input

    def save_matmuls(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE

    with SavedTensorBytes(exclude=model.parameters()) as saved:
        context = functools.partial(create_selective_checkpoint_contexts, saved.recording(save_matmuls))
        out = checkpoint(model, x, use_reentrant=False, context_fn=context)
    out.sum().backward()
    # the input, and the outputs of the two addmm (4 x 5 and 4 x 2) that the policy keeps; ReLU is recomputed
    assert saved.total == 4 * 3 * 4 + 4 * 5 * 4 + 4 * 2 * 4

    class Torch211Context:  # torch 2.11's policy context: no op_output (the policy runs before the op)
        def __init__(self, ctx):
            self.is_recompute = ctx.is_recompute

    def as_in_torch_211(policy):
        return lambda ctx, op, *args, **kwargs: policy(Torch211Context(ctx), op, *args, **kwargs)

    with SavedTensorBytes(exclude=model.parameters()) as old:
        context = functools.partial(create_selective_checkpoint_contexts, as_in_torch_211(old.recording(save_matmuls)))
        checkpoint(model, x, use_reentrant=False, context_fn=context).sum().backward()
    assert old.total == saved.total


def test_transformer_layer_counts_match_korthikanti_terms():
    """A nanoGPT layer (chapter 09's) in float32 with attention on the math path (the scores materialised, as in
    Korthikanti et al.'s setting), no dropout: 4 (16 s b h + a s^2 b) bytes per layer, plus layer norm's per-token
    mean and 1/std (2 norms x 2 x s b floats), which the paper leaves out."""
    import importlib.util

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpucourse.models.memory import SavedTensorBytes, transformer_layer_activation_bytes

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("gpt_2d", ROOT / "scripts" / "09_gpt_2d.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    s, b, h, a, layers = 24, 3, 32, 4, 2
    torch.manual_seed(0)
    model = gpt.GPT(11, s, h, a, layers)
    with sdpa_kernel(SDPBackend.MATH):
        with SavedTensorBytes(exclude=model.parameters(), layers=model.blocks) as saved:
            logits, _ = model(torch.randint(11, (b, s)))
        logits.sum().backward()
    by_hand = 4 * (16 * s * b * h + a * s * s * b) + 4 * (2 * 2 * s * b)
    assert saved.per_layer == [by_hand] * layers
    assert transformer_layer_activation_bytes(s, b, h, a, bytes_per_element=4, dropout=False) == by_hand - 16 * s * b


def test_korthikanti_formula_as_published():
    from gpucourse.models.memory import transformer_layer_activation_bytes

    # sbh(34 + 5as/h), s = 2048, b = 1, h = 12288, a = 96 (GPT-3 175B's layer)
    assert transformer_layer_activation_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 34 + 5 * 96 * 2048 * 2048
    assert transformer_layer_activation_bytes(4, 2, 8, 2, dropout=False) == 2 * (16 * 4 * 2 * 8 + 2 * 16 * 2)
    with pytest.raises(ValueError, match="16-bit"):
        transformer_layer_activation_bytes(4, 2, 8, 2, bytes_per_element=4)


# --- chapter 07b: recomputation measured (gpucourse.models.recompute) -------------------------------------------
def test_recomputation_counts_bytes_and_flops_equal_to_the_formulas_on_a_tiny_gpt():
    import torch

    from gpucourse.models import recompute
    from gpucourse.tools.exercises import load_file

    gpt = load_file(ROOT / "scripts" / "09_gpt_2d.py", "gpt_2d")
    seqs, b, h, a, layers, vocab = [8, 16], 2, 16, 2, 2, 11

    def build(seq):
        torch.manual_seed(0)
        return gpt.GPT(vocab, seq, h, a, layers)

    with recompute.one_thread():
        kept, fused = recompute.saved_bytes(build, seqs, batch=b, vocab=vocab)
        flops = recompute.executed_flops(build, seqs, batch=b, vocab=vocab)
        times = recompute.step_times(build, seqs[:1], batch=b, vocab=vocab, repeats=2)
    for s in seqs:
        assert {m: kept[s, m] for m in recompute.MODES} == recompute.expected_saved_bytes(s, b, h, a)
        assert fused[s] < kept[s, "none"]  # no s x s scores kept
    probe = build(seqs[0])
    sizes = dict(batch=b, layers=layers, width=h, matmul_params=gpt.matmul_params(probe),
                 block_matmul_params=sum(gpt.matmul_params(block) for block in probe.blocks))
    assert flops == {(s, m): recompute.expected_flops(s, m, **sizes) for s, m in flops}
    assert flops[8, "none"] < flops[8, "selective"] < flops[8, "full"]
    assert set(times) == {(8, m) for m in (*recompute.MODES, recompute.SAVE_ALL)}
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    with pytest.raises(ValueError, match="mode must be one of"):
        recompute.apply(build(8), "half")
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        recompute.step_times(build, [8], batch=b, vocab=vocab, repeats=0)
