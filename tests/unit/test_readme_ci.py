"""README command 2 is what CI runs: .ci/run takes the marked block from README.md and runs it
as written (after its own steps), and the block works for a fresh machine's root user."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START, END = "# >>> readme-command-2", "# <<< readme-command-2"


def _block() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert START in lines and END in lines, "README.md lost command 2's markers"
    return lines[lines.index(START) + 1 : lines.index(END)]


def test_ci_extracts_exactly_the_readme_block_and_runs_it():
    ci = (ROOT / ".ci" / "run").read_text()
    extract = re.search(r'readme_command_2="\$\((.*)\)"', ci)
    assert extract, ".ci/run no longer takes README command 2 from README.md"
    got = subprocess.run(
        ["bash", "-c", extract.group(1)], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    assert got.splitlines() == _block()
    assert 'bash -e -c "$readme_command_2"' in ci  # run as written, its exit status CI's


def test_the_block_needs_no_sudo_and_installs_what_the_suite_needs():
    block = "\n".join(_block())
    assert "sudo" not in block  # a fresh machine's root has none
    assert re.search(r"(^|&& )apt-get update && apt-get install", block, re.M)  # fresh lists
    words = set(shlex.split(block.replace("&&", " ")))
    for pkg in ("podman", "runc", "mmdebstrap", "uidmap", "openssh-server", "slurmd", "munge"):
        assert pkg in words, pkg  # the container, two-host and Slurm tiers
    for pkg in ("cupy-cuda13x", "nvidia-cuda-nvrtc", "torch==2.13.0"):
        assert pkg in words, pkg  # the ipc kernels' tests, the torch tests
    assert "'.[dev,plot,env,integrations]'" in block  # Lightning and accelerate's tests
    assert "python -m cudampi.pmi.mpich install" in block  # torchrun's MPI, as command 1
    assert ".venv-mpich/bin/pip install mpich mpi4py numpy" in block  # the Hydra tests' MPI
    # side by side (tests/conftest.py), then the timing that needs a quiet machine
    assert block.rstrip().endswith(
        'python -m pytest -q -n 3 -m "not alone" && python -m pytest -q -m alone'
    )


def test_command_1_installs_torchruns_mpi_too():
    readme = (ROOT / "README.md").read_text()
    first = next(ln for ln in readme.splitlines() if ln.startswith("python3 -m venv .venv && "))
    assert "pip install -e . && python -m cudampi.pmi.mpich install && cudampi doctor" in first
