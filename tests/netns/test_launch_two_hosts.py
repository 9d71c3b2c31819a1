"""A real two-host launch: two network namespaces joined by a veth pair, a real sshd in each
(key-only, a throwaway key), each with its own hostname (UTS namespace); ``cudampi launch`` runs
in the first and reaches the second over ssh and TCP. Then the second host is killed mid-run,
and finally it refuses ssh: both must end the job non-zero, naming the host.

Needs root and ``ip netns`` (skipped with the reason otherwise) and sshd (openssh-server).
The namespaces share the filesystem, so the venv's python and MPI are at the same paths there.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpirun import bring_up

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[2]
TARGET = str(ROOT / "tests" / "mpi" / "_launch_target.py")
ADDR = ("10.231.0.1", "10.231.0.2")
NAMES = ("cm-host1", "cm-host2")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _why_skip(*, need_ssh: bool = True) -> str | None:
    if os.geteuid() != 0:
        return "needs root (creates network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip: apt-get install iproute2 (see .ci/run)"
    missing = [t for t in ("ssh", "ssh-keygen") if shutil.which(t) is None]
    if not Path(SSHD).exists():
        missing.insert(0, "sshd")
    if need_ssh and missing:
        return (
            f"OpenSSH is not installed ({', '.join(missing)} missing): apt-get install "
            "openssh-server openssh-client (see .ci/run)"
        )
    probe = f"cudampi-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns is unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} exited {p.returncode}: {p.stderr}")
    return p


class TwoHosts:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"cmA{tag}", f"cmB{tag}")
        self.key = tmp / "id"
        self.ssh = (
            f"ssh -i {self.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
            "-o BatchMode=yes -o LogLevel=ERROR -o ConnectTimeout=5"
        )

    def up(self) -> None:
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.tmp / "hostkey"))
        shutil.copy(f"{self.key}.pub", self.tmp / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        self.link("cv")
        for i in (0, 1):
            self.start_sshd(i)

    def link(self, prefix: str) -> None:
        """The two namespaces, joined by a veth pair (``{prefix}a…``/``{prefix}b…`` until
        moved), named cm0 with ADDR on both hosts."""
        a, b = self.ns
        tag = a[3:]
        for n in self.ns:
            sh("ip", "netns", "add", n)
        va, vb = f"{prefix}a{tag}", f"{prefix}b{tag}"
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for n, dev, addr in ((a, va, ADDR[0]), (b, vb, ADDR[1])):
            sh("ip", "link", "set", dev, "netns", n)
            sh("ip", "-n", n, "link", "set", dev, "name", "cm0")  # same name on both hosts
            sh("ip", "-n", n, "addr", "add", f"{addr}/24", "dev", "cm0")
            sh("ip", "-n", n, "link", "set", "cm0", "up")
            sh("ip", "-n", n, "link", "set", "lo", "up")

    def start_sshd(self, i: int) -> None:
        conf = self.tmp / f"sshd{i}.conf"
        conf.write_text(
            f"ListenAddress {ADDR[i]}\nPort 22\nHostKey {self.tmp / 'hostkey'}\n"
            f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PermitRootLogin prohibit-password\nPidFile {self.tmp / f'sshd{i}.pid'}\n"
        )
        # sshd daemonizes; its sessions inherit the namespace's own hostname.
        sh(*self.in_host(i, SSHD, "-f", str(conf), "-E", str(self.tmp / f"sshd{i}.log")))
        deadline = time.monotonic() + 10
        while sh(
            *self.in_host(0, "sh", "-c", f"{self.ssh} {ADDR[i]} true"), check=False
        ).returncode:
            assert time.monotonic() < deadline, (self.tmp / f"sshd{i}.log").read_text()
            time.sleep(0.2)

    def in_host(self, i: int, *argv: str) -> list[str]:
        """argv run on host i: in its network namespace, under its own hostname."""
        return [
            "ip",
            "netns",
            "exec",
            self.ns[i],
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            NAMES[i],
            *argv,
        ]

    def pids(self, i: int) -> list[int]:
        out = sh("ip", "netns", "pids", self.ns[i], check=False).stdout.split()
        return [int(p) for p in out]

    def kill_host(self, i: int) -> None:
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def down(self) -> None:
        for i in (0, 1):
            self.kill_host(i)
        for n in self.ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)

    def launch_argv(self, *args: str) -> list[str]:
        return self.in_host(0, sys.executable, "-m", "cudampi", "launch", "--ssh", self.ssh, *args)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    yield from bring_up(lambda: TwoHosts(tmp_path_factory.mktemp("two-hosts")), _why_skip())


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_two_hosts_from_an_mpich_style_hostfile(hosts: TwoHosts, tmp_path: Path):
    hf = tmp_path / "hosts"
    hf.write_text(f"# two namespaces\n{ADDR[0]}:2\n{ADDR[1]}:2\n")  # MPICH format: rewritten
    dry = run(hosts.launch_argv("--hostfile", str(hf), "--dry-run", TARGET))
    assert f"#   {ADDR[1]} slots=2" in dry.stdout, dry.stdout + dry.stderr
    assert "btl_tcp_if_include 10.231.0.0/24" in dry.stdout
    p = run(hosts.launch_argv("--hostfile", str(hf), TARGET, "check", "4", "--flag", "a b"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 4" in p.stdout
    for r, name in ((0, NAMES[0]), (1, NAMES[0]), (2, NAMES[1]), (3, NAMES[1])):
        # output from both hosts; NCCL/Gloo's interface picked per host from the route
        assert f"rank {r} ok on {name} ifname=cm0" in p.stdout, p.stdout


def test_selftest_across_two_hosts(hosts: TwoHosts):
    p = run(hosts.launch_argv("--hosts", f"{ADDR[0]}:1,{ADDR[1]}:1", "-m", "cudampi.selftest"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rank(s) on 2 host(s) via openmpi" in p.stdout
    assert "selftest: PASS" in p.stdout


def test_nccl_settings_reach_the_ranks_on_the_other_host(hosts: TwoHosts):
    """NCCL reads its settings in every rank; mpirun forwards nothing by itself to a remote
    host, so `cudampi launch` forwards the NCCL_* variables set here."""
    argv = hosts.launch_argv("--hosts", f"{ADDR[0]}:1,{ADDR[1]}:1", TARGET, "env")
    argv += ["NCCL_IB_HCA", "NCCL_DEBUG"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.update(NCCL_IB_HCA="=mlx5_7:1", NCCL_DEBUG="WARN")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    for r, name in ((0, NAMES[0]), (1, NAMES[1])):
        assert f"rank {r} on {name}: NCCL_IB_HCA==mlx5_7:1 NCCL_DEBUG=WARN" in p.stdout, p.stdout


def test_hierarchical_collectives_with_a_node_per_host(hosts: TwoHosts):
    """The ipc path's hierarchical collectives, nodes found by MPI's shared-memory split: two
    real hosts of 2 ranks each (MPI inside a node standing in for the kernels, the cross-node
    step over TCP between the hosts), then uneven hosts, refused by every rank."""
    p = run(hosts.launch_argv("--hosts", f"{ADDR[0]}:2,{ADDR[1]}:2", TARGET, "hier", "0", "2"))
    assert p.returncode == 0, p.stdout + p.stderr
    want = f"4 ranks, 2 nodes of 2 on {[NAMES[0]] * 2 + [NAMES[1]] * 2}"
    assert f"hierarchical ok: {want}" in p.stdout, p.stdout + p.stderr
    p = run(hosts.launch_argv("--hosts", f"{ADDR[0]}:1,{ADDR[1]}:2", TARGET, "hier", "0", "2"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("REFUSED") == 3 and "node sizes here: [1, 2]" in p.stdout, p.stdout


def test_a_host_killed_mid_run_fails_the_job_naming_it(hosts: TwoHosts, tmp_path: Path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "TARGET_SLEEP": "60",
    }
    job = subprocess.Popen(
        hosts.launch_argv(
            "--hosts",
            f"{ADDR[0]}:2,{ADDR[1]}:2",
            "-x",
            "TARGET_SLEEP",
            TARGET,
            "sleep",
            str(tmp_path),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 4:  # every rank runs, on both hosts
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        remote = {int((tmp_path / f"{r}.pid").read_text()) for r in (2, 3)}
        assert remote <= set(hosts.pids(1))
        start = time.monotonic()
        hosts.kill_host(1)  # its sshd, its daemon, its ranks
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert time.monotonic() - start < 30
    assert job.returncode != 0
    assert f"host {ADDR[1]} was lost during the run" in err, out + err
    local = [int((tmp_path / f"{r}.pid").read_text()) for r in (0, 1)]
    assert [p for p in local if _alive(p)] == []  # no orphans left running on host 1


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_host_refusing_ssh_is_named(hosts: TwoHosts):
    assert hosts.pids(1) == []  # killed by the previous test: nothing listens on port 22
    p = run(
        hosts.launch_argv("--hosts", f"{ADDR[0]}:1,{ADDR[1]}:1", TARGET, "check", "2"), timeout=60
    )
    assert p.returncode != 0
    assert f"host {ADDR[1]} cannot be reached: Connection refused" in p.stderr, p.stdout + p.stderr
    hosts.start_sshd(1)  # leave it as found
