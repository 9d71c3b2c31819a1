"""``cudampi doctor --hosts`` refuses what it cannot run, with launch's own words, before it
starts anything; and run on one node it is the job doctor of one node (tests/netns has the
multi-node runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cudampi_cli

pytestmark = pytest.mark.mpi


def test_a_host_that_does_not_resolve_is_a_usage_error():
    p = cudampi_cli("doctor", "--hosts", "localhost,no-such-node.invalid", timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "the doctor cannot launch on these hosts" in p.stderr
    assert "'no-such-node.invalid' cannot be reached: its name does not resolve" in p.stderr
    assert p.stdout == ""


def test_hosts_and_a_hostfile_are_one_or_the_other(tmp_path: Path):
    hf = tmp_path / "hosts"
    hf.write_text("localhost\n")
    p = cudampi_cli("doctor", "--hosts", "localhost", "--hostfile", str(hf), timeout=60)
    assert p.returncode == 2 and "not allowed with argument" in p.stderr, p.stderr


def test_one_node_from_a_hostfile(tmp_path: Path):
    hf = tmp_path / "hosts"
    hf.write_text("# one node\nlocalhost slots=4\n")
    p = cudampi_cli(
        "doctor", "--hostfile", str(hf), "--no-runtime", "--json",
        "--cache-dir", str(tmp_path / "cache"), timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["nodes"] == ["localhost"] and report["links"] == [] and report["rounds"] == []
    assert report["facts"]["localhost"]["rows"]["MPI library"].startswith("Open MPI")
    assert report["findings"] == [] and report["jobs"] == 1
