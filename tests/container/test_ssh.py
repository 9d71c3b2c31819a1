"""MODE=ssh across containers: two of the image (a, b) on a private bridge of this machine
(``podman network create --internal``: it reaches nothing outside), each with the job's key
pair mounted read-only, as the MPI Operator mounts its Secret. From a, ``cudampi launch --hosts
a:1,b:1`` runs a Communicator allreduce and the DDP example across both with the image's own
settings (no --ssh: the image's ssh_config and OMPI_MCA_plm_rsh_agent=ssh); then b is killed
mid-run and the job must end naming it.

sshd takes keys only: a password set for the user is refused. Host keys are checked: every host serves the job's key pair as its host key and the client trusts that key
only, so a third container (c) that holds the job's authorized_keys but another key pair is
refused by a, while b is accepted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.container.conftest import Image
from tests.container.podman import JOB_DIR, ROOT, note
from tests.mpirun import bring_up

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(1800)]

HOSTS = ("a", "b", "c")
"""a, b: the job's hosts; c: a host with another key pair."""


class Cluster:
    def __init__(self, image: Image, tmp: Path) -> None:
        self.image = image
        self.p = image.podman
        self.tmp = tmp
        self.addr: dict[str, str] = {}
        self.subnet = ""

    def name(self, host: str) -> str:
        return f"{self.p.tag}-{host}"

    def up(self) -> None:
        start = time.monotonic()
        net = self.p.network(f"{self.p.tag}-net")
        self.subnet = str(net.net)
        self.addr = {h: net.address(i + 1) for i, h in enumerate(HOSTS)}
        job = self._keys("job-ssh", None)
        other = self._keys("other-ssh", job)
        hosts = [a for h, ip in self.addr.items() for a in ("--add-host", f"{h}:{ip}")]
        for h in HOSTS:
            self.p(
                "run",
                "--detach",
                "--name",
                self.name(h),
                "--hostname",
                h,
                "--network",
                net.name,
                "--ip",
                self.addr[h],
                *hosts,
                "--health-interval",
                "disable",
                "--env",
                "MODE=ssh",
                "--volume",
                f"{job if h != 'c' else other}:/home/mpiuser/.ssh:ro",
                "--volume",
                f"{JOB_DIR}:/workspace/job:ro",
                "--volume",
                f"{ROOT / 'examples'}:/workspace/examples:ro",
                self.image.name,
            )
        deadline = time.monotonic() + 60
        for h in HOSTS:
            while "Server listening" not in self.p("logs", self.name(h)).stderr:
                assert time.monotonic() < deadline, self.p("logs", self.name(h)).stderr
                time.sleep(0.2)
        note("MODE=ssh: three containers up", f"{time.monotonic() - start:.1f} s")

    def _keys(self, folder: str, job: Path | None) -> Path:
        """A key folder as the MPI Operator mounts it: id_rsa, id_rsa.pub, authorized_keys
        (the job's public key); owned by the image's user, as a Secret with fsGroup is."""
        d = self.tmp / folder
        d.mkdir()
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", folder, "-f", str(d / "id_rsa")],
            check=True,
            timeout=30,
        )
        shutil.copy((job or d) / "id_rsa.pub", d / "authorized_keys")
        for f in (d, *d.iterdir()):
            shutil.chown(f, 1000, 1000)
        d.chmod(0o700)
        return d

    def exec(
        self, host: str, *argv: str, env: tuple[str, ...] = (), timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        flags = [a for e in env for a in ("--env", e)]
        return self.p("exec", *flags, self.name(host), *argv, check=False, timeout=timeout)

    def down(self) -> None:
        self.p.remove(*(self.name(h) for h in HOSTS))
        self.p("network", "rm", "--force", f"{self.p.tag}-net", check=False)


@pytest.fixture(scope="module")
def cluster(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from bring_up(lambda: Cluster(image, tmp_path_factory.mktemp("cluster")), None)


def test_key_login_and_host_keys_are_checked(cluster: Cluster):
    ok = cluster.exec("a", "ssh", "b", "hostname")
    assert (ok.returncode, ok.stdout.strip()) == (0, "b"), ok.stderr
    # c accepts the job's key, but its own host key is not the job's: refused before login
    impostor = cluster.exec("a", "ssh", "c", "hostname")
    assert impostor.returncode == 255 and impostor.stdout == ""
    assert "Host key verification failed" in impostor.stderr, impostor.stderr
    opts = cluster.exec("a", "ssh", "-G", "b").stdout.splitlines()
    assert "stricthostkeychecking true" in opts
    assert "knownhostscommand /usr/local/bin/cudampi-known-hosts %H" in opts


def test_password_login_is_refused(cluster: Cluster):
    set_pw = cluster.p(
        "exec", "--user", "root", cluster.name("b"), "sh", "-c", "echo mpiuser:pw-123 | chpasswd"
    )
    assert set_pw.returncode == 0
    cluster.exec(
        "a", "sh", "-c", "printf '#!/bin/sh\\necho pw-123\\n' > /tmp/askpass; chmod +x /tmp/askpass"
    )
    tried = cluster.exec(
        "a",
        "ssh",
        "-o",
        "BatchMode=no",
        "-o",
        "PubkeyAuthentication=no",
        "-o",
        "PasswordAuthentication=yes",
        "-o",
        "KbdInteractiveAuthentication=yes",
        "-o",
        "PreferredAuthentications=password,keyboard-interactive",
        "b",
        "hostname",
        env=("SSH_ASKPASS=/tmp/askpass", "SSH_ASKPASS_REQUIRE=force", "DISPLAY=:0"),
    )
    assert tried.returncode == 255 and tried.stdout == ""
    # the server offers public keys and nothing else
    assert "mpiuser@b: Permission denied (publickey)." in tried.stderr, tried.stderr


def _launch(cluster: Cluster, *args: str, timeout: float = 300) -> tuple[float, str, str]:
    start = time.monotonic()
    run = cluster.exec("a", "cudampi", "launch", "--hosts", "a:1,b:1", *args, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return time.monotonic() - start, run.stdout, run.stderr


def test_launch_runs_a_communicator_allreduce_across_two_containers(cluster: Cluster):
    env = dict(
        line.split("=", 1) for line in cluster.exec("a", "env").stdout.splitlines() if "=" in line
    )
    # The settings the generator wrote for Open MPI 5 (oob_tcp_listen_mode is Open MPI 4 only:
    # PRRTE has no such parameter, and the generator leaves it out for 5).
    assert env["OMPI_MCA_plm_rsh_agent"] == "ssh"
    assert "OMPI_MCA_oob_tcp_listen_mode" not in env
    # (a dry run looks up no host name: given by address, the hosts' network is worked out)
    hosts = f"{cluster.addr['a']}:1,{cluster.addr['b']}:1"
    dry = cluster.exec("a", "cudampi", "launch", "--hosts", hosts, "--dry-run", "job/_job.py")
    assert dry.returncode == 0, dry.stderr
    # the interface: MPI's TCP and its daemons' kept on the bridge's subnet
    assert f"--mca btl_tcp_if_include {cluster.subnet}" in dry.stdout, dry.stdout
    assert f"--mca oob_tcp_if_include {cluster.subnet}" in dry.stdout
    assert "plm_rsh_agent" not in dry.stdout  # no --ssh: the image's own ssh setup
    took, out, _ = _launch(cluster, "job/_job.py")
    for rank, host in ((0, "a"), (1, "b")):
        assert (
            f"rank {rank} of 2 on {host}: allreduce ok "
            "OMPI_MCA_plm_rsh_agent=ssh NCCL_SOCKET_IFNAME=^lo,docker"
        ) in out, out
    note("MODE=ssh: Communicator allreduce, a:1,b:1", f"{took:.1f} s")


def test_launch_runs_the_ddp_example_across_two_containers(cluster: Cluster):
    took, out, _ = _launch(cluster, "examples/ddp_train.py", "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["replicas_in_sync"] is True, result
    assert result["last_loss"] < result["first_loss"]
    note("MODE=ssh: DDP example, a:1,b:1", f"{took:.1f} s")


def test_killing_the_second_container_ends_the_job_naming_it(cluster: Cluster):
    job = cluster.p.popen(
        "exec", cluster.name("a"), "cudampi", "launch", "--hosts", "a:1,b:1", "job/_job.py", "sleep"
    )
    try:
        assert job.stdout is not None
        seen = ""
        deadline = time.monotonic() + 120
        while "rank 1 sleeping on b" not in seen or "rank 0 sleeping on a" not in seen:
            line = job.stdout.readline()
            assert line and time.monotonic() < deadline, seen + job.communicate()[1]
            seen += line
        start = time.monotonic()
        cluster.p("kill", cluster.name("b"))
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "host b was lost during the run" in err, out + err
    assert took < 30
    deadline = time.monotonic() + 10
    while True:  # nothing of the job is left on a
        left = cluster.exec("a", "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        if ("job/_job.py" not in left and "prte" not in left) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "job/_job.py" not in left and "prte" not in left, left
    note("MODE=ssh: b killed mid-run", f"the job ended {took:.1f} s later, naming host b")
