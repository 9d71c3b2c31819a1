"""``cudampi trace``: run a job like ``cudampi launch`` and write one Chrome-trace timeline of
every rank's communication calls (chrome://tracing, https://ui.perfetto.dev), as Horovod's
timeline does.

    cudampi trace [--timeline FILE] [launch flags] (script.py | -m module | program) [args...]
    cudampi trace --merge DIR [--timeline FILE]

Every rank records its calls (``CUDAMPI_TRACE=DIR``, see :mod:`cudampi.observe`) into its own
file; the files are merged when the job ends. Across hosts DIR must be on a shared filesystem
(``--trace-dir``), and the hosts' clocks set the events' alignment.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from cudampi.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from cudampi.launch.cli import add_arguments as launch_arguments

    launch_arguments(parser)
    parser.usage = (
        "cudampi trace [--timeline FILE] [--trace-dir DIR] [launch flags] "
        "(script.py | -m module | program) [args...]   |   cudampi trace --merge DIR"
    )
    parser.add_argument(
        "--timeline",
        default="cudampi-timeline.json",
        metavar="FILE",
        help="the merged Chrome trace (default ./cudampi-timeline.json)",
    )
    parser.add_argument(
        "--trace-dir",
        default=None,
        metavar="DIR",
        help="where the ranks write their files (default: a temporary folder on this host; "
        "give a shared one across hosts)",
    )
    parser.add_argument(
        "--merge", default=None, metavar="DIR", help="only merge the rank files already in DIR"
    )


def write_timeline(folder: str | Path, out: str | Path) -> tuple[int, int]:
    """Merge ``folder``'s rank files into ``out``; (events, ranks)."""
    from cudampi.observe import merge_traces

    doc = merge_traces(folder)
    try:
        Path(out).write_text(json.dumps(doc))
    except OSError as exc:
        raise ConfigError(f"--timeline {str(out)!r}: {exc.strerror}") from None
    events = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
    return events, int(doc["otherData"]["ranks"])


def run(args: argparse.Namespace) -> int:
    if args.merge:
        events, ranks = write_timeline(args.merge, args.timeline)
        print(f"cudampi trace: {args.timeline}: {events} calls from {ranks} rank(s)")
        return 0 if ranks else 1
    from cudampi.launch import cli as launch

    folder = args.trace_dir or tempfile.mkdtemp(prefix="cudampi-trace-")
    Path(folder).mkdir(parents=True, exist_ok=True)
    args.export = [*args.export, f"CUDAMPI_TRACE={Path(folder).resolve()}"]
    try:
        code = launch.run(args)
        events, ranks = write_timeline(folder, args.timeline)
        print(
            f"cudampi trace: {args.timeline}: {events} calls from {ranks} rank(s) "
            "(open in chrome://tracing or https://ui.perfetto.dev)",
            file=sys.stderr,
        )
        return code
    finally:
        if args.trace_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
