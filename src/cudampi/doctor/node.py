"""One node of ``cudampi doctor --hosts``: ``python -m cudampi.doctor.node OPTIONS NAME...``, run
as one rank on each node through ``cudampi launch``.

It says it is there (a ``CUDAMPI_NODE_HELLO`` line, at once), runs the single-node doctor
(:func:`cudampi.doctor.gather.gather`, its probes and its capabilities cache on this node, as
``cudampi doctor`` there would) and measures the copy rate between each pair of this node's
GPUs that can reach each other directly; then prints one ``CUDAMPI_NODE {json}`` line: this
node's column of the job's table (:func:`cudampi.doctor.jobfacts.node_summary`), its checks and
its GPU links (in lines of :data:`CHUNK` characters: ``CUDAMPI_NODE NAME I/N PART``, put
together by :func:`NodeLines.add`). OPTIONS is the JSON of :class:`~cudampi.doctor.gather.DoctorOptions`; NAME...
are the job's node names, of which this node reports the one that means itself. No MPI call is
made between the nodes: a node whose MPI cannot reach the others still reports.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

HELLO = "CUDAMPI_NODE_HELLO "
MARKER = "CUDAMPI_NODE "
CHUNK = 3000
"""Characters of the JSON per line: each line is one write of less than PIPE_BUF (4 KiB), so
the launcher forwards it whole, never cut by another node's output."""
PEER_BYTES = 64 << 20
"""Bytes of each GPU-to-GPU copy of the copy-peer measure."""


def my_name(names: Sequence[str]) -> str:
    """The one of ``names`` that means this host, else this host's name."""
    from cudampi import net

    local = net.local_names()
    mine = [n for n in names if net.is_local(n, local)]
    return mine[0] if len(mine) == 1 else socket.gethostname()


def options_json(options: Any) -> str:
    return json.dumps(dataclasses.asdict(options))


def parse_options(text: str) -> Any:
    from cudampi.doctor.gather import DoctorOptions

    raw = json.loads(text)
    for key in ("mca", "exports"):
        raw[key] = tuple(tuple(kv) for kv in raw.get(key, ()))
    return DoctorOptions(**raw)


def gpu_links(facts: Any, backend: str | None) -> dict[str, Any]:
    """This node's GPU links: the ipc engine as the doctor's probe measured it, and the copy rate
    between every pair of GPUs that NVML says can reach each other (``p2p OK``)."""
    out: dict[str, Any] = {"gpus": len(facts.gpu_system.gpus)}
    runs = facts.runtime.runs if facts.runtime is not None else {}
    ipc = runs.get("device_ipc")
    if ipc is not None:
        report = ipc.report or {}
        out["ipc"] = {
            "status": ipc.outcome.status,
            "gbps": ipc.outcome.gbps,
            "latency_us": report.get("latency_us"),
            "shared_gpu": report.get("shared_gpu"),
            "mps": report.get("mps"),
            "detail": ipc.outcome.detail,
        }
    else:
        why = facts.runtime.skipped.get("device_ipc") if facts.runtime is not None else None
        out["ipc"] = {"status": "skipped", "detail": why or facts.runtime_note or "not probed"}
    pairs = [p for p, ok in sorted(facts.gpu_system.nvml.p2p.items()) if ok == "OK" and p[0] < p[1]]
    if len(facts.gpu_system.gpus) < 2:
        out["copy_peer"] = {"status": "n/a", "detail": "one GPU: no GPU-to-GPU link"}
    elif backend is None:
        out["copy_peer"] = {"status": "skipped", "detail": "neither CuPy nor torch sees a GPU"}
    elif not pairs:
        out["copy_peer"] = {
            "status": "n/a",
            "detail": "no pair of GPUs can reach each other (NVML)",
        }
    else:
        try:
            from cudampi.probe.links import peer_copy_gbps

            rates = peer_copy_gbps(backend, pairs, PEER_BYTES)
            out["copy_peer"] = {
                "status": "ok",
                "gbps": {f"{a}-{b}": g for (a, b), g in rates.items()},
                "links": {f"{a}-{b}": facts.gpu_system.nvml.links.get((a, b)) for a, b in pairs},
            }
        except Exception as exc:  # a failed measure is a finding, not a lost node
            out["copy_peer"] = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"}
    return out


def run(options_text: str, names: Sequence[str]) -> dict[str, Any]:
    from cudampi.doctor.checks import all_checks
    from cudampi.doctor.gather import gather
    from cudampi.doctor.jobfacts import node_summary

    t0 = time.monotonic()
    facts = gather(parse_options(options_text))
    checks = all_checks(facts)
    summary = node_summary(facts, checks)
    return {
        "hostname": socket.gethostname(),
        **summary,
        "checks": [c.to_json() for c in checks],
        "gpu_links": gpu_links(facts, summary["device_backend"]),
        "cache": {
            "path": facts.cache_path,
            "keys": list(facts.cache_keys),
            "error": facts.cache_error,
        },
        "wall_s": round(time.monotonic() - t0, 2),
    }


def emit(name: str, data: dict[str, Any]) -> None:
    """``data`` on stdout as ``CUDAMPI_NODE NAME I/N PART`` lines (see :data:`CHUNK`)."""
    text = json.dumps(data, separators=(",", ":"))
    parts = [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)]
    for i, part in enumerate(parts, 1):
        print(f"{MARKER}{name} {i}/{len(parts)} {part}", flush=True)


class NodeLines:
    """The nodes' :func:`emit` lines, put together: :meth:`add` returns a node's whole summary
    when its last part arrives."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[int, str]] = {}

    def add(self, line: str) -> tuple[str, dict[str, Any]] | None:
        try:
            name, seq, part = line[len(MARKER) :].split(" ", 2)
            i, n = (int(x) for x in seq.split("/"))
        except ValueError:
            return None
        have = self.parts.setdefault(name, {})
        have[i] = part
        if len(have) < n:
            return None
        try:
            data = json.loads("".join(have[k] for k in range(1, n + 1)))
        except (KeyError, ValueError):
            return None
        return (name, data) if isinstance(data, dict) else None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write("usage: python -m cudampi.doctor.node OPTIONS_JSON [NAME...]\n")
        return 2
    name = my_name(args[1:])
    hello = {"name": name, "hostname": socket.gethostname()}
    print(HELLO + json.dumps(hello), flush=True)
    emit(name, {"name": name, **run(args[0], args[1:])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
