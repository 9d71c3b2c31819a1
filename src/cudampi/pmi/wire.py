"""The PMI-1 wire format both ends speak: text lines of ``key=value`` pairs, ``cmd=`` first
(MPICH ``src/pmi``, ``doc/wiki/design/PMI_v1_Wire_Protocol``), and the bounds on them."""

from __future__ import annotations

import socket
from typing import Any

MAX_LINE = 4096
"""The longest request line served (MPICH's longest, a put of the largest value, is ~1.4 KB)."""
MAX_FIRST_LINE = 256
"""The longest first line of a connection (the authentication)."""


def parse_command(line: str) -> dict[str, str]:
    """``"cmd=put kvsname=k key=a value=b"`` -> ``{"cmd": "put", "kvsname": "k", ...}``.

    Values never hold spaces in PMI-1 (MPICH escapes them), so a split on blanks is exact.
    """
    out: dict[str, str] = {}
    for token in line.strip().split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def format_reply(cmd: str, **fields: object) -> str:
    return " ".join([f"cmd={cmd}", *(f"{k}={v}" for k, v in fields.items())]) + "\n"


def recv_line(conn: socket.socket, limit: int) -> str:
    """One line from ``conn`` read a byte at a time (nothing after it is taken from the socket:
    it may be handed on, as the rank's PMI_FD); ``ValueError`` past ``limit`` bytes."""
    got = bytearray()
    while not got.endswith(b"\n"):
        if len(got) >= limit:
            raise ValueError(f"its first line is longer than {limit} bytes")
        byte = conn.recv(1)
        if not byte:
            raise ValueError("it closed before a full line")
        got += byte
    return got.decode("ascii", errors="replace")


def read_line(reader: Any) -> str:
    """One protocol line, or "" once the peer is gone."""
    try:
        return str(reader.readline(MAX_LINE))
    except (OSError, ValueError):
        return ""
