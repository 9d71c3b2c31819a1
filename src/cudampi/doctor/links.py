"""The job doctor's links between nodes (pure): which pairs meet in which round, what one pair's
test said, and which link or node stands out against the job's median.

Rounds: the circle method (a round-robin tournament): N nodes meet every other node once in N-1
rounds (N rounds for an odd N, each with one node resting), and no node is in two pairs of one
round, so each pair has its nodes' links to itself while it is measured.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NODE_TIMEOUT = 30.0
"""Seconds a node has to say it is there, and a pair (or a round) to finish its link test."""
LINK_BYTES = 4 << 20
"""Bytes of each message of the link test."""
SLOW = 0.5
"""A link below this fraction of the median bandwidth of the job's other links is slow."""
LATE = 3.0
"""A link above this multiple of the median latency of the other links (and at least
:data:`LATE_US` more) is late."""
LATE_US = 20.0

STATUSES = ("ok", "failed", "skipped")
"""ok: measured; failed: the pair's job failed or did not finish in time; skipped: not run (a
node of it did not answer)."""


def rounds(nodes: Sequence[str]) -> list[list[tuple[str, str]]]:
    """Every pair of ``nodes`` once, in rounds where no node is in two pairs: the circle method
    (the first node stays, the others turn one place a round). Each pair keeps the nodes'
    order (``(a, b)`` with ``a`` before ``b`` in ``nodes``).

    >>> rounds(["a", "b", "c", "d"])
    [[('a', 'd'), ('b', 'c')], [('a', 'c'), ('b', 'd')], [('a', 'b'), ('c', 'd')]]
    """
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"a node is named twice: {list(nodes)!r}")
    if len(nodes) < 2:
        return []
    ring: list[str | None] = list(nodes)
    if len(ring) % 2:
        ring.append(None)  # the node paired with None rests that round
    order = {n: i for i, n in enumerate(nodes)}
    out: list[list[tuple[str, str]]] = []
    for _ in range(len(ring) - 1):
        pairs = []
        for i in range(len(ring) // 2):
            a, b = ring[i], ring[len(ring) - 1 - i]
            if a is not None and b is not None:
                pairs.append((a, b) if order[a] < order[b] else (b, a))
        out.append(sorted(pairs, key=lambda p: order[p[0]]))
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return out


@dataclass(frozen=True)
class Link:
    """One pair's test: ``a`` and ``b`` as the job names them."""

    a: str
    b: str
    status: str
    latency_us: float | None = None
    """One way, half the best round trip of an 8-byte ping-pong (what the path takes)."""
    latency_median_us: float | None = None
    gbps_ab: float | None = None
    gbps_ba: float | None = None
    wrong: int = 0
    """Messages that arrived with wrong data (both ways)."""
    tcp: Mapping[str, str] = field(default_factory=dict)
    """``{"ab": "ok", "ba": "refused"}``: a plain TCP connection from a to b, and from b to a."""
    device: Mapping[str, Any] | None = None
    """The same measured with device buffers (latency_us, gbps_ab, gbps_ba), where run."""
    message: str = ""
    """Why it failed: the launcher's message (or why it was skipped)."""
    refused_by: tuple[str, ...] = ()
    """Nodes whose MPI TCP port refused the other's connection (from the MPI's own message)."""
    wall_s: float = 0.0
    measured: int = 1
    """How many times it was measured (an outlier is measured again, alone: the best counts)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"link status must be one of {STATUSES}, got {self.status!r}")

    @property
    def gbps(self) -> float | None:
        """The slower direction: what a job gets from this link both ways."""
        both = [g for g in (self.gbps_ab, self.gbps_ba) if g is not None]
        return min(both) if both else None

    @property
    def name(self) -> str:
        return f"{self.a}<->{self.b}"

    def has(self, node: str) -> bool:
        return node in (self.a, self.b)

    def other(self, node: str) -> str:
        return self.b if node == self.a else self.a

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "status": self.status,
            "latency_us": self.latency_us,
            "latency_median_us": self.latency_median_us,
            "gbps": self.gbps,
            "gbps_ab": self.gbps_ab,
            "gbps_ba": self.gbps_ba,
            "wrong": self.wrong,
            "tcp": dict(self.tcp),
            "device": dict(self.device) if self.device is not None else None,
            "message": self.message,
            "refused_by": list(self.refused_by),
            "wall_s": round(self.wall_s, 3),
            "measured": self.measured,
        }

    def best_of(self, again: Link) -> Link:
        """This link with the better of its and ``again``'s figures (a busy moment only ever
        makes a link look slower)."""
        if again.status != "ok" or self.status != "ok":
            return self
        return dataclasses.replace(
            self,
            latency_us=_least(self.latency_us, again.latency_us),
            latency_median_us=_least(self.latency_median_us, again.latency_median_us),
            gbps_ab=_most(self.gbps_ab, again.gbps_ab),
            gbps_ba=_most(self.gbps_ba, again.gbps_ba),
            wrong=self.wrong + again.wrong,
            measured=self.measured + again.measured,
        )


def link_from_report(a: str, b: str, report: Mapping[str, Any], wall_s: float = 0.0) -> Link:
    """A measured pair from the link worker's line (:mod:`cudampi.probe.links`); its rank 0 ran
    on ``a``."""
    host = report.get("host") or {}
    tcp = report.get("tcp") or {}
    dev = report.get("device")
    device = None
    if isinstance(dev, Mapping):
        device = {
            "name": dev.get("device"),
            "latency_us": dev.get("latency_us"),
            "gbps_ab": dev.get("gbps_01"),
            "gbps_ba": dev.get("gbps_10"),
            "wrong": int(dev.get("wrong_01") or 0) + int(dev.get("wrong_10") or 0),
        }
    return Link(
        a,
        b,
        "ok",
        latency_us=_num(host.get("latency_us")),
        latency_median_us=_num(host.get("latency_median_us")),
        gbps_ab=_num(host.get("gbps_01")),
        gbps_ba=_num(host.get("gbps_10")),
        wrong=int(host.get("wrong_01") or 0) + int(host.get("wrong_10") or 0),
        tcp={"ab": str(tcp.get("01", "")), "ba": str(tcp.get("10", ""))},
        device=device,
        wall_s=wall_s,
    )


def _least(a: float | None, b: float | None) -> float | None:
    both = [v for v in (a, b) if v is not None]
    return min(both) if both else None


def _most(a: float | None, b: float | None) -> float | None:
    both = [v for v in (a, b) if v is not None]
    return max(both) if both else None


def outliers(links: Sequence[Link]) -> list[Link]:
    """The measured links that stand out (slow or late against the others' median)."""
    ok = [lk for lk in links if lk.status == "ok"]
    thin, late = _outliers(ok)
    return [lk for lk in ok if lk.name in thin or lk.name in late]


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


_OMPI_TCP = re.compile(
    r"connect\(\) to (?P<addr>[0-9.]+):(?P<port>\d+) failed\s*\n\s*Error:\s*(?P<err>[^\n]+)"
)
_UCX_TCP = re.compile(r"connect\((?:fd=\d+, )?dest_addr=(?P<addr>[0-9.]+):(?P<port>\d+)\) failed")


def parse_refused(text: str) -> list[tuple[str, str]]:
    """``(address, error)`` of each MPI TCP connection the output says failed: Open MPI's
    "failed to TCP connect to a peer MPI process" warning, UCX's tcp ``connect(...) failed``."""
    out = [(m.group("addr"), m.group("err").strip()) for m in _OMPI_TCP.finditer(text)]
    out += [(m.group("addr"), "connect failed") for m in _UCX_TCP.finditer(text)]
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Finding:
    """Something the job doctor says once: about a node or a link, what it means and the fix."""

    subject: str
    """A node (``node3``) or a link (``node2<->node3``)."""
    what: str
    consequence: str
    fix: str
    severity: str = "warn"
    """warn (slower, or not the same everywhere) or fail (a job across these nodes fails)."""

    def to_json(self) -> dict[str, str]:
        return {
            "subject": self.subject,
            "severity": self.severity,
            "what": self.what,
            "consequence": self.consequence,
            "fix": self.fix,
        }


def median_of_others(values: Mapping[str, float], name: str) -> float | None:
    others = [v for k, v in values.items() if k != name]
    return statistics.median(others) if others else None


def link_findings(
    links: Iterable[Link], nodes: Sequence[str], said: set[str] | None = None
) -> list[Finding]:
    """Failed links, nodes that refuse MPI's connections, slow and late links, links with wrong
    data; where every bad link shares one node, that node is named once for them. The nodes of
    ``said`` are already named (down): their failed links are not said again."""
    links = list(links)
    refusing = _refusing(links, nodes)
    named = {f.subject for f in refusing} | set(said or ())
    findings = _failed(links, nodes, named)
    findings += refusing
    findings += _slow(links, nodes)
    findings += _wrong(links)
    return findings


def _by_node(bad: Sequence[Link], links: Sequence[Link], nodes: Sequence[str]) -> dict[str, int]:
    """Nodes in every one of their measured or failed links' trouble: node -> bad link count
    (only nodes with at least two links, all of them bad, and a job of at least three nodes)."""
    if len(nodes) < 3:
        return {}
    out = {}
    for n in nodes:
        mine = [lk for lk in links if lk.has(n) and lk.status != "skipped"]
        bad_mine = [lk for lk in bad if lk.has(n)]
        if len(mine) >= 2 and len(bad_mine) == len(mine):
            out[n] = len(bad_mine)
    return out


def _failed(links: Sequence[Link], nodes: Sequence[str], said: set[str]) -> list[Finding]:
    """Failed links: once for a node all of whose links failed, else each link (not the links
    of the nodes in ``said``, named for them elsewhere)."""
    failed = [lk for lk in links if lk.status == "failed" and not (said & {lk.a, lk.b})]
    out: list[Finding] = []
    named = _by_node(failed, [lk for lk in links if not (said & {lk.a, lk.b})], nodes)
    for node, count in named.items():
        msgs = "; ".join(dict.fromkeys(lk.message for lk in failed if lk.has(node)))
        out.append(
            Finding(
                node,
                f"every link of {node} failed ({count} of {count}), the others work: {msgs}",
                f"no MPI job that includes {node} can run across nodes",
                f"see {node}'s row in the table and its messages; run `cudampi doctor` on "
                f"{node} itself",
                "fail",
            )
        )
    for lk in failed:
        if any(lk.has(n) for n in named):
            continue
        out.append(
            Finding(
                lk.name,
                f"the link test of {lk.name} failed: {lk.message}",
                f"an MPI job with ranks on both {lk.a} and {lk.b} fails the same way",
                "check the network path between the two (routes, firewall, MTU) and the "
                "message above",
                "fail",
            )
        )
    return out


def _outliers(ok: Sequence[Link]) -> tuple[dict[str, str], dict[str, str]]:
    """(thin, late): link -> words, for the links below :data:`SLOW` of the median bandwidth
    of the others, and above :data:`LATE` of their median latency."""
    bw = {lk.name: lk.gbps for lk in ok if lk.gbps}
    lat = {lk.name: lk.latency_us for lk in ok if lk.latency_us is not None}
    thin: dict[str, str] = {}
    late: dict[str, str] = {}
    for lk in ok:
        med = median_of_others(bw, lk.name)
        gbps = lk.gbps or 0.0
        if med and len(bw) >= 3 and gbps < SLOW * med:
            thin[lk.name] = f"{fmt_gbps(gbps)}, {gbps / med:.2g}x the median of the other links"
        mlat = median_of_others(lat, lk.name)
        got = lat.get(lk.name)
        far = mlat is not None and got is not None and got - mlat >= LATE_US
        if mlat and got is not None and far and len(lat) >= 3 and got > LATE * mlat:
            late[lk.name] = (
                f"latency {fmt_us(got)}, {got / mlat:.2g}x the median of the other links"
            )
    return thin, late


def _slow(links: Sequence[Link], nodes: Sequence[str]) -> list[Finding]:
    ok = [lk for lk in links if lk.status == "ok"]
    thin, late = _outliers(ok)
    slow = {
        name: "; ".join(w for w in (thin.get(name), late.get(name)) if w) for name in (*thin, *late)
    }
    bad = [lk for lk in ok if lk.name in slow]
    named = _by_node(bad, ok, nodes)
    out = []
    slowest = min(
        (lk for lk in bad if lk.name in thin), key=lambda lk: lk.gbps or 0.0, default=None
    )
    for node in named:
        mine = sorted((lk for lk in bad if lk.has(node)), key=lambda lk: lk.other(node))
        each = "; ".join(f"{lk.name}: {slow[lk.name]}" for lk in mine)
        out.append(
            Finding(
                node,
                f"every link of {node} is slow ({len(mine)} of {len(mine)}): {each}",
                f"{node}'s own connection to the network is slower than the others' (its NIC, "
                f"cable or switch port, or its link rate); every job with ranks on {node} "
                "runs at its pace",
                f"check {node}'s network link (ethtool <iface> for its speed, the switch port, "
                f"the cable; ip -s link for errors), or leave {node} out of the job",
            )
        )
    for lk in bad:
        if any(lk.has(n) for n in named):
            continue
        tag = ": the slowest link" if slowest is not None and lk is slowest else ""
        out.append(
            Finding(
                lk.name,
                f"{lk.name}: {slow[lk.name]}{tag}",
                f"traffic between {lk.a} and {lk.b} takes a slower path than the rest; "
                "collectives across them run at its pace",
                f"check the path between {lk.a} and {lk.b} (switch ports and uplinks, routes: "
                f"ip route get on each; a link that negotiated a lower rate)",
            )
        )
    return out


def _wrong(links: Sequence[Link]) -> list[Finding]:
    return [
        Finding(
            lk.name,
            f"{lk.wrong} message(s) arrived with wrong data between {lk.a} and {lk.b}",
            "results computed across these nodes can be silently wrong",
            "check the NICs and the MPI transport between them (UCX_TLS, btl); rerun the doctor",
            "fail",
        )
        for lk in links
        if lk.status == "ok" and lk.wrong
    ]


def _refusing(links: Sequence[Link], nodes: Sequence[str]) -> list[Finding]:
    """Nodes that refuse TCP connections on the ports MPI uses (the pair's plain TCP test, or
    the MPI's own connection failure) from at least one peer."""
    refused: dict[str, list[str]] = {}
    for lk in links:
        for key, (src, dst) in (("ab", (lk.a, lk.b)), ("ba", (lk.b, lk.a))):
            said = lk.tcp.get(key, "ok") if lk.status == "ok" else "ok"
            if said not in ("ok", ""):
                refused.setdefault(dst, []).append(f"from {src}: {said}")
        for dst in lk.refused_by:
            refused.setdefault(dst, []).append(f"from {lk.other(dst)}: MPI's TCP connection")
    out = []
    for node in (n for n in nodes if n in refused):
        seen = "; ".join(dict.fromkeys(refused[node]))
        out.append(
            Finding(
                node,
                f"{node} does not accept TCP connections on the ports MPI uses ({seen}), "
                "though the launcher reaches it (its facts came)",
                f"MPI ranks on other nodes cannot connect to ranks on {node}: jobs with {node} "
                "fail or hang in their first message",
                f"open {node}'s firewall to the job's network (e.g. iptables -I INPUT -s "
                "<subnet> -j ACCEPT), or pin MPI's ports and open those: Open MPI --mca "
                "btl_tcp_port_min_v4 P --mca btl_tcp_port_range_v4 R (and oob_tcp_static_ipv4_"
                "ports for its daemons)",
                "fail",
            )
        )
    return out


def fmt_gbps(gbps: float | None) -> str:
    if gbps is None:
        return "-"
    return f"{gbps:.3g} GB/s" if gbps >= 0.1 else f"{gbps * 1000:.3g} MB/s"


def fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us:.3g} us" if us < 1000 else f"{us / 1000:.3g} ms"
