"""The image that `cudampi env write --cuda cpu` describes, built for real (tests/container/
podman.py says how), runs as its non-root user, passes its own HEALTHCHECK, and trains: the DDP
example on 2 ranks inside one container (MODE=train, the default)."""

from __future__ import annotations

import json
import time

import pytest

from tests.container.conftest import Image
from tests.container.podman import ROOT, note

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(1800)]

RUN = ("run", "--rm", "--health-interval", "disable")  # no systemd here to time the checks


def test_the_image_runs_as_the_non_root_user(image: Image):
    p = image.podman
    config = json.loads(p("image", "inspect", image.name).stdout)[0]["Config"]
    assert config["User"] == "1000:1000"
    ids = p(*RUN, image.name, "sh", "-c", "id -u; id -g; id -un; echo $HOME").stdout.split()
    assert ids == ["1000", "1000", "mpiuser", "/home/mpiuser"]


def test_the_healthcheck_passes_and_so_does_the_doctor(image: Image):
    p = image.podman
    check = json.loads(p("image", "inspect", image.name).stdout)[0]["Healthcheck"]
    assert check["Test"] == ["CMD", "/usr/local/bin/cudampi-healthcheck"]  # no MPI job
    name = f"{p.tag}-health"
    p("run", "--detach", "--name", name, "--health-interval", "disable", image.name, "sleep", "600")
    try:
        start = time.monotonic()
        health = p("healthcheck", "run", name, check=False, timeout=300)
        took = time.monotonic() - start
        assert health.returncode == 0, health.stdout + health.stderr  # "healthy"
        report = json.loads(p("exec", name, "cudampi", "doctor", "--json", timeout=300).stdout)
    finally:
        p.remove(name)
    assert report["exit_code"] == 0 and report["summary"]["fail"] == 0, report["summary"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["MPI library"]["detail"].startswith("Open MPI 5.0.11 from /opt/venv/lib/")
    assert checks["torch"]["detail"].startswith("torch 2.13.0+cpu")
    assert checks["host allreduce"]["status"] == "ok"
    assert "usable: eth0 " in checks["network interfaces"]["detail"]  # iproute2 is there
    note("healthcheck (MODE=train: the MPI stack loads)", f"exit 0 in {took:.1f} s")


def test_mode_train_runs_the_ddp_example_on_two_ranks(image: Image):
    start = time.monotonic()
    run = image.podman(
        *RUN,
        "--volume",
        f"{ROOT / 'examples'}:/workspace/examples:ro",
        image.name,  # MODE=train: the entrypoint runs the command given
        "cudampi",
        "launch",
        "-n",
        "2",
        "examples/ddp_train.py",
        "--json",
        timeout=300,
    )
    took = time.monotonic() - start
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["backend"] == "cudampi", result
    assert result["replicas_in_sync"] is True
    assert result["last_loss"] < result["first_loss"]
    note(
        "MODE=train",
        f"cudampi launch -n 2 examples/ddp_train.py in one container: {took:.0f} s "
        f"(training {result['seconds']:.1f} s, {result['samples_per_s']:.0f} samples/s)",
    )
