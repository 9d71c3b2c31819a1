"""bench ddp's report without running a model: a section per model, MPS as a fact of the run."""

from __future__ import annotations

from cudampi.bench.ddp import DDPRow, render_text
from cudampi.probe.gpu import mps_active


def _row(model, path, rate, vs):
    return DDPRow(
        path, model, 64, 10, 35.0, 34.0, 36.0, rate, rate / 2, vs, None if vs is None else 0
    )


def test_two_models_one_section_each_and_mps_in_the_header():
    meta = {"ranks": 2, "device": "cuda", "gpu_name": "NVIDIA H200", "mps": True}
    info = {
        "model": "resnet50",
        "models": {
            "resnet50": {"describe": "torchvision ResNet-50", "batch": 64, "unit": "images/s"},
            "transformer": {
                "describe": "4 x TransformerEncoderLayer",
                "batch": 16,
                "unit": "sequences/s",
            },
        },
    }
    rows = [
        _row("resnet50", "local", 2355.0, None),
        _row("resnet50", "torch-cudampi", 2240.0, 0.95),
        _row("transformer", "local", 455.0, None),
        _row("transformer", "torch-cudampi", 440.0, 0.97),
    ]
    text = render_text(meta, info, rows, [("transformer", "torch-nccl", "ranks share a GPU")])
    lines = text.splitlines()
    assert lines[0].endswith("[NVIDIA H200]; MPS on")
    res = lines.index("# torchvision ResNet-50; batch 64 per rank")
    tra = lines.index("# 4 x TransformerEncoderLayer; batch 16 per rank")
    assert res < tra and "images/s" in lines[res + 1] and "sequences/s" in lines[tra + 1]
    assert "0.95x" in lines[res + 3] and "0.97x" in lines[tra + 3]
    assert "# torch-nccl (transformer): skipped: ranks share a GPU" in lines
    assert "MPS off" in render_text({**meta, "mps": False}, info, rows, [])
    assert "MPS" not in render_text({**meta, "device": "cpu"}, info, rows, [])


def test_mps_is_its_control_pipe():
    seen = []

    def exists(path):
        seen.append(path)
        return path == "/run/mps/control"

    assert mps_active({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}, exists) is True
    assert mps_active({}, exists) is False
    assert seen[-1] == "/tmp/nvidia-mps/control"
    assert mps_active({"CUDA_MPS_PIPE_DIRECTORY": ""}, lambda p: p == "/tmp/nvidia-mps/control")
