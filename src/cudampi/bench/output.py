"""Where a benchmark's rendered report goes: rank 0 writes the table, JSON or CSV to stdout or
the files the flags name (the rendering itself is :mod:`cudampi.bench.render`'s)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cudampi.bench.options import Options
from cudampi.errors import BenchError


def _write(flag: str, path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise BenchError(f"{flag} {path!r} cannot be written: {exc.strerror or exc}") from None


def emit(session: Any, o: Options, text: str, json_text: str, csv_text: str | None) -> None:
    """Rank 0 writes the table / JSON / CSV where the flags say."""
    if session.rank != 0:
        return
    if o.json and o.json != "-":
        _write("--json", o.json, json_text)
    if o.csv and o.csv != "-" and csv_text is not None:
        _write("--csv", o.csv, csv_text)
    if o.json == "-":
        sys.stdout.write(json_text)
    elif o.csv == "-" and csv_text is not None:
        sys.stdout.write(csv_text)
    else:
        sys.stdout.write(text)
    sys.stdout.flush()
