"""`cudampi env` through the real console entry point."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cudampi_cli


def test_write_then_check_then_drift(tmp_path):
    out = tmp_path / "gen"
    w = cudampi_cli(
        "env",
        "write",
        "--out",
        str(out),
        "--mpi",
        "mpich",
        "--nodes",
        "1",
        "--only",
        "spec,conda,k8s",
        "--json",
    )
    assert w.returncode == 0, w.stderr
    report = json.loads(w.stdout)
    assert {f["name"] for f in report["files"]} == {"env.toml", "environment.yml", "mpijob.yaml"}
    assert report["spec"]["mpi"] == "mpich" and report["lock"] == "not needed"
    assert report["validated"] == ["mpijob.yaml", "environment.yml"]  # parsed + schema-checked
    same = cudampi_cli(
        "env",
        "write",
        "--spec",
        str(out / "env.toml"),
        "--out",
        str(out),
        "--only",
        "spec,conda,k8s",
        "--check",
    )
    assert same.returncode == 0, same.stdout + same.stderr
    (out / "mpijob.yaml").write_text("edited\n")
    drift = cudampi_cli(
        "env",
        "write",
        "--spec",
        str(out / "env.toml"),
        "--out",
        str(out),
        "--only",
        "spec,conda,k8s",
        "--check",
    )
    assert drift.returncode == 1 and "mpijob.yaml: differs" in drift.stdout
    assert (out / "mpijob.yaml").read_text() == "edited\n"  # --check writes nothing


def test_missing_lock_fails_the_check(tmp_path):
    r = cudampi_cli("env", "write", "--out", str(tmp_path), "--only", "pip", "--check")
    assert r.returncode == 1 and "requirements.lock: missing" in r.stdout


def test_bad_description_is_a_usage_error():
    r = cudampi_cli("env", "show", "--cuda", "11.2")
    assert r.returncode == 2 and "cuda='11.2'" in r.stderr and "13.0" in r.stderr
    assert cudampi_cli("env").returncode == 2


def test_settings_and_check(tmp_path):
    s = cudampi_cli("env", "settings", "--json")
    assert s.returncode == 0
    assert {x["name"] for x in json.loads(s.stdout)} >= {"OMPI_MCA_pml", "NCCL_SOCKET_IFNAME"}
    bad = cudampi_cli(
        "env", "check", "--json", "--multi-node", env={"NCCL_SOCKET_IFNAME": "lo", "UCX_TLS": "tcp"}
    )
    assert bad.returncode == 1
    assert {(f["name"], f["status"]) for f in json.loads(bad.stdout)} >= {
        ("NCCL_SOCKET_IFNAME", "fail"),
        ("UCX_TLS", "fail"),
    }
    # judged against this host's interfaces: name one that reaches other hosts (an exclusion
    # list such as ^lo,docker is rightly flagged where podman's bridge is up)
    from cudampi.probe.interfaces import query_interfaces

    uplinks = [i.name for i in query_interfaces() if i.addresses and i.host_local is None]
    if not uplinks:
        pytest.skip("this host has no interface that reaches other hosts")
    good = cudampi_cli(
        "env", "check", env={"NCCL_SOCKET_IFNAME": f"={uplinks[0]}", "UCX_TLS": "rc,cuda"}
    )
    assert good.returncode == 0 and "no known-wrong" in good.stdout, good.stdout


def test_write_fails_when_the_folder_would_not_work_on_its_own(tmp_path):
    """No package index: the lock install.sh and the Dockerfile need cannot be resolved (nor the
    wheel built), so env write says so and exits 1 instead of 0 with a broken folder."""
    offline = {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path / "none"),
        "PIP_CONFIG_FILE": "/dev/null",
    }
    r = cudampi_cli("env", "write", "--out", str(tmp_path / "gen"), "--only", "pip", env=offline)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "requirements.lock: missing, and it could not be resolved" in r.stderr
    assert "fix: run `cudampi env lock" in r.stderr
    assert (tmp_path / "gen" / "install.sh").exists()  # the rest is written


def test_out_naming_a_file_is_a_message_not_a_traceback(tmp_path):
    """--out naming a file, not a folder: one line that says so, no traceback."""
    (tmp_path / "f").write_text("")
    r = cudampi_cli("env", "write", "--out", str(tmp_path / "f"), "--only", "conda")
    assert r.returncode == 1 and "is a file; the files go into a folder" in r.stderr
    assert "Traceback" not in r.stderr
