"""bench fsdp's pure parts: its flags, the paths in run order, the FSDP2/DDP and vs-gloo ratios,
the update check against the reference, and the report's ratio lines and verdict words."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from cudampi.bench import cli, options
from cudampi.bench.fsdp import FSDPMethod, ratio_lines, ratios, same_update, worst_update
from cudampi.bench.train import TrainRow, pick_models, render_text
from cudampi.errors import ConfigError


def parse(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return options.from_args(p.parse_args(list(argv)))


def test_fsdp_runs_each_path_beside_its_ddp_peer_and_takes_the_training_flags():
    o = parse("fsdp", "--rounds", "3", "--batch", "4", "--ddp-option", "static_graph=true")
    assert o.mode == "fsdp" and o.sizes == () and (o.warmup, o.iters) == (3, 10)
    assert o.paths == (
        "local",
        "torch-nccl",
        "ddp-torch-nccl",
        "torch-gloo",
        "ddp-torch-gloo",
        "torch-cudampi",
        "ddp-torch-cudampi",
        "torch-cudampi-async",
        "ddp-torch-cudampi-async",
    )
    assert (o.rounds, o.batch, o.ddp_options) == (3, 4, (("static_graph", True),))
    assert parse("fsdp", "--paths", "torch-cudampi,local").paths == ("torch-cudampi", "local")
    for bad in ("ddp-nocomm", "ipc", "fsdp-torch-gloo"):
        with pytest.raises(ConfigError, match=f"'{bad}' is not a fsdp path"):
            parse("fsdp", "--paths", bad)
    with pytest.raises(ConfigError, match="runs on its own"):
        parse("fsdp", "allreduce")


def test_auto_is_the_transformer_for_fsdp_on_either_device():
    assert pick_models("auto", "cuda", True, "fsdp") == ("transformer",)
    assert pick_models("auto", "cpu", True, "fsdp") == ("transformer",)
    assert pick_models("auto", "cuda", True, "ddp") == ("resnet50", "transformer")
    assert pick_models("all", "cpu", False, "fsdp") == ("resnet50", "transformer")


def test_ratios_pair_each_fsdp_path_with_its_ddp_peer_and_with_gloo():
    rate = {
        "local": 100.0,
        "torch-gloo": 40.0,
        "ddp-torch-gloo": 50.0,
        "torch-cudampi": 90.0,
        "ddp-torch-cudampi": 95.0,
        "torch-cudampi-async": 60.0,
    }
    found = ratios(rate)
    assert found["fsdp_vs_ddp"] == pytest.approx({"torch-gloo": 0.8, "torch-cudampi": 90 / 95})
    assert found["fsdp_vs_gloo"] == pytest.approx(
        {"torch-cudampi": 2.25, "torch-cudampi-async": 1.5}
    )
    assert ratio_lines(found) == [
        "FSDP2 / DDP on the same backend: torch-gloo 0.80x, torch-cudampi 0.95x",
        "FSDP2 / torch-gloo's FSDP2: torch-cudampi 2.25x, torch-cudampi-async 1.50x",
    ]
    # a ratio needs both of its rows: no gloo, no vs-gloo line; no peer, no FSDP/DDP line
    assert ratios({"torch-cudampi": 90.0, "ddp-torch-gloo": 50.0}) == {}
    assert ratio_lines({}) == []


def test_an_update_agrees_within_rtol_of_the_references_size():
    ref = np.array([[0.5, 2.0], [-1e-3, 4e-3]])  # per parameter: (sum, sum of |.|) of the update
    assert same_update(ref, ref).tolist() == [True, True]
    rounding = ref + np.array([[1e-7, -1e-7], [0.0, 2e-10]])  # reduction order, 4 ranks
    assert same_update(rounding, ref).tolist() == [True, True]
    unaveraged = ref * np.array([[2.0, 2.0], [1.0, 1.0]])  # a gradient summed, not averaged
    assert same_update(unaveraged, ref).tolist() == [False, True]
    cancelled = np.array([[0.5, 2.0], [-1e-3, 8e-3]])  # same sum, twice the movement
    assert same_update(cancelled, ref).tolist() == [True, False]


def test_an_update_may_stray_as_far_as_ten_times_the_references_own_spread():
    """On CUDA two runs of the reference differ (backward kernels that add in no fixed order):
    a path's update may differ by ten times that, beyond RTOL, and no more."""
    ref = np.array([[0.5, 2.0], [-1e-3, 4e-3]])
    spread = np.array([[1e-4, 1e-4], [0.0, 0.0]])  # the first parameter's two reference runs
    noisy = ref + np.array([[5e-4, 5e-4], [0.0, 0.0]])  # 2.5e-4 of its size: over RTOL alone
    assert same_update(noisy, ref).tolist() == [False, True]
    assert same_update(noisy, ref, spread=spread).tolist() == [True, True]
    beyond = ref + np.array([[2e-3, 0.0], [0.0, 0.0]])  # more than 1e-4 x 2 + 10 x 1e-4
    assert same_update(beyond, ref, spread=spread).tolist() == [False, True]
    wrong = ref * np.array([[1.0, 1.0], [2.0, 2.0]])  # the second parameter's update doubled
    i, off, allowed = worst_update(wrong, ref, spread)
    assert i == 1 and off == pytest.approx(1.0) and allowed == pytest.approx(1e-4, rel=1e-3)


def test_the_report_says_fsdp_the_ratios_and_what_a_wrong_parameter_means():
    meta = {"ranks": 2, "device": "cuda", "gpu_name": "NVIDIA H100", "mps": True}
    found = ratios({"torch-gloo": 40.0, "torch-cudampi": 90.0, "ddp-torch-cudampi": 95.0})
    info = {
        "models": {
            "transformer": {
                "describe": "4 x nn.TransformerEncoderLayer",
                "batch": 16,
                "unit": "sequences/s",
                "notes": ratio_lines(found),
            }
        }
    }
    rows = [
        TrainRow("torch-gloo", "transformer", 16, 10, 40.0, 39.0, 41.0, 40.0, 20.0, None, 0),
        TrainRow("torch-cudampi", "transformer", 16, 10, 18.0, 17.0, 19.0, 90.0, 45.0, None, 1),
    ]
    text = render_text(meta, info, rows, [], FSDPMethod.mode, FSDPMethod.diverged)
    lines = text.splitlines()
    assert lines[0] == "# cudampi bench fsdp: ranks 2; device cuda [NVIDIA H100]; MPS on"
    at = lines.index("# FSDP2 / DDP on the same backend: torch-cudampi 0.95x")
    assert lines[at - 1].split()[0] == "torch-cudampi"  # under the model's rows
    assert lines[at + 1] == "# FSDP2 / torch-gloo's FSDP2: torch-cudampi 2.25x"
    assert lines[-1] == (
        "# Verdict: FAILED: 2 rows, 0 skipped; parameters moved unlike the reference training "
        "on 1 tensors"
    )


def test_a_long_path_name_widens_the_path_column_for_every_row():
    long = TrainRow("ddp-torch-cudampi-async", "transformer", 8, 5, 50.0, 49, 51, 32, 16, 0.9, 0)
    short = TrainRow("local", "transformer", 8, 5, 45.0, 44, 46, 35, 17.5, None, None)
    info = {"models": {"transformer": {"describe": "2 x layer", "batch": 8}}}
    lines = render_text({"ranks": 2, "device": "cpu"}, info, [short, long], [], "fsdp").splitlines()
    head = next(line for line in lines if line.startswith("# path"))
    end = head.index("step (ms)") + len("step (ms)")  # the step column, right-aligned
    for row in (short, long):
        line = next(line for line in lines if line.split()[0] == row.path)
        assert line.index(f"{row.step_ms:.2f}") + len(f"{row.step_ms:.2f}") == end, line
