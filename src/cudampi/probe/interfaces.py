"""This host's network interfaces as the doctor sees them (``ip -o addr``, /sys/class/net), and
which of them NCCL_SOCKET_IFNAME selects (NCCL's documented syntax).

Pure parsers, tested on captured output, except :func:`query_interfaces`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...] = ()
    up: bool | None = None

    @property
    def loopback(self) -> bool:
        return self.name == "lo" or any(a.startswith(("127.", "::1")) for a in self.addresses)


def parse_ip_o_addr(text: str) -> list[Interface]:
    """``ip -o addr`` lines ``4: eth0    inet 192.0.2.2/24 brd ...`` grouped per interface."""
    order: list[str] = []
    addrs: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\d+:\s+(\S+?)(?:@\S+)?\s+inet6?\s+(\S+)", line)
        if m:
            name, addr = m.group(1), m.group(2)
            if name not in addrs:
                order.append(name)
                addrs[name] = []
            addrs[name].append(addr)
    return [Interface(n, tuple(addrs[n])) for n in order]


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


def query_interfaces() -> list[Interface]:
    """Network interfaces with addresses (``ip -o addr``) and state (/sys/class/net)."""
    found: list[Interface] = []
    ip = shutil.which("ip")
    if ip:
        try:
            proc = subprocess.run([ip, "-o", "addr"], capture_output=True, text=True, timeout=10)
            found = parse_ip_o_addr(proc.stdout) if proc.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired):
            found = []
    sys_net = Path("/sys/class/net")
    states: dict[str, bool | None] = {}
    try:
        for p in sorted(sys_net.iterdir()):
            try:
                state = (p / "operstate").read_text().strip()
            except OSError:
                state = "unknown"
            states[p.name] = {"up": True, "down": False}.get(state)
    except OSError:
        pass
    names = [i.name for i in found]
    out = [Interface(i.name, i.addresses, states.get(i.name)) for i in found]
    out += [Interface(n, (), s) for n, s in states.items() if n not in names]
    return out
