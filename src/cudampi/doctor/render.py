"""The doctor's two renderings: a text table (check · status · detail, then the fix) and JSON."""

from __future__ import annotations

import dataclasses
import json
import shutil
import textwrap
from typing import Any

from cudampi._version import __version__
from cudampi.doctor.report import Check, Report

_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "n/a": "n/a"}


def _wrap(text: str, width: int) -> list[str]:
    # Paths and commands stay whole so that they can be copied from the terminal.
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


def shown_checks(report: Report) -> list[Check]:
    """The rows of the text report: on a machine without a GPU the GPU-only checks fold into
    one line (they are all n/a there; --json keeps each of them)."""
    if not report.data.get("no_gpu"):
        return list(report.checks)
    from cudampi.doctor.checks import NO_GPU_LINE, NO_GPU_QUIET

    out: list[Check] = []
    for c in report.checks:
        if c.name in NO_GPU_QUIET and c.status == "n/a":
            if NO_GPU_LINE not in out:
                out.append(NO_GPU_LINE)
            continue
        out.append(c)
    return out


def render_text(report: Report, width: int | None = None) -> str:
    """A table grouped by section; every non-ok row is followed by its fix."""
    width = width or max(80, min(160, shutil.get_terminal_size((120, 24)).columns))
    checks = shown_checks(report)
    name_w = max([len(c.name) for c in checks] + [5])
    lead = name_w + 2 + 6 + 2
    body_w = max(30, width - lead)
    lines: list[str] = [f"cudampi doctor {__version__}", ""]
    lines.append(f"{'check'.ljust(name_w)}  {'status'.ljust(6)}  detail")
    lines.append("-" * min(width, lead + body_w))
    section = None
    for c in checks:
        if c.section != section:
            section = c.section
            lines.append(f"[{section}]")
        wrapped = _wrap(c.detail, body_w) or [""]
        lines.append(f"{c.name.ljust(name_w)}  {_MARK[c.status].ljust(6)}  {wrapped[0]}")
        lines += [" " * lead + w for w in wrapped[1:]]
        if c.fix and c.status in ("warn", "fail"):
            fix = _wrap("fix: " + c.fix, body_w)
            lines += [" " * lead + w for w in fix]
    n = report.counts
    lines.append("-" * min(width, lead + body_w))
    verdict = "FAILED" if report.failed else "passed"
    lines.append(
        f"doctor {verdict}: {n['ok']} ok, {n['warn']} warn, {n['fail']} fail, {n['n/a']} n/a "
        f"-> exit {report.exit_code}"
    )
    return "\n".join(lines) + "\n"


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "cudampi doctor --json",
    "type": "object",
    "required": ["cudampi", "exit_code", "summary", "checks", "data"],
    "properties": {
        "cudampi": {"type": "string"},
        "exit_code": {"enum": [0, 1]},
        "summary": {
            "type": "object",
            "required": ["ok", "warn", "fail", "n/a"],
            "additionalProperties": {"type": "integer", "minimum": 0},
        },
        "checks": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "section", "status", "detail", "fix"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "section": {"type": "string"},
                    "status": {"enum": ["ok", "warn", "fail", "n/a"]},
                    "detail": {"type": "string"},
                    "fix": {"type": "string"},
                },
            },
        },
        "data": {"type": "object"},
    },
}
"""The JSON Schema of :func:`report_json` (``data`` holds the probed facts, free-form)."""


def report_json(report: Report) -> dict[str, Any]:
    """The JSON document: checks, counts, exit code, and the probed data behind them."""
    return {
        "cudampi": __version__,
        "exit_code": report.exit_code,
        "summary": report.counts,
        "checks": [c.to_json() for c in report.checks],
        "data": _jsonable(report.data),
    }


def render_json(report: Report) -> str:
    return json.dumps(report_json(report), indent=2, sort_keys=False) + "\n"
