"""This host on the network: its IPv4 interfaces, the one (and the address) that reaches a given
host, a free port.

The ground floor, for every room that opens or names a socket: the launcher keeps Open MPI's TCP
on the network that reaches the remote hosts; each rank sets NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME
to the interface that routes to MASTER_ADDR on *its* host (names differ between hosts, so the
launcher cannot choose for them); the torch rendezvous, the PMI server and ``cudampi.init()``
publish the address other hosts reach them by. Only the standard library is used (no iproute2
needed): the kernel picks the source address of a connected UDP socket (no packet is sent) and
ioctls name its interface.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    netmask: str

    @property
    def network(self) -> str:
        """The interface's network in CIDR form, e.g. ``10.231.0.0/24``."""
        return str(ipaddress.IPv4Interface(f"{self.address}/{self.netmask}").network)

    @property
    def loopback(self) -> bool:
        return ipaddress.IPv4Address(self.address).is_loopback


def interfaces() -> list[Interface]:
    """Every IPv4 interface that is configured on this host (in its network namespace)."""
    import fcntl

    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24]
                mask = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, req)[20:24]
            except OSError:
                continue  # no IPv4 address on this interface
            out.append(Interface(name, socket.inet_ntoa(addr), socket.inet_ntoa(mask)))
    return out


def source_address(dest: str) -> str | None:
    """The local address the kernel would use to reach ``dest`` (None: no route)."""
    try:
        info = socket.getaddrinfo(dest, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(info[0][4])
        except OSError:
            return None
        return str(s.getsockname()[0])


def routed_address(dest: str | None = None) -> str:
    """The address of this host that ``dest`` (None: other hosts in general) reaches it by.

    The source address of the route to ``dest``; where that is loopback or there is no route,
    the address this host's name resolves to; where that is loopback too (a common /etc/hosts
    entry), the source address of the default route; the host name as the last resort.
    """
    addr = source_address(dest) if dest else None
    if not addr or _loopback(addr):
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = None
    if not addr or _loopback(addr):
        addr = source_address(_ANYWHERE)
    if not addr or _loopback(addr):
        return socket.gethostname()
    return addr


_ANYWHERE = "10.255.255.255"
"""A destination off any single host, to ask for the default route's source (nothing is sent)."""


def _loopback(addr: str) -> bool:
    return addr.startswith("127.")


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
RESERVED_PORTS = "/proc/sys/net/ipv4/ip_local_reserved_ports"
LOWEST_PORT = 10000
"""Ports below this are left to the machine's services (databases, web servers, ...)."""


def parse_port_range(text: str) -> tuple[int, int]:
    """``ip_local_port_range``'s two numbers (``"32768\t60999"``)."""
    lo, hi = (int(x) for x in text.split()[:2])
    return lo, hi


def parse_reserved_ports(text: str) -> set[int]:
    """``ip_local_reserved_ports`` (``"8080,9000-9010"``, or empty) as a set of ports."""
    ports: set[int] = set()
    for item in text.replace("\n", "").split(","):
        first, _, last = item.strip().partition("-")
        if first.isdigit():
            ports.update(range(int(first), int(last or first) + 1))
    return ports


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def listen_candidates(ephemeral: tuple[int, int], reserved: set[int]) -> list[int]:
    """Ports a server may be told to listen on ahead of time: outside the kernel's ephemeral
    range ``ephemeral`` (which it hands to outgoing connections), not reserved, not a low one."""
    lo, hi = ephemeral
    ports = [*range(LOWEST_PORT, lo), *range(max(hi + 1, LOWEST_PORT), 65536)]
    return [p for p in ports if p not in reserved]


def _candidates() -> list[int]:
    ephemeral = _read(EPHEMERAL_RANGE)
    return listen_candidates(
        parse_port_range(ephemeral) if ephemeral.strip() else (32768, 60999),
        parse_reserved_ports(_read(RESERVED_PORTS)),
    )


def port_for(digest: int) -> int:
    """A port every process of a job computes alike from the job's ``digest`` without talking
    (the hosts' ephemeral ranges alike), outside the ephemeral range for :func:`free_port`'s
    reason; not checked free (it is chosen before the server that binds it exists)."""
    candidates = _candidates() or list(range(LOWEST_PORT, 32768))
    return candidates[digest % len(candidates)]


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` (this host's address; all of them by default) now, for a
    server that another process starts later (MASTER_PORT, Slurm's ports).

    Not the kernel's pick of ``bind(0)``: that comes from the ephemeral range, which the kernel
    also hands out as the source port of every outgoing connection (ssh, Open MPI's daemons,
    a rank's own), so one of those can take it before the server binds it (EADDRINUSE). A port
    outside that range is taken only by a process that asks for it by number."""
    import random

    candidates = _candidates()
    rng = random.SystemRandom()
    for port in rng.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all busy: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def interface_for(dest_source: str | None, ifaces: Sequence[Interface]) -> Interface | None:
    """The interface that owns ``dest_source`` (the output of :func:`source_address`).

    A destination on this host routes over ``lo`` with the destination itself as source: then the
    interface owning that address is the one other hosts reach it by, so it is the right one.
    """
    if dest_source is None:
        return None
    for iface in ifaces:
        if iface.address == dest_source:
            return iface
    return None


def route_interface(dest: str, ifaces: Sequence[Interface] | None = None) -> Interface | None:
    """The interface of this host that reaches ``dest``."""
    return interface_for(source_address(dest), interfaces() if ifaces is None else ifaces)


def local_names(ifaces: Sequence[Interface] | None = None) -> frozenset[str]:
    """Names and addresses that mean this host."""
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    names.update(i.address for i in (interfaces() if ifaces is None else ifaces))
    return frozenset(n for n in names if n)


def is_local(host: str, names: frozenset[str]) -> bool:
    """Is ``host`` this machine: one of ``names``, or does it resolve to one of them?"""
    if host in names:
        return True
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(host, None, socket.AF_INET)}
    except (socket.gaierror, UnicodeError):
        return False
    return bool(addrs & names) or any(ipaddress.IPv4Address(a).is_loopback for a in addrs)
