"""A rank's failure report: tagged stderr lines the supervisor can parse from any host.

Files on other hosts are not visible to the supervisor, but every launcher forwards stderr, so a
failing rank writes a few lines like::

    [cudampi-fault host=node2 rank=3 code=1] ValueError: loss is nan

(one per line of the report; the first names the failure). The supervisor collects them with
:func:`parse_reports` and builds the summary from them plus what the launcher said.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

TAG = "cudampi-fault"
_LINE = re.compile(rf"\[{TAG} host=(\S+) rank=(-?\d+) code=(-?\d+)\] ?(.*)$")
MAX_LINES = 12


@dataclass(frozen=True)
class RankReport:
    host: str
    rank: int
    code: int
    lines: tuple[str, ...]


def format_report(host: str, rank: int, code: int, lines: Iterable[str]) -> str:
    """The tagged text of one report (ends with a newline)."""
    body = [ln.rstrip() for ln in lines if ln.strip()][:MAX_LINES] or ["(no message)"]
    return "".join(f"[{TAG} host={host} rank={rank} code={code}] {ln}\n" for ln in body)


def is_report_line(line: str) -> bool:
    return f"[{TAG} " in line


def parse_reports(lines: Iterable[str]) -> list[RankReport]:
    """Every report in ``lines`` (in first-seen order), one per (host, rank)."""
    found: dict[tuple[str, int], tuple[int, list[str]]] = {}
    for line in lines:
        m = _LINE.search(line.rstrip("\n"))
        if not m:
            continue
        host, rank, code, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        entry = found.setdefault((host, rank), (code, []))
        entry[1].append(text)
    return [RankReport(h, r, c, tuple(ls)) for (h, r), (c, ls) in found.items()]


def summarize_exception(tb_lines: list[str], max_lines: int = MAX_LINES) -> list[str]:
    """The most useful first lines of a formatted traceback: the exception line first, then the
    innermost frames (what a person reads first), cut to ``max_lines``."""
    lines = [ln.rstrip("\n") for chunk in tb_lines for ln in chunk.splitlines()]
    if not lines:
        return []
    # The exception line(s) come after the last frame's source line.
    last_frame = max((i for i, ln in enumerate(lines) if ln.startswith("  File ")), default=-1)
    tail = lines[last_frame + 2 :] if last_frame >= 0 else lines[-1:]
    frames = lines[1 : last_frame + 2] if last_frame >= 0 else []
    head = [ln for ln in tail if ln.strip()] or lines[-1:]
    room = max(0, max_lines - len(head))
    return head[:max_lines] + (frames[-room:] if room else [])
