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
