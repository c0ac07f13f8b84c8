"""What chapter 07b (precision and recomputation) shows, `gpucourse/chapters/ch07b.py`, built from hand-made records."""
import math

import pytest

from gpucourse.chapters import ch07b
from gpucourse.models import costs


# --- chapter 07b: precision and recomputation ---------------------------------------------------------
def _recipe_record(name, numel=100, **over):
    per = costs.recipe_bytes_per_param(name, "adamw")
    rec = {"num_params": numel, "num_tensors": 4, "dtype": "torch.float32", "state_dtype": "torch.float32",
           "parameters": per["parameters"] * numel, "gradients": per["gradients"] * numel,
           "master_weights": per["master weights"] * numel, "optimizer_states": per["optimizer states"] * numel,
           "step_counters": 16, "weight_copies": 150, "cuda_peak": None, "cuda_held": None}
    return rec | over


def test_recipe_tables_flag_a_part_off_its_formula_and_mark_fp8_modelled():
    assert ch07b.recipe_bytes().loc["fp8", "source"] == "MODELLED"
    assert ch07b.recipe_bytes().loc["mixed", "total (bytes/param)"] == 16
    df = ch07b.recipe_states({"fp32": _recipe_record("fp32"), "bf16": _recipe_record("bf16", gradients=400),
                               "mixed": _recipe_record("mixed", step_counters=12)})
    assert df["= formula"].tolist() == [True, False, True]
    assert df["= 4 B per tensor"].tolist() == [True, True, False]
    assert df.loc["bf16", "gradients (bytes/param)"] == 4 and df.loc["fp32", "16-bit weight copies kept (bytes/param)"] == 1.5
    assert "CUDA peak (bytes/param)" not in df  # no GPU: no column pretending to a measurement
    gpu = ch07b.recipe_states({"fp32": _recipe_record("fp32", cuda_peak=2000, cuda_held=1600)})
    assert gpu.loc["fp32", "CUDA peak (bytes/param)"] == 20


def test_loss_scale_steps_and_faults():
    good = [{"scaler_step": 0, "scale": 2.0**28, "overflow": True, "params_changed": False, "new_scale": 2.0**27, "loss": 1},
            {"scaler_step": 1, "scale": 2.0**27, "overflow": False, "params_changed": True, "new_scale": 2.0**27, "loss": .5}]
    assert ch07b.loss_scale_steps(good).loc[0, "new scale"] == "2^27"
    assert ch07b.loss_scale_faults(good) == []
    stepped_anyway = [good[0] | {"params_changed": True}]
    not_halved = [good[0] | {"new_scale": 2.0**28}]
    assert len(ch07b.loss_scale_faults(stepped_anyway)) == 1 and len(ch07b.loss_scale_faults(not_halved)) == 1


def test_underflow_shares_and_float_formats():
    df = ch07b.underflow([{"residual": 1e-3, "median_abs_grad": 2e-6, "nonzero_fp32": 200, "zero_fp16": 50,
                            "zero_fp16_scaler": 0}])
    assert df.loc["1e-03", "lost, no scaler (%)"] == 25.0 and df.loc["1e-03", "lost in fp16 + GradScaler"] == 0
    import torch

    formats = ch07b.float_formats([torch.float16, torch.bfloat16])
    assert formats.loc["float16", "max"] == 65504 and formats.loc["bfloat16", "relative step (eps)"] == 2**-7


def test_cast_errors_counts_zeros_and_can_leave_an_outlier_out():
    import torch

    ref = torch.tensor([10.0, 1.0, 2.0, 4.0])
    df = ch07b.cast_errors(ref, {"exact": ref.clone(), "lossy": torch.tensor([10.0, 0.0, 2.0, 4.0])})
    assert df.loc["exact", "became zero"] == 0 and df.loc["exact", "relative error"] == 0
    assert df.loc["lossy", "became zero"] == 1 and df.loc["lossy", "of"] == 4
    rest = ch07b.cast_errors(ref, {"outlier zeroed": torch.tensor([0.0, 1.0, 2.0, 4.0])}, skip_first=True)
    assert rest.loc["outlier zeroed", "became zero"] == 0 and rest.loc["outlier zeroed", "of"] == 3


def test_activation_and_recomputation_tables():
    kept = {(8, "none"): 1000, (8, "selective"): 400, (8, "full"): 100}
    df = ch07b.activations_kept(kept, {8: 300}, kept | {(8, "full"): 99})
    assert df.loc[8, "selective (bytes)"] == 400 and not df.loc[8, "= formula"]
    flops = {(8, "none"): 100, (8, "selective"): 110, (8, "full"): 150}
    times = {(8, "none"): [0.010, 0.012, 0.011], (8, "selective"): [0.022] * 3, (8, "full"): [0.014] * 3,
             (8, "control"): [0.033] * 3}
    rec = ch07b.recomputation(kept, flops, flops | {(8, "full"): 1}, times)
    assert rec.index.tolist() == [(8, "none"), (8, "selective"), (8, "full"), (8, "control")]
    assert rec.loc[(8, "selective"), "kept (× none)"] == 0.4 and rec.loc[(8, "full"), "FLOPs run (× none)"] == 1.5
    assert rec.loc[(8, "none"), "FLOPs = formula"] and not rec.loc[(8, "full"), "FLOPs = formula"]
    assert rec.loc[(8, "selective"), "time (× none)"] == 2.0 and rec.loc[(8, "none"), "median step (ms)"] == 11.0
    assert rec.loc[(8, "control"), "time (× none)"] == 3.0 and math.isnan(rec.loc[(8, "control"), "kept (× none)"])


def test_low_precision_speedup_is_amdahl_and_labelled_modelled_in_its_header():
    df = ch07b.low_precision_speedup("NVIDIA H100 80GB HBM3", (0.0, 0.5))
    assert df.loc[0, "at most × faster in fp8"] == 1.0
    assert df.loc[50, "at most × faster in fp8"] == round(1 / (0.5 + 0.5 / 2), 2)


def test_loss_scale_plot_marks_each_skipped_step_at_its_scale():
    steps = [{"scaler_step": 0, "scale": 2.0**28, "overflow": True}, {"scaler_step": 1, "scale": 2.0**27, "overflow": True},
             {"scaler_step": 2, "scale": 2.0**26, "overflow": False}]
    ax = ch07b.loss_scale_plot(steps, "cpu, gloo, 1 rank").axes[0]
    used, skipped = ax.lines
    assert list(used.get_ydata()) == [28, 27, 26] and list(skipped.get_xdata()) == [0, 1]
    assert list(skipped.get_ydata()) == [28, 27] and "cpu, gloo, 1 rank" in ax.get_title()
    assert list(ax.get_yticks()) == [26, 27, 28]
    many = [{"scaler_step": i, "scale": 2.0**20, "overflow": False} for i in range(18)]
    ticks = ch07b.loss_scale_plot(many).axes[0].get_xticks()
    assert len(ticks) > 2 and all(float(x).is_integer() for x in ticks)  # whole steps: no 2.5


def test_recomputation_plot_is_relative_to_the_first_mode():
    seqs, modes = [64, 128], ["none", "full"]
    kept = {(64, "none"): 2**20, (128, "none"): 2**21, (64, "full"): 2**18, (128, "full"): 2**19}
    times = {(128, "none"): [1.0, 1.0, 1.2], (128, "full"): [1.3, 1.4, 1.5]}
    flops = {(128, "none"): 300.0, (128, "full"): 400.0}
    fig = ch07b.recomputation_plot(seqs, modes, kept, times, flops, title="t")
    left, right = fig.axes
    assert list(left.lines[0].get_ydata()) == [1.0, 2.0] and left.get_xscale() == "log"
    assert [t.get_text() for t in left.get_xticklabels()] == ["64", "128"]  # ticks at the lengths run
    full_flops = right.lines[-1]
    assert list(full_flops.get_xdata()) == [0.25] and list(full_flops.get_ydata()) == pytest.approx([4 / 3])
