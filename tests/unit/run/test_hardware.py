import pytest

from gpucourse import hardware


@pytest.mark.parametrize("visible, present, expected", [
    (None, 4, 4), ("0,1", 4, 2), ("", 4, 0), ("-1", 4, 0), ("0,1,2,3,4,5", 2, 2), (None, 0, 0)])
def test_gpu_count_follows_cuda_visible_devices(monkeypatch, tmp_path, visible, present, expected):
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for i in range(present):
        (gpus / f"0000:0{i}:00.0").mkdir()
    monkeypatch.setattr(hardware, "Path", lambda p: gpus if p == "/proc/driver/nvidia/gpus" else __import__("pathlib").Path(p))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert hardware.gpu_count() == expected


@pytest.mark.parametrize("request_, ranks, local_rank, gpus, kwargs, expected", [
    ("auto", 2, 1, 2, {}, ("nccl", "cuda:1")),  # one GPU per rank
    ("auto", 4, 3, 2, {}, ("gloo", "cuda:1")),  # more ranks than GPUs: gloo, GPUs dealt round-robin
    ("auto", 4, 3, 2, {"cuda_with_gloo": False}, ("gloo", "cpu")),  # the script keeps gloo ranks on the CPU
    ("auto", 1, 0, 1, {"cpu_only": True}, ("gloo", "cpu")),  # $GPUCOURSE_DEVICE=cpu
    ("auto", 2, 0, 0, {}, ("gloo", "cpu")),
    ("gloo", 1, 0, 1, {}, ("gloo", "cuda:0")),  # an explicit backend is kept
])
def test_placement_is_one_rule_for_backend_and_device(request_, ranks, local_rank, gpus, kwargs, expected):
    kwargs.setdefault("cpu_only", False)
    assert hardware.placement(request_, ranks, local_rank, gpus=gpus, **kwargs) == expected


def test_report_on_this_machine_agrees_with_torch():
    import torch

    report = hardware.hardware_report()
    assert len(report.gpus) == torch.cuda.device_count()
    assert report.backends["gloo"] is True
    assert report.chosen_backend == ("nccl" if report.gpus else "gloo")
    text = str(report)
    assert "launcher default" in text and f"backend={report.chosen_backend}" in text
    assert "<table>" in report._repr_html_()


@pytest.mark.parametrize("env, name", [({"COLAB_RELEASE_TAG": "x"}, "Google Colab"),
                                       ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "Kaggle"),
                                       ({"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2"}, "Slurm job 42 (2 node(s))")])
def test_platform_detection(monkeypatch, env, name):
    for key in ("COLAB_RELEASE_TAG", "COLAB_GPU", "KAGGLE_KERNEL_RUN_TYPE", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert hardware.platform_name() == name


# --- the 16-bit type a device trains in (runtime.amp_dtype): bf16, or fp16 + a scaler on a T4 ---------------
@pytest.mark.parametrize("bf16_compute, want", [(True, "bfloat16"), (False, "float16")])
def test_a_gpu_without_bf16_compute_trains_in_fp16_with_a_scaler(monkeypatch, bf16_compute, want):
    import torch

    from gpucourse.run import runtime

    asked = []

    def is_bf16_supported(including_emulation=True):  # a T4: emulation only (compute capability 7.5)
        asked.append(including_emulation)
        return bf16_compute or including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    dtype = runtime.amp_dtype(torch.device("cuda"))
    assert dtype == getattr(torch, want) and asked == [False]  # emulated bf16 does not count
    assert runtime.grad_scaler(dtype, "cpu").is_enabled() == (want == "float16")
    assert runtime.amp_dtype("cpu") == torch.bfloat16 and not runtime.grad_scaler(torch.bfloat16, "cpu").is_enabled()


@pytest.mark.parametrize("name, old", [("all_gather_single", "all_gather_into_tensor"),
                                       ("reduce_scatter_single", "reduce_scatter_tensor")])
def test_tensor_collectives_take_torch_211s_names_where_the_new_ones_are_missing(monkeypatch, name, old):
    """torch 2.13 calls them *_single (the old names deprecated); 2.11 has only the old ones. The scripts call
    runtime's, which looks the name up at each call (so a wrapper on torch.distributed's name still counts it)."""
    import torch.distributed as dist

    from gpucourse import runtime

    calls = []
    monkeypatch.setattr(dist, old, lambda out, inp, **kw: calls.append((old, kw)))
    monkeypatch.setattr(dist, name, lambda out, inp, **kw: calls.append((name, kw)), raising=False)
    getattr(runtime, name)(None, None, group="g")
    monkeypatch.delattr(dist, name)
    getattr(runtime, name)(None, None, group="g")
    assert calls == [(name, {"group": "g"}), (old, {"group": "g"})]
