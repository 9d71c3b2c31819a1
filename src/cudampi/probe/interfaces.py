"""This host's network interfaces as the doctor sees them (psutil, and /sys/class/net for what
psutil does not tell: bridges and their ports), and which of them NCCL_SOCKET_IFNAME selects
(NCCL's documented syntax).

:func:`query_interfaces` reads the host; the rest is pure.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYS_NET = Path("/sys/class/net")


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...] = ()
    """``address/prefix``, IPv4 then IPv6, in the kernel's order."""
    up: bool | None = None
    bridge: bool = False
    """A Linux bridge (``docker0``, ``cni-podman0``, ``virbr0``): the switch of this host's
    containers or VMs, which reaches no other host by itself."""
    bridge_of: str | None = None
    """The bridge this interface is a port of (a container's ``veth`` on the host side): its
    traffic is the bridge's."""

    @property
    def loopback(self) -> bool:
        return self.name == "lo" or any(a.startswith(("127.", "::1")) for a in self.addresses)

    @property
    def host_local(self) -> str | None:
        """Why this interface carries no traffic to other hosts (None: it may)."""
        if self.loopback:
            return "loopback"
        if self.bridge:
            return "a bridge of this host's containers or VMs"
        if self.bridge_of:
            return f"a port of bridge {self.bridge_of}"
        return None


def _address(addr: str, netmask: str | None) -> str:
    """``address/prefix`` from psutil's address and netmask (an IPv6 netmask too)."""
    addr = addr.split("%", 1)[0]  # fe80::1%eth0: the scope is the interface itself
    try:
        ip = ipaddress.ip_address(addr)
        mask = int(ipaddress.ip_address(netmask)) if netmask else None
    except ValueError:
        return addr
    if mask is None:
        return addr
    return f"{ip}/{bin(mask).count('1')}"


_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def interfaces_from(
    addrs: Mapping[str, Sequence[Any]],
    stats: Mapping[str, Any],
    bridges: Collection[str] = (),
    ports: Mapping[str, str] | None = None,
) -> list[Interface]:
    """Interfaces from ``psutil.net_if_addrs()`` and ``psutil.net_if_stats()`` (pure): every
    interface either names, in their order, with its IPv4 then IPv6 addresses."""
    ports = ports or {}
    out = []
    for name in [*addrs, *(n for n in stats if n not in addrs)]:
        found = sorted(
            (a for a in addrs.get(name, ()) if a.family in _FAMILIES),
            key=lambda a: _FAMILIES.index(a.family),
        )
        stat = stats.get(name)
        out.append(
            Interface(
                name,
                tuple(_address(a.address, a.netmask) for a in found),
                bool(stat.isup) if stat is not None else None,
                name in bridges,
                ports.get(name),
            )
        )
    return out


def _bridges(sys_net: Path) -> tuple[list[str], dict[str, str]]:
    """Bridges (``NAME/bridge``) and bridge ports (``NAME/brport`` -> ``NAME/master``)."""
    bridges: list[str] = []
    ports: dict[str, str] = {}
    try:
        entries = sorted(sys_net.iterdir())
    except OSError:
        return bridges, ports
    for p in entries:
        if (p / "bridge").is_dir():
            bridges.append(p.name)
        if (p / "brport").is_dir():
            try:
                ports[p.name] = (p / "master").resolve().name
            except OSError:
                ports[p.name] = "?"
    return bridges, ports


def query_interfaces() -> list[Interface]:
    """This host's (this network namespace's) interfaces, their addresses and state."""
    import psutil

    bridges, ports = _bridges(SYS_NET)
    return interfaces_from(psutil.net_if_addrs(), psutil.net_if_stats(), bridges, ports)


def _ifname_spec(spec: str) -> tuple[bool, bool, list[str]]:
    """NCCL_SOCKET_IFNAME's documented syntax: (exclude ``^``, exact ``=``, the names)."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    return exclude, exact, [s.strip() for s in spec.split(",") if s.strip()]


def nccl_ifname_matches(spec: str, names: Sequence[str]) -> list[str]:
    """Which interfaces NCCL_SOCKET_IFNAME selects: comma-separated prefixes, ``=`` for exact
    names, a leading ``^`` to exclude (NCCL's documented syntax)."""
    exclude, exact, items = _ifname_spec(spec)

    def hit(name: str) -> bool:
        return any(name == it if exact else name.startswith(it) for it in items)

    return [n for n in names if hit(n) != exclude]


def nccl_ifname_missing(spec: str, names: Sequence[str]) -> list[str]:
    """The entries of NCCL_SOCKET_IFNAME that name no interface among ``names`` (prefixes match
    by prefix, ``=`` names exactly); an exclusion list (``^``) names nothing NCCL needs."""
    exclude, exact, items = _ifname_spec(spec)
    if exclude:
        return []
    return [it for it in items if not any(n == it if exact else n.startswith(it) for n in names)]
