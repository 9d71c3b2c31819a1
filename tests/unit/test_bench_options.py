from __future__ import annotations

import argparse

import pytest

from cudampi.bench import cli, options
from cudampi.errors import ConfigError


def parse(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p, p.parse_args(list(argv))


def test_defaults_run_every_collective_on_every_path():
    _, a = parse()
    o = options.from_args(a)
    assert o.mode == "collectives"
    assert o.ops[0] == "allreduce" and "sendrecv" in o.ops
    assert "torch-gloo" in o.paths and "copy" in o.paths
    assert o.sizes[0] == 8 and o.sizes[-1] == 64 << 20
    assert (o.warmup, o.iters, o.check) == (5, 20, True)


def test_nccl_tests_flags():
    _, a = parse(
        "allreduce",
        "-b",
        "8",
        "-e",
        "1G",
        "-f",
        "2",
        "-w",
        "2",
        "-n",
        "7",
        "-d",
        "float,bf16",
        "-o",
        "sum,max",
        "--no-check",
    )
    o = options.from_args(a)
    assert o.ops == ("allreduce",)
    assert o.sizes[-1] == 1 << 30 and len(o.sizes) == 28
    assert o.dtypes == ("float32", "bfloat16")
    assert o.redops == ("sum", "max")
    assert (o.warmup, o.iters, o.check) == (2, 7, False)


def test_step_bytes_alone_add():
    o = options.from_args(parse("allreduce", "-b", "1K", "-e", "4K", "-i", "1K")[1])
    assert o.sizes == (1024, 2048, 3072, 4096)


def test_p2p_and_ddp_modes_have_their_own_defaults():
    o = options.from_args(parse("p2p")[1])
    assert o.mode == "p2p" and o.sizes[0] == 1 and o.sizes[-1] == 4 << 20 and o.iters == 100
    assert o.paths == ("cudampi", "ipc", "mpi", "torch-nccl", "torch-gloo", "torch-cudampi")
    o = options.from_args(parse("ddp", "--paths", "local,torch-gloo")[1])
    assert o.mode == "ddp" and o.paths == ("local", "torch-gloo") and o.sizes == ()
    assert o.rounds == 1


def test_ddp_rounds_and_the_nocomm_path():
    o = options.from_args(parse("ddp", "--rounds", "3", "--paths", "local,ddp-nocomm")[1])
    assert o.rounds == 3 and o.paths == ("local", "ddp-nocomm")
    every = options.from_args(parse("ddp")[1]).paths
    assert "ddp-nocomm" in every and "torch-cudampi-async" in every and "local" in every
    p, a = parse("ddp", "--rounds", "3")
    assert options.from_args(parse(*options.to_argv(a, p))[1]).rounds == 3


def test_ddp_options_are_typed_checked_and_survive_a_relaunch():
    p, a = parse(
        "ddp",
        "--ddp-option",
        "gradient_as_bucket_view=True",
        "--ddp-option",
        " bucket_cap_mb = 12.5",
        "--ddp-option",
        "static_graph=0",
        "--ddp-option",
        "static_graph=yes",  # the last one of a name wins
    )
    o = options.from_args(a)
    assert dict(o.ddp_options) == {
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 12.5,
        "static_graph": True,
    }
    again = options.from_args(parse(*options.to_argv(a, p))[1])
    assert again.ddp_options == o.ddp_options
    assert options.from_args(parse("ddp")[1]).ddp_options == ()  # DDP's own defaults
    for bad, words in (
        ("bucket_cap_mb", "expected NAME=VALUE"),
        ("bucket_view=true", "NAME one of bucket_cap_mb, gradient_as_bucket_view"),
        ("static_graph=maybe", "static_graph takes true or false"),
        ("bucket_cap_mb=lots", "bucket_cap_mb takes a number"),
        ("bucket_cap_mb=0", "must be > 0"),
    ):
        with pytest.raises(ConfigError, match=words):
            options.from_args(parse("ddp", "--ddp-option", bad)[1])
    with pytest.raises(ConfigError, match="`cudampi bench ddp` or `fsdp` only, not collectives"):
        options.from_args(parse("allreduce", "--ddp-option", "static_graph=true")[1])


def test_ddp_models_from_the_flag():
    from cudampi.bench.train import pick_models

    o = options.from_args(parse("ddp", "--model", "transformer, resnet50")[1])
    assert o.model == "transformer,resnet50"
    assert pick_models(o.model, "cuda", True) == ("transformer", "resnet50")
    # auto: both on CUDA (ResNet-50 only with torchvision), the transformer on the CPU
    assert pick_models("auto", "cuda", True) == ("resnet50", "transformer")
    assert pick_models("auto", "cuda", False) == ("transformer",)
    assert pick_models("auto", "cpu", True) == ("transformer",)
    assert pick_models("all", "cpu", False) == ("resnet50", "transformer")
    assert pick_models("transformer,all", "cuda", True) == ("transformer", "resnet50")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (("allreduc",), "unknown benchmark 'allreduc'"),
        (("p2p", "allreduce"), "runs on its own"),
        (("--paths", "gpu_ring"), "'gpu_ring' is not a collectives path"),
        (("-o", "mean"), "--op 'mean'"),
        (("-e", "8", "-b", "64"), "below -b"),
        (("-n", "0"), "-n 0"),
        (("--json", "--csv"), "both go to stdout"),
        (("ddp", "--paths", "mpi"), "not a ddp path"),
        (("ddp", "--model", "resnet50,vit"), "--model 'vit'"),
        (("ddp", "--model", ","), "names no model"),
        (("ddp", "--rounds", "0"), "--rounds 0 must be >= 1"),
    ],
)
def test_bad_flags_are_usage_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        options.from_args(parse(*argv)[1])


def test_relaunch_argv_rebuilds_the_flags_without_np():
    p, a = parse(
        "allreduce",
        "-b",
        "8",
        "-e",
        "64K",
        "--paths",
        "host,mpi",
        "--no-check",
        "--np",
        "2",
        "--json",
        "out.json",
    )
    argv = options.to_argv(a, p)
    assert argv[0] == "allreduce" and "--np" not in argv
    again = options.from_args(parse(*argv)[1])
    first = options.from_args(a)
    assert again.sizes == first.sizes and again.paths == first.paths and again.check is False
    assert again.json == "out.json"


def test_relaunch_goes_through_a_launcher(tmp_path):
    argv = cli.relaunch_argv(3, ["allreduce"], executable="/x/bin/python")
    assert "-n" in argv and "3" in argv
    assert argv[-3:] == ["cudampi", "bench", "allreduce"] or argv[-2:] == ["bench", "allreduce"]


def test_launched_size_reads_the_launcher_environment():
    assert cli.launched_size({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}) == 4
    assert cli.launched_size({}) is None


def test_a_plain_start_runs_on_one_rank_per_gpu_or_on_two():
    assert cli.plain_ranks("auto", 0, None) == (2, "the fewest between which data moves")
    assert cli.plain_ranks("auto", 1, None)[0] == 2  # two ranks share the GPU
    assert "share the GPU" in cli.plain_ranks("auto", 1, None)[1]
    assert cli.plain_ranks("auto", 8, None) == (8, "one per GPU (8 here)")
    assert cli.plain_ranks("cuda", 8, "2,3,5")[0] == 3  # CUDA_VISIBLE_DEVICES narrows them
    assert cli.plain_ranks("cuda", 8, "")[0] == 2  # it hides every GPU
    assert cli.plain_ranks("cpu", 8, None)[0] == 2  # host buffers: GPUs do not count


def test_in_place_is_for_the_collectives_and_survives_a_relaunch():
    p, a = parse("allreduce", "--in-place")
    assert options.from_args(a).in_place
    assert options.from_args(parse(*options.to_argv(a, p))[1]).in_place  # (the --np relaunch)
    assert not options.from_args(parse("allreduce")[1]).in_place
    for mode in ("p2p", "ddp"):
        with pytest.raises(ConfigError, match=f"--in-place is for the collectives.*not {mode}"):
            options.from_args(parse(mode, "--in-place")[1])
