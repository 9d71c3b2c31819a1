"""A small cluster on one machine: N network namespaces ("nodes") on one bridge, each with its
own hostname and a real sshd (key-only, a throwaway key), for tests that need several hosts.

The bridge lives in a namespace of its own (the "switch"), so nothing is added to the machine's
own network; node ``i`` is ``node<i+1>`` at ``10.232.0.<i+1>``, and processes started with
:meth:`Cluster.in_host` resolve the node names through a private ``/etc/hosts`` (a bind mount
in their own mount namespace). The namespaces share the filesystem, so the venv's python and
MPI are at the same paths on every node, as on a cluster with a shared home.

Faults a test can put on one node and take off again: a slower link (``tc``'s token bucket on
its veth), a login environment of its own (``SetEnv`` in its sshd: what its shell startup or a
module would set), a firewall that lets ssh through and nothing else (``iptables``), and the node
gone (its processes killed, its namespace deleted).

Needs root, ``ip netns`` and sshd; :func:`why_skip` says what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SUBNET = "10.232.0"


def why_skip(*, tools: tuple[str, ...] = (), ssh: bool = True) -> str | None:
    """Why a cluster cannot be made here (None when it can): root, iproute2, OpenSSH (unless
    ``ssh`` is False: a cluster without sshd), and the extra ``tools`` a test needs (``tc``,
    ``iptables``)."""
    if os.geteuid() != 0:
        return "needs root (creates network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip: apt-get install iproute2 (see .ci/run)"
    missing = [t for t in ("ssh", "ssh-keygen") if shutil.which(t) is None]
    if not Path(SSHD).exists():
        missing.insert(0, "sshd")
    if ssh and missing:
        return (
            f"OpenSSH is not installed ({', '.join(missing)} missing): apt-get install "
            "openssh-server openssh-client (see .ci/run)"
        )
    probe = f"cudampi-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns is unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs {tool}: apt-get install {'iproute2' if tool == 'tc' else tool}"
    return None


def sh(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{argv} exited {p.returncode}: {p.stderr}")
    return p


class Cluster:
    """``n`` nodes on one bridge; see the module docstring."""

    def __init__(
        self,
        tmp: Path,
        n: int = 4,
        tag: str = "cj",
        login: dict[str, str] | None = None,
        *,
        sshd: bool = True,
        own_shm: bool = False,
    ) -> None:
        self.tmp = tmp
        self.n = n
        self.sshd = sshd
        """Each node runs an sshd (False: a test starts each node's side itself, as torchrun)."""
        self.own_shm = own_shm
        """Each process started on a node gets a /dev/shm of its own (a tmpfs that goes when the
        last process of that start ends), as separate machines have."""
        pid = f"{os.getpid() % 100000}"
        self.switch = f"{tag}S{pid}"
        self.ns = [f"{tag}{i}n{pid}" for i in range(n)]
        self.names = [f"node{i + 1}" for i in range(n)]
        self.addr = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.key = tmp / "id"
        self.hosts_file = tmp / "hosts"
        self.ssh = (
            f"ssh -i {self.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
            "-o BatchMode=yes -o LogLevel=ERROR -o ConnectTimeout=5"
        )
        self.base_login = dict(login or {})
        """What every node's sessions get (the site's own settings)."""
        self.login: dict[int, dict[str, str]] = {}

    # -- bring up, take down -----------------------------------------------------------------

    def up(self) -> None:
        if self.sshd:
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.tmp / "hostkey"))
            shutil.copy(f"{self.key}.pub", self.tmp / "authorized_keys")
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for a, n in zip(self.addr, self.names)]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            self.add_node(i)

    def add_node(self, i: int) -> None:
        """Node ``i``: its namespace, its veth to the bridge (``cm0`` inside, ``p<i>`` on the
        switch), its address and its sshd (where the nodes have one)."""
        ns = self.ns[i]
        sh("ip", "netns", "add", ns)
        port = f"p{i}"
        sh(
            "ip", "-n", ns, "link", "add", "cm0", "type", "veth",
            "peer", "name", port, "netns", self.switch,
        )  # fmt: skip
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", port, "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", "cm0")
        sh("ip", "-n", ns, "link", "set", "cm0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        for other in self.ns:  # a node made again has a new MAC: forget the old one
            if other != ns:
                sh("ip", "-n", other, "neigh", "flush", "all", check=False)
        if self.sshd:
            self.start_sshd(i)

    def start_sshd(self, i: int) -> None:
        conf = self.tmp / f"sshd{i}.conf"
        login = {**self.base_login, **self.login.get(i, {})}
        # one SetEnv line: sshd keeps the first of a repeated keyword
        setenv = f"SetEnv {' '.join(f'{k}={v}' for k, v in login.items())}\n" if login else ""
        conf.write_text(
            f"ListenAddress {self.addr[i]}\nPort 22\nHostKey {self.tmp / 'hostkey'}\n"
            f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nMaxStartups 100\n"
            f"PermitRootLogin prohibit-password\nPidFile {self.tmp / f'sshd{i}.pid'}\n{setenv}"
        )
        # sshd daemonizes; its sessions inherit the namespace's own hostname.
        sh(*self.in_host(i, SSHD, "-f", str(conf), "-E", str(self.tmp / f"sshd{i}.log")))
        deadline = time.monotonic() + 10
        while self.run_on(0, "sh", "-c", f"{self.ssh} {self.addr[i]} true").returncode:
            assert time.monotonic() < deadline, (self.tmp / f"sshd{i}.log").read_text()
            time.sleep(0.2)

    def stop_sshd(self, i: int) -> None:
        pidfile = self.tmp / f"sshd{i}.pid"
        try:
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)

    def down(self) -> None:
        for i in range(self.n):
            self.kill_node(i)
            subprocess.run(["ip", "netns", "del", self.ns[i]], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)

    # -- running things ----------------------------------------------------------------------

    def in_host(self, i: int, *argv: str) -> list[str]:
        """argv run on node i: its network namespace, its hostname, the nodes' names (and its
        own /dev/shm where the cluster says so)."""
        shm = "mount -t tmpfs -o size=1g cmshm /dev/shm && " if self.own_shm else ""
        return [
            "ip", "netns", "exec", self.ns[i], "unshare", "--uts", "--mount", "sh", "-c",
            f'hostname "$0" && mount --bind {self.hosts_file} /etc/hosts && {shm}exec "$@"',
            self.names[i], *argv,
        ]  # fmt: skip

    def run_on(self, i: int, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return sh(*self.in_host(i, *argv), check=False, timeout=timeout)

    def rx_bytes(self, i: int) -> int:
        """Bytes node i has received on its link so far."""
        out = sh("ip", "-n", self.ns[i], "-s", "-j", "link", "show", "cm0").stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def free_port(self, i: int = 0) -> int:
        """A TCP port free on node i now."""
        probe = "from cudampi.net import free_port; print(free_port())"
        return int(sh(*self.netns(i), sys.executable, "-c", probe).stdout)

    def pids(self, i: int) -> list[int]:
        out = sh("ip", "netns", "pids", self.ns[i], check=False).stdout.split()
        return [int(p) for p in out]

    def kill_node(self, i: int) -> None:
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- faults ------------------------------------------------------------------------------

    def set_login_env(self, i: int, env: dict[str, str]) -> None:
        """Node i's sessions get ``env`` besides the site's (sshd's SetEnv: what its shell
        startup would set); ``{}`` takes it away again."""
        self.login[i] = dict(env)
        self.stop_sshd(i)
        self.start_sshd(i)

    def slow_link(self, i: int, towards: int | None = None, rate: str = "200mbit") -> None:
        """What node i sends (to node ``towards`` only, when given) goes through a token bucket
        of ``rate``: its whole link slow, or the one link between the two (htb sorts node i's
        traffic, a u32 filter picks the one destination)."""
        tbf = ["tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        dev = [*self.netns(i), "tc"]
        if towards is None:
            sh(*dev, "qdisc", "add", "dev", "cm0", "root", *tbf)
            return
        sh(*dev, "qdisc", "add", "dev", "cm0", "root", "handle", "1:", "htb", "default", "10")
        for cls in ("1:10", "1:20"):
            sh(*dev, "class", "add", "dev", "cm0", "parent", "1:", "classid", cls, "htb",
               "rate", "20gbit")  # fmt: skip
        sh(*dev, "qdisc", "add", "dev", "cm0", "parent", "1:20", "handle", "20:", *tbf)
        sh(
            *dev, "filter", "add", "dev", "cm0", "parent", "1:", "protocol", "ip", "u32",
            "match", "ip", "dst", f"{self.addr[towards]}/32", "flowid", "1:20",
        )  # fmt: skip

    def fast_link(self, i: int) -> None:
        sh(*self.netns(i), "tc", "qdisc", "del", "dev", "cm0", "root", check=False)

    def firewall(self, i: int) -> None:
        """Node i accepts ssh (port 22), its loopback and replies to its own connections; any
        other TCP connection to it is refused (its MPI ports blocked)."""
        rules = [
            ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
            ["-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT"],
            ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-A", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
        ]
        for rule in rules:
            sh(*self.netns(i), "iptables", *rule)

    def open_firewall(self, i: int) -> None:
        sh(*self.netns(i), "iptables", "-F", "INPUT", check=False)

    def remove_node(self, i: int) -> None:
        """Node i goes away: its processes killed, its namespace (and so its link) deleted."""
        self.kill_node(i)
        sh("ip", "netns", "del", self.ns[i])

    def netns(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]
