"""bench ddp's report without running a model: a section per model, MPS as a fact of the run,
the rounds and their median."""

from __future__ import annotations

import dataclasses

import pytest

from cudampi.bench.train import TrainRow, aggregate, render_text
from cudampi.probe.gpu import mps_active


def _row(model, path, rate, vs):
    return TrainRow(
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


def test_a_row_is_the_median_round_with_the_extremes_of_every_round():
    # (min, mean, max) over the ranks per round; the first round is the slow outlier
    rounds = [(0.030, 0.031, 0.032), (0.019, 0.020, 0.021), (0.021, 0.022, 0.025)]
    lo, typical, hi = aggregate(rounds)
    assert typical == pytest.approx(0.022)  # not the first round's 0.031, nor the mean 0.0243
    assert (lo, hi) == (0.019, 0.032)
    assert aggregate(rounds[:2])[1] == pytest.approx(0.0255)  # even: between the middle two
    assert aggregate(rounds[:1]) == rounds[0]  # one round: today's figures


def test_the_rounds_are_in_the_header_only_when_there_are_several():
    meta = {"ranks": 2, "device": "cpu", "iters": 10}
    info = {"models": {"transformer": {"describe": "2 x layer", "batch": 8}}, "rounds": 5}
    nocomm = dataclasses.replace(_row("transformer", "ddp-nocomm", 48, 0.96), wrong=None)
    rows = [_row("transformer", "local", 50.0, None), nocomm]
    lines = render_text(meta, info, rows, []).splitlines()
    assert lines[0].endswith("device cpu; 10 steps x 5 rounds, the median round")
    assert lines[-4].split()[-2:] == ["0.96x", "N/A"]
    one = render_text(meta, {**info, "rounds": 1}, rows, []).splitlines()[0]
    assert one == "# cudampi bench ddp: ranks 2; device cpu"
