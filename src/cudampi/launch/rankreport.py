"""A rank's failure report: tagged stderr lines the supervisor can parse from any host.

Files on other hosts are not visible to the supervisor, but every launcher forwards stderr, so a
failing rank writes a few lines like::

    [cudampi-fault 3f9a0c2e7b1d4e65 host=node2 rank=3 code=1] ValueError: loss is nan

(one per line of the report; the first names the failure), and every rank says when it started,
when its script finished well, and when Python's exit handlers have run after that::

    [cudampi-fault 3f9a0c2e7b1d4e65 host=node2 rank=3 started]
    [cudampi-fault 3f9a0c2e7b1d4e65 host=node2 rank=3 finished]
    [cudampi-fault 3f9a0c2e7b1d4e65 host=node2 rank=3 exiting]

The second word is the job's token: a random secret the supervisor makes for each job and hands
the ranks in ``CUDAMPI_REPORT_TOKEN`` (the bootstrap removes it from the environment before the
user's code runs). The supervisor takes only lines with its own token, so nothing a program
prints (a log of an earlier job, a test of this module) can end a healthy job or blame a rank.
It collects them with :func:`parse_reports` / :func:`parse_started` and builds the summary from
them plus what the launcher said.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cudampi.config import REPORT_TOKEN

TAG = "cudampi-fault"
TOKEN_ENV = REPORT_TOKEN
"""The variable that hands a job's report token to its ranks."""
NO_TOKEN = "-"
"""The token of a rank started without one (the bootstrap run by hand): no supervisor reads it."""
_LINE = re.compile(
    rf"\[{TAG} (\S+) host=(\S+) rank=(-?\d+) (?:code=(-?\d+)\] ?(.*)|(started|finished|exiting)\])$"
)
MAX_LINES = 12


@dataclass(frozen=True)
class RankReport:
    host: str
    rank: int
    code: int
    lines: tuple[str, ...]


def new_token() -> str:
    """A fresh report token for one job."""
    import secrets

    return secrets.token_hex(8)


def format_report(host: str, rank: int, code: int, lines: Iterable[str], token: str) -> str:
    """The tagged text of one report (ends with a newline)."""
    body = [ln.rstrip() for ln in lines if ln.strip()][:MAX_LINES] or ["(no message)"]
    return "".join(f"[{TAG} {token} host={host} rank={rank} code={code}] {ln}\n" for ln in body)


def format_started(host: str, rank: int, token: str, what: str = "started") -> str:
    """The line a rank writes when it starts (``what="finished"``: when its script has run to
    the end with exit status 0; ``"exiting"``: when Python's exit handlers have run after
    that); ends with a newline."""
    return f"[{TAG} {token} host={host} rank={rank} {what}]\n"


def report_prefix(token: str) -> str:
    """What every tagged line of the job with ``token`` contains."""
    return f"[{TAG} {token} "


def is_report_line(line: str, token: str) -> bool:
    return token != NO_TOKEN and report_prefix(token) in line


def _matches(lines: Iterable[str], token: str) -> Iterable[re.Match[str]]:
    for line in lines:
        m = _LINE.search(line.rstrip("\n"))
        if m and token != NO_TOKEN and m.group(1) == token:
            yield m


def parse_reports(lines: Iterable[str], token: str) -> list[RankReport]:
    """Every report of the job with ``token`` in ``lines`` (in first-seen order), one per
    (host, rank); lines with another token (or none) are ordinary output."""
    found: dict[tuple[str, int], tuple[int, list[str]]] = {}
    for m in _matches(lines, token):
        if m.group(4) is None:
            continue  # a "started", "finished" or "exiting" line
        host, rank, code, text = m.group(2), int(m.group(3)), int(m.group(4)), m.group(5)
        entry = found.setdefault((host, rank), (code, []))
        entry[1].append(text)
    return [RankReport(h, r, c, tuple(ls)) for (h, r), (c, ls) in found.items()]


def parse_started(lines: Iterable[str], token: str, what: str = "started") -> set[int]:
    """The ranks of the job with ``token`` that said they started (or ``what="finished"``,
    ``"exiting"``)."""
    return set(parse_marks(lines, token, what))


def parse_marks(lines: Iterable[str], token: str, what: str = "started") -> dict[int, str]:
    """rank -> host, of the ranks of the job with ``token`` that said ``what``."""
    return {int(m.group(3)): m.group(2) for m in _matches(lines, token) if m.group(6) == what}


SUMMARY_LINES = 8
"""Report lines the launch summary prints per rank (the exception, then the frames)."""

_FILE = re.compile(r'^\s*File "([^"]+)"')


def library_dirs() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, site-packages and cudampi."""
    import sysconfig

    import cudampi

    paths = sysconfig.get_paths()
    dirs = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.add(os.path.dirname(os.path.abspath(cudampi.__file__)))
    return tuple(sorted(d for d in dirs if d))


def is_user_file(path: str, libs: Iterable[str] | None = None) -> bool:
    """Is ``path`` the user's own code (not Python's, an installed package's or cudampi's)?"""
    if path.startswith("<") or "site-packages" in path or "dist-packages" in path:
        return False
    full = os.path.abspath(path)
    return not any(full == d or full.startswith(d + os.sep) for d in (libs or library_dirs()))


def summarize_exception(
    tb_lines: list[str], max_lines: int = SUMMARY_LINES, libs: Iterable[str] | None = None
) -> list[str]:
    """The first lines a person reads of a formatted traceback: the exception line(s), then
    frames, innermost first, cut to ``max_lines``. The user's own frames come before library
    frames when not all fit: the innermost of the user's, then where it raised, then the rest
    of the user's, then other library frames (a failure deep in torch keeps the user's line)."""
    lines = [ln.rstrip("\n") for chunk in tb_lines for ln in chunk.splitlines()]
    if not lines:
        return []
    starts = [i for i, ln in enumerate(lines) if ln.startswith("  File ")]
    if not starts:
        return [ln for ln in lines if ln.strip()][-max_lines:]
    # The exception line(s) follow the last frame and its (optional, indented) source lines.
    end = starts[-1] + 1
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    head = ([ln for ln in lines[end:] if ln.strip()] or lines[-1:])[: max(1, max_lines // 4)]
    frames: list[list[str]] = []
    for i, s in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else end
        body = [ln for ln in lines[s:stop] if ln.strip() and set(ln.strip()) - set("^~ ")]
        frames.append(body[:2])
    libs = tuple(libs) if libs is not None else library_dirs()

    def user(i: int) -> bool:
        m = _FILE.match(frames[i][0])
        return m is not None and is_user_file(m.group(1), libs)

    inner_first = list(range(len(frames) - 1, -1, -1))
    users = [i for i in inner_first if user(i)]
    others = [i for i in inner_first if not user(i)]
    priority = [*users[:1], inner_first[0], *users[1:], *others]
    picked: list[int] = []
    room = max_lines - len(head)
    for i in dict.fromkeys(priority):
        if len(frames[i]) <= room:
            picked.append(i)
            room -= len(frames[i])
    out = list(head)
    for i in sorted(picked, reverse=True):
        out += frames[i]
    return out
