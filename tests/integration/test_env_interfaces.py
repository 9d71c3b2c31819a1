"""NCCL_SOCKET_IFNAME judged against real interfaces: a network namespace of its own with what a
container host has (the uplink eth0, podman's bridge cni-podman0 and a container's veth on it),
where `cudampi env check` and the doctor must see what the setting really selects."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from cudampi.probe.interfaces import Interface

HOST = """
mount -t sysfs sysfs /sys
ip link set lo up
ip link add eth0 type veth peer name vethc0ffee
ip link add cni-podman0 type bridge
ip link set vethc0ffee master cni-podman0
ip addr add 192.0.2.20/24 dev eth0
ip addr add 10.88.0.1/16 dev cni-podman0
for l in eth0 vethc0ffee cni-podman0; do ip link set "$l" up; done
exec "$@"
"""
"""A container host in miniature (run in a new network and mount namespace)."""


def _why_skip() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a network namespace of its own, with a bridge and a veth pair)"
    missing = [t for t in ("unshare", "ip") if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux, iproute2)"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")


def _on_host(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env}
    return subprocess.run(
        ["unshare", "--net", "--mount", "--", "sh", "-ec", HOST, "host", *argv],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
    )


def test_the_interfaces_are_read_with_their_bridges():
    probe = (
        "import dataclasses, json; from cudampi.probe.interfaces import query_interfaces as q; "
        "print(json.dumps([dataclasses.asdict(i) for i in q()]))"
    )
    out = _on_host(sys.executable, "-c", probe)
    assert out.returncode == 0, out.stderr
    found = {i.name: i for i in (Interface(**d) for d in json.loads(out.stdout))}
    assert found["eth0"].addresses[0] == "192.0.2.20/24" and found["eth0"].host_local is None
    assert found["cni-podman0"].bridge and found["cni-podman0"].addresses[0] == "10.88.0.1/16"
    assert found["vethc0ffee"].bridge_of == "cni-podman0"
    assert found["lo"].host_local == "loopback" and found["eth0"].up is True


def test_an_exclusion_list_that_selects_the_container_bridge_is_flagged():
    # '^lo,docker' keeps podman's bridge and the container's veth: NCCL's socket transport
    # would open connections on them, which reach no other host.
    check = _on_host(sys.executable, "-m", "cudampi", "env", "check", "--cpu", "--json",
                     NCCL_SOCKET_IFNAME="^lo,docker")  # fmt: skip
    assert check.returncode == 0, check.stderr  # a warning on one node
    (finding,) = json.loads(check.stdout)
    assert finding["name"] == "NCCL_SOCKET_IFNAME" and finding["status"] == "warn"
    assert "cni-podman0 (a bridge" in finding["detail"]
    assert "vethc0ffee (a port of bridge cni-podman0)" in finding["detail"]
    assert finding["fix"] == "export NCCL_SOCKET_IFNAME=eth0"

    multi = _on_host(sys.executable, "-m", "cudampi", "env", "check", "--cpu", "--multi-node",
                     NCCL_SOCKET_IFNAME="cni,veth")  # fmt: skip
    assert multi.returncode == 1 and "selects only cni-podman0" in multi.stdout

    doctor = _on_host(sys.executable, "-m", "cudampi", "doctor", "--no-runtime", "--json",
                      NCCL_SOCKET_IFNAME="^lo,docker")  # fmt: skip
    rows = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    net = rows["network interfaces"]
    assert net["status"] == "warn" and net["detail"].startswith(
        "NCCL_SOCKET_IFNAME='^lo,docker' selects cni-podman0 (a bridge"
    )
    assert net["fix"] == "export NCCL_SOCKET_IFNAME=eth0"
    assert rows["MPI/UCX/NCCL settings"]["status"] == "ok"  # said once, on the row above

    good = _on_host(sys.executable, "-m", "cudampi", "env", "check", "--cpu", "--multi-node",
                    NCCL_SOCKET_IFNAME="eth0")  # fmt: skip
    assert good.returncode == 0 and "no known-wrong" in good.stdout, good.stdout
