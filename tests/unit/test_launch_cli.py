"""`cudampi launch`'s command line: the flags mpirun, Hydra and torchrun users type, and what a
command becomes (a script run in-process, or any program executed by the rank bootstrap)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import pytest

from cudampi.errors import ConfigError
from cudampi.launch.cli import EXEC, add_arguments, split_target


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cudampi launch")
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["-np", "4", "t.py"], {"nprocs": 4}),
        (["-n", "4", "t.py"], {"nprocs": 4}),
        (["-H", "a:2,b:2", "t.py"], {"hosts": "a:2,b:2"}),
        (["--host", "a,b", "t.py"], {"hosts": "a,b"}),
        (["-f", "hosts.txt", "-ppn", "4", "t.py"], {"hostfile": "hosts.txt", "gpus_per_node": 4}),
        (["--nproc-per-node", "2", "--nnodes", "1", "t.py"], {"gpus_per_node": 2, "nnodes": 1}),
        (["--nproc_per_node=8", "t.py"], {"gpus_per_node": 8}),
        (["--tag-output", "--json-file", "out.json", "t.py"], {"tag_output": True}),
        (["--np", "4", "t.py"], {"nprocs": 4}),
        (["-N", "2", "t.py"], {"gpus_per_node": 2}),
        (["--map-by", "ppr:2:node", "t.py"], {"gpus_per_node": 2}),
        (["--standalone", "t.py"], {"standalone": True}),
    ],
)
def test_habitual_flags_mean_what_they_mean_elsewhere(argv, want):
    args = parse(*argv)
    for key, value in want.items():
        assert getattr(args, key) == value, key
    assert args.target == ["t.py"]


def test_elastic_nnodes_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit):
        parse("--nnodes", "1:2", "t.py")
    assert "elastic MIN:MAX" in capsys.readouterr().err


def test_what_a_command_becomes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    prog = tmp_path / "a.out"
    prog.write_text("#!/bin/sh\necho hi\n")
    prog.chmod(0o755)
    script = str(tmp_path / "train.py")
    me = str(Path(sys.executable).parent / "python")
    assert split_target(None, ["train.py", "--lr", "1"]) == ((script, "--lr", "1"), ())
    # This python with a script or -m: run in-process, like the script itself.
    assert split_target(None, [me, "train.py", "x"]) == ((script, "x"), ())
    assert split_target(None, [me, "-m", "cudampi.selftest"]) == (("-m", "cudampi.selftest"), ())
    # Python with options of its own, another program, a console script: executed.
    assert split_target(None, [me, "-u", "train.py"]) == ((EXEC, me, "-u", "train.py"), ())
    assert split_target(None, ["./a.out", "1", "--", "--report-bindings"]) == (
        (EXEC, str(prog), "1"),
        ("--report-bindings",),
    )
    cudampi_bin = shutil.which("cudampi")
    if cudampi_bin:
        assert split_target(None, ["cudampi", "bench"]) == ((EXEC, cudampi_bin, "bench"), ())
    with pytest.raises(ConfigError, match="neither a script nor a program"):
        split_target(None, ["nope-not-here"])
    os.chmod(prog, 0o644)  # a file that is not executable is a Python script, as before
    assert split_target(None, ["./a.out"]) == ((str(prog),), ())


def test_only_work_folders_whose_launch_is_gone_are_removed(tmp_path):
    import os

    from cudampi.launch.workdir import PREFIX, remove_stale, start_time

    me = os.getpid()
    owners = {
        "dead": "4194304 1\n",  # above pid_max: no such process
        "reused": f"{me} 1\n",  # this pid, but started at another time
        "alive": f"{me} {start_time(me)}\n",
        "kept": None,  # a dry run's: no owner
    }
    for name, owner in owners.items():
        (tmp_path / f"{PREFIX}{name}").mkdir()
        if owner is not None:
            (tmp_path / f"{PREFIX}{name}" / "owner").write_text(owner)
    removed = sorted(os.path.basename(p) for p in remove_stale(str(tmp_path)))
    assert removed == [f"{PREFIX}dead", f"{PREFIX}reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{PREFIX}alive", f"{PREFIX}kept"]
