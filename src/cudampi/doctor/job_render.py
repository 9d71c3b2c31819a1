"""The job doctor's report (pure): its findings, said once each, from a
:class:`~cudampi.doctor.job.JobResult`; the text (the nodes x facts table with the differing
cells marked, the link matrices, the GPU links, the findings; above :data:`FULL_UP_TO` nodes a
summary of the odd nodes and the worst links) and the JSON.
"""

from __future__ import annotations

import json
import shutil
import statistics
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cudampi import __version__
from cudampi.doctor.jobfacts import Difference, difference_findings, differences, table
from cudampi.doctor.links import Finding, Link, fmt_gbps, fmt_us, link_findings

if TYPE_CHECKING:
    from cudampi.doctor.job import JobResult

FULL_UP_TO = 8
"""Up to this many nodes the text shows every node's column and the whole link matrix."""
WORST = 5
"""Links listed in the summary of a larger job."""
LABEL = 22


def unanswered_findings(result: JobResult) -> list[Finding]:
    """A node that gave no facts, or went down during the link test: why, and the fix."""
    out = []
    gone = {n: w for n, w in result.down.items() if n not in result.unanswered}
    for node, why in {**result.unanswered, **gone}.items():
        if "ssh failed" in why:
            fix = (
                f"check that {node} is up and on the network (ssh {node} true; its name, "
                "routes and sshd), or leave it out of the job"
            )
        elif "ssh ok" in why:
            fix = (
                f"ssh reaches {node} but the job's ranks did not start or answer there: read "
                f"the launcher's message; run `cudampi doctor` on {node} itself"
            )
        else:
            fix = f"check {node} in the batch system (sinfo -n {node}, scontrol show node)"
        after = (
            "its links after that were not measured"
            if node in gone
            else "it was left out of the rest of this report"
        )
        out.append(
            Finding(node, f"{node} {why}", f"no job can include {node}: {after}", fix, "fail")
        )
    return out


def check_findings(result: JobResult, diffs: Sequence[Difference]) -> list[Finding]:
    """The single-node checks that failed, once each: on which nodes, and its fix (a check
    already said as a difference between the nodes is not said again)."""
    said = {d.fact for d in diffs}
    failing: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for node, facts in result.facts.items():
        for c in facts.get("checks", ()):
            if c.get("status") == "fail" and c.get("name") not in said:
                failing.setdefault(str(c["name"]), []).append((node, c))
    out = []
    for name, where in failing.items():
        nodes = [n for n, _ in where]
        every = len(nodes) == len(result.facts) and len(nodes) > 1
        subject = "every node" if every else ", ".join(nodes)
        first = where[0][1]
        out.append(
            Finding(
                subject,
                f"{name} fails on {subject}: {first.get('detail', '')}",
                "the single-node doctor's check fails there (cudampi doctor on the node shows "
                "the same)",
                str(first.get("fix") or "see the check's detail"),
                "fail",
            )
        )
    return out


def job_findings(result: JobResult) -> tuple[list[Difference], list[Finding]]:
    """The differences between the nodes and every finding, in the order the report says them:
    nodes that did not answer, differences, failed checks, links."""
    diffs = differences(result.facts) if len(result.facts) > 1 else []
    findings = unanswered_findings(result)
    findings += difference_findings(diffs)
    findings += check_findings(result, diffs)
    alive = [n for n in result.nodes if n in result.facts]
    findings += link_findings(result.links, alive, said=set(result.down))
    return diffs, findings


def exit_code(findings: Sequence[Finding]) -> int:
    return 1 if any(f.severity == "fail" for f in findings) else 0


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]


def _cell(text: str, width: int) -> str:
    """``text`` in ``width`` characters: a path keeps its end, anything else its start."""
    if len(text) <= width:
        return text
    if "/" in text:
        return "~" + text[len(text) - width + 1 :]
    return text[: width - 1] + "~"


def render_job_text(result: JobResult, width: int | None = None) -> str:
    width = width or max(80, min(160, shutil.get_terminal_size((120, 24)).columns))
    diffs, findings = job_findings(result)
    lines = [_head(result), ""]
    if result.facts:
        full = len(result.nodes) <= FULL_UP_TO
        lines += _facts_table(result, diffs, width) if full else _facts_summary(result, diffs)
        lines.append("")
    if result.links:
        lines += _links(result, width)
        lines.append("")
    gpu = _gpu_links(result)
    if gpu:
        lines += [*gpu, ""]
    lines += _findings(findings, width)
    fails = sum(1 for f in findings if f.severity == "fail")
    warns = len(findings) - fails
    code = exit_code(findings)
    measured = sum(1 for lk in result.links if lk.status == "ok")
    links = (
        f"{measured} of {len(result.links)} links in {len(result.rounds)} rounds"
        if result.links_run
        else "links not tested (--no-links)"
    )
    if result.links_run and len(result.facts) < 2:
        links = "no links (one node)"
    lines.append("-" * min(width, 100))
    lines.append(
        f"job doctor {'FAILED' if code else 'passed'}: {len(result.facts)} of "
        f"{len(result.nodes)} nodes, {links} ({result.jobs} job{'s' if result.jobs != 1 else ''}, {result.wall_s:.1f} s): "
        f"{fails} fail, {warns} warn -> exit {code}"
    )
    return "\n".join(lines) + "\n"


def _head(result: JobResult) -> str:
    la = result.launcher
    how = f"{la.get('name') or la.get('flavour')} {la.get('version', '')}".strip()
    return (
        f"cudampi doctor {__version__}: a job of {len(result.nodes)} node(s) through "
        f"cudampi launch ({how}, one rank per node)"
    )


def _facts_table(result: JobResult, diffs: Sequence[Difference], width: int) -> list[str]:
    """Every fact a row: one value across the row where every node has it, else a cell per
    node (``*`` on the odd ones); settings only where they differ."""
    nodes = [n for n in result.nodes if n in result.facts]
    rows, cells = table({n: result.facts[n] for n in nodes})
    odd = {d.fact: set(d.odd) for d in diffs}
    same_env = [r[4:] for r in rows if r.startswith("env ") and r not in odd]
    label = max(
        LABEL, min(34, 2 + max(len(r) for r in rows if not r.startswith("env ") or r in odd))
    )
    cw = max(8, min(24, (width - label) // max(1, len(nodes))))
    out = ["[nodes] the facts of each node; * differs from the other nodes (see the findings)"]
    out.append((" " * label + "".join(_cell(n, cw - 1).ljust(cw) for n in nodes)).rstrip())
    for r in rows:
        if r.startswith("env ") and r not in odd:
            continue
        row = _cell(r, label - 1).ljust(label)
        values = {cells[n].get(r, "-") for n in nodes}
        if r not in odd and len(values) == 1:
            every = "" if len(nodes) == 1 else " (every node)"
            out.append(row + _cell(values.pop(), width - label - len(every)) + every)
            continue
        for n in nodes:
            mark = "*" if n in odd.get(r, ()) else ""
            row += (_cell(cells[n].get(r, "-"), cw - 1 - len(mark)) + mark).ljust(cw)
        out.append(row.rstrip())
    if same_env:
        out.append(_cell(f"set the same on every node: {', '.join(same_env)}", width))
    for node in result.unanswered:
        out.append(f"{node}: no facts (see the findings)")
    return out


def _facts_summary(result: JobResult, diffs: Sequence[Difference]) -> list[str]:
    nodes = [n for n in result.nodes if n in result.facts]
    rows, cells = table({n: result.facts[n] for n in nodes})
    out = [f"[nodes] {len(nodes)} nodes answered; the facts that differ:"]
    for d in diffs:
        groups: dict[str, list[str]] = {}
        for n, v in d.values.items():
            groups.setdefault(v, []).append(n)
        said = "; ".join(
            f"{v} on {len(ns)} nodes" if len(ns) > 3 else f"{v} on {', '.join(ns)}"
            for v, ns in sorted(groups.items(), key=lambda kv: -len(kv[1]))
        )
        out.append(f"  {d.fact}: {said}")
    same = [r for r in rows if r not in {d.fact for d in diffs} and not r.startswith("env ")]
    first = cells[nodes[0]] if nodes else {}
    out.append("  the same on every node: " + "; ".join(f"{r} {first.get(r, '-')}" for r in same))
    return out


def _matrix(
    nodes: Sequence[str], links: Mapping[tuple[str, str], Link], value: Any, width: int
) -> list[str]:
    cw = max(7, min(12, (width - 12) // max(1, len(nodes))))
    lw = max(6, min(12, max(len(n) for n in nodes) + 1))
    out = [" " * lw + "".join(_cell(n, cw - 1).rjust(cw) for n in nodes)]
    for a in nodes:
        row = _cell(a, lw - 1).ljust(lw)
        for b in nodes:
            lk = links.get((a, b)) or links.get((b, a))
            row += (_cell(value(lk), cw - 1) if a != b else ".").rjust(cw)
        out.append(row)
    return out


def _links(result: JobResult, width: int) -> list[str]:
    nodes = [n for n in result.nodes if n in result.facts]
    by = {(lk.a, lk.b): lk for lk in result.links}
    bad = {f.subject for f in link_findings(result.links, nodes, said=set(result.down))}

    def mark(lk: Link) -> str:
        return "*" if lk.name in bad or lk.a in bad or lk.b in bad else ""

    def bw(lk: Link | None) -> str:
        if lk is None:
            return "-"
        if lk.status != "ok":
            return "FAIL" if lk.status == "failed" else "skip"
        return f"{lk.gbps:.3g}{mark(lk)}" if lk.gbps is not None else "?"

    def lat(lk: Link | None) -> str:
        if lk is None or lk.status != "ok":
            return bw(lk)
        return f"{lk.latency_us:.3g}" if lk.latency_us is not None else "?"

    size = next((lk for lk in result.links if lk.status == "ok"), None)
    ok = [lk for lk in result.links if lk.status == "ok" and lk.gbps]
    med = statistics.median([lk.gbps or 0.0 for lk in ok]) if ok else None
    head = (
        f"[links] host point-to-point between the nodes ({len(result.rounds)} rounds, each node "
        f"in one pair at a time); median {fmt_gbps(med)}"
    )
    out = [head]
    if len(nodes) <= FULL_UP_TO:
        out.append("bandwidth, GB/s (the slower direction; * named in the findings):")
        out += _matrix(nodes, by, bw, width)
        out.append("latency, us (one way, 8 bytes, the best of a ping-pong):")
        out += _matrix(nodes, by, lat, width)
    else:
        worst = sorted(ok, key=lambda lk: lk.gbps or 0.0)[:WORST]
        out.append(
            "the slowest links: " + "; ".join(f"{lk.name} {fmt_gbps(lk.gbps)}" for lk in worst)
        )
        failed = [lk.name for lk in result.links if lk.status == "failed"]
        if failed:
            out.append(f"failed: {', '.join(failed)}")
    dev = [lk for lk in result.links if lk.device]
    if dev:
        out.append("device buffers (where both nodes proved device p2p):")
        for lk in dev:
            d = lk.device or {}
            gb = [g for g in (d.get("gbps_ab"), d.get("gbps_ba")) if isinstance(g, (int, float))]
            out.append(
                f"  {lk.name}: {fmt_gbps(min(gb) if gb else None)}, {fmt_us(d.get('latency_us'))}"
            )
    if size is not None:
        out.append(f"(messages of {_bytes(result.link_bytes)}; each direction the best of repeats)")
    return out


def _bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def _gpu_links(result: JobResult) -> list[str]:
    lines = []
    for node in result.nodes:
        g = (result.facts.get(node) or {}).get("gpu_links")
        if not g or not g.get("gpus"):
            continue
        ipc = g.get("ipc") or {}
        parts = []
        if ipc.get("status") == "ok":
            mps = " (MPS)" if ipc.get("mps") else ""
            parts.append(
                f"ipc engine {fmt_gbps(ipc.get('gbps'))}, {fmt_us(ipc.get('latency_us'))}{mps}"
            )
        else:
            parts.append(f"ipc engine {ipc.get('status')}: {ipc.get('detail', '')}")
        peer = g.get("copy_peer") or {}
        if peer.get("status") == "ok":
            rates = peer.get("gbps") or {}
            parts.append(
                "copy peer " + ", ".join(f"{k} {fmt_gbps(v)}" for k, v in sorted(rates.items()))
            )
        else:
            parts.append(f"copy peer {peer.get('status')}: {peer.get('detail', '')}")
        lines.append(f"  {node} ({g['gpus']} GPU): " + "; ".join(parts))
    return ["[GPU links] inside each node", *lines] if lines else []


def _findings(findings: Sequence[Finding], width: int) -> list[str]:
    if not findings:
        return ["[findings] none: the nodes agree and no link stands out"]
    out = ["[findings]"]
    body = max(40, width - 6)
    for f in findings:
        mark = "FAIL" if f.severity == "fail" else "WARN"
        text = _wrap(f.what, body)
        out.append(f"{mark}  {text[0]}")
        out += [f"      {ln}" for ln in text[1:]]
        out += [f"      {ln}" for ln in _wrap("means: " + f.consequence, body)]
        out += [f"      {ln}" for ln in _wrap("fix: " + f.fix, body)]
    return out


def job_json(result: JobResult) -> dict[str, Any]:
    diffs, findings = job_findings(result)
    names, cells = table({n: result.facts[n] for n in result.nodes if n in result.facts})
    return {
        "cudampi": __version__,
        "exit_code": exit_code(findings),
        "nodes": list(result.nodes),
        "launcher": result.launcher,
        "unanswered": dict(result.unanswered),
        "down": dict(result.down),
        "table": {"rows": names, "cells": cells},
        "differences": [d.to_json() for d in diffs],
        "facts": result.facts,
        "rounds": [[list(p) for p in r] for r in result.rounds],
        "links": [lk.to_json() for lk in result.links],
        "links_run": result.links_run,
        "findings": [f.to_json() for f in findings],
        "summary": {
            "fail": sum(1 for f in findings if f.severity == "fail"),
            "warn": sum(1 for f in findings if f.severity != "fail"),
        },
        "jobs": result.jobs,
        "wall_s": round(result.wall_s, 2),
    }


def render_job_json(result: JobResult) -> str:
    return json.dumps(job_json(result), indent=2) + "\n"
