"""Where a benchmark's rendered report goes: rank 0 writes the table, JSON or CSV to stdout or
the files the flags name (the rendering itself is :mod:`cudampi.bench.render`'s)."""

from __future__ import annotations

from typing import Any

from cudampi.atomic import why, write_stdout, write_text
from cudampi.bench.options import Options
from cudampi.errors import BenchError


def _write(flag: str, path: str, text: str) -> str:
    """Write ``text`` to ``path`` whole or not at all; why it could not be, or ``""``."""
    try:
        write_text(path, text)
    except OSError as exc:
        return f"{flag} {path!r} cannot be written: {why(exc)}"
    return ""


def emit(session: Any, o: Options, text: str, json_text: str, csv_text: str | None) -> None:
    """Rank 0 writes the table / JSON / CSV where the flags say. A file that cannot be written
    does not keep the results from standard output: they are printed, then BenchError says
    which file failed."""
    if session.rank != 0:
        return
    failed = []
    if o.json and o.json != "-":
        failed.append(_write("--json", o.json, json_text))
    if o.csv and o.csv != "-" and csv_text is not None:
        failed.append(_write("--csv", o.csv, csv_text))
    if o.json == "-":
        problem = write_stdout(json_text)
    elif o.csv == "-" and csv_text is not None:
        problem = write_stdout(csv_text)
    else:
        problem = write_stdout(text)
    if problem:
        failed.append(f"the results could not be written to standard output: {problem}")
    if any(failed):
        raise BenchError("; ".join(f for f in failed if f))
