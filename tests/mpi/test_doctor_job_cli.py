"""``cudampi doctor --hosts`` on this machine alone: a name that does not resolve is named with
the launcher's words, the flags' own mistakes are usage errors, and one node from a hostfile is
the job doctor of one node (tests/netns has the multi-node runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cudampi_cli

pytestmark = pytest.mark.mpi


def test_a_host_that_does_not_resolve_is_named_with_the_launchers_words(tmp_path: Path):
    p = cudampi_cli(
        "doctor", "--hosts", "localhost,no-such-node.invalid", "--no-runtime", "--json",
        "--cache-dir", str(tmp_path / "cache"), timeout=240,
    )  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    report = json.loads(p.stdout)
    (bad,) = report["findings"]
    assert bad["subject"] == "no-such-node.invalid" and bad["severity"] == "fail"
    assert "did not answer: ssh failed: Could not resolve hostname" in bad["what"], bad
    assert "cannot be reached: its name does not resolve" in bad["what"], bad
    assert list(report["facts"]) == ["localhost"]
    assert report["jobs"] == 2  # the job of both, then localhost's again without the bad name


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
