"""The hosts of a launch: ``--hosts h1:4,h2:4``, hostfiles in Open MPI's and MPICH's forms, a
batch job's one-line-per-slot host files, and whether a launch spans hosts (pure, but for
:func:`read_hostfile`, which reads a file as a hostfile may safely be read)."""

from __future__ import annotations

import os
import re
import select
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cudampi.errors import ConfigError

_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:%]+$")
_COUNT = re.compile(r"[0-9]+")

MAX_SLOTS = 2**31 - 1
"""The most slots (and ranks) a launcher counts: Open MPI's are 32-bit integers (prterun takes
``--host h:2147483648`` for a full host: "All nodes ... are already filled")."""

HOSTFILE_LIMIT = 1 << 20
"""The most bytes a hostfile may have (a million lines of hosts is no hostfile: /dev/zero is)."""

HOSTFILE_WAIT = 5.0
"""Seconds a hostfile that is a pipe (``--hostfile <(...)``, a FIFO) is waited for."""


@dataclass(frozen=True)
class Host:
    """A host and how many ranks it may run (None: the launcher decides)."""

    name: str
    slots: int | None = None


def parse_hosts(text: str) -> tuple[Host, ...]:
    """Parse ``--hosts h1:4,h2:4`` (slots optional: ``h1,h2``)."""
    hosts: list[Host] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, slots = item.rpartition(":")
        if not sep or not _COUNT.fullmatch(slots):
            name, slots = item, ""
        hosts.append(_host(name, int(slots) if slots else None, where=f"--hosts {text!r}"))
    if not hosts:
        raise ConfigError(f"--hosts {text!r} names no host; write it like h1:4,h2:4")
    return tuple(hosts)


def parse_hostfile(text: str) -> tuple[Host, ...]:
    """Parse a hostfile in Open MPI (``host slots=4``), MPICH (``host:4``) or plain (``host``)
    form; ``#`` starts a comment. A host listed twice adds its slots (a line without slots
    counts one), as both MPIs do."""
    order: list[str] = []
    slots: dict[str, int | None] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        name, count = words[0], None
        if ":" in name and _COUNT.fullmatch(name.rsplit(":", 1)[1]):
            name, n = name.rsplit(":", 1)
            count = int(n)
        for w in words[1:]:
            key, _, value = w.partition("=")
            if key in ("slots", "max_slots", "max-slots") and _COUNT.fullmatch(value):
                if key == "slots":
                    count = int(value)
            else:
                raise ConfigError(
                    f"hostfile line {lineno} {raw.strip()!r}: cannot read {w!r}; write "
                    f"'host slots=N' (Open MPI) or 'host:N' (MPICH)"
                )
        _host(name, count, where=f"hostfile line {lineno}")
        if name not in slots:
            order.append(name)
            slots[name] = count
        else:
            slots[name] = (slots[name] or 1) + (count or 1)
    if not order:
        raise ConfigError("the hostfile names no host")
    return tuple(Host(n, slots[n]) for n in order)


def _host(name: str, slots: int | None, *, where: str) -> Host:
    if not name or not _HOST_RE.match(name):
        raise ConfigError(f"{where}: {name!r} is not a host name")
    if slots is not None and slots < 1:
        raise ConfigError(f"{where}: host {name!r} has {slots} slots; give at least 1")
    if slots is not None and slots > MAX_SLOTS:
        raise ConfigError(
            f"{where}: host {name!r} has {slots} slots, more than a launcher can count "
            f"({MAX_SLOTS}); give the number of ranks the host should run"
        )
    return Host(name, slots)


def parse_slot_lines(text: str) -> tuple[Host, ...]:
    """A batch job's host file, one host per line and once per slot (PBS_NODEFILE,
    LSB_DJOB_HOSTFILE) -> each host, in order of first appearance, with its slots."""
    slots: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        name = raw.strip()
        if name:
            _host(name, None, where=f"line {lineno}")
            slots[name] = slots.get(name, 0) + 1
    if not slots:
        raise ConfigError("the job's host file names no host")
    return tuple(Host(n, c) for n, c in slots.items())


def read_hostfile(path: str, what: str = "--hostfile") -> str:
    """The text of a hostfile, read as no launcher hangs on it: a named pipe or ``<(...)`` is
    waited for :data:`HOSTFILE_WAIT` s at most, a device or a file of more than
    :data:`HOSTFILE_LIMIT` bytes is refused, and so is a file that is not text."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{what} {path!r}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{what} {path!r} is a folder; give a file of host names")
        data = _read_bounded(fd, path, what, pipe=stat.S_ISFIFO(mode))
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path!r} is not a text file (byte {data[exc.start : exc.start + 1]!r} at "
            f"offset {exc.start}); give a file of host names, one per line"
        ) from None
    if "\0" in text:
        raise ConfigError(
            f"{what} {path!r} is not a text file (a NUL byte at offset {text.index(chr(0))}); "
            "give a file of host names, one per line"
        )
    return text


def _read_bounded(fd: int, path: str, what: str, *, pipe: bool) -> bytes:
    """Up to :data:`HOSTFILE_LIMIT` bytes of ``fd`` (opened non-blocking) to its end; what
    gives nothing (a pipe nothing writes to yet, a terminal) is waited for until
    :data:`HOSTFILE_WAIT` has passed."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + HOSTFILE_WAIT
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(left, 0.0))
        try:
            chunk = os.read(fd, 65536) if ready else None
        except BlockingIOError:
            chunk = None
        if chunk:
            chunks.append(chunk)
            size += len(chunk)
            if size > HOSTFILE_LIMIT:
                raise ConfigError(
                    f"{what} {path!r} holds more than {HOSTFILE_LIMIT} bytes: not a hostfile "
                    "(a device such as /dev/zero?); give a file of host names, one per line"
                )
            continue
        if chunk == b"" and (chunks or not pipe):
            return b"".join(chunks)  # its end
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{what} {path!r}: nothing came from it within {HOSTFILE_WAIT:g} s (a named "
                "pipe nothing writes to? a terminal?); give a regular file of host names"
            )
        if chunk == b"":
            time.sleep(0.05)  # a named pipe whose writer has not opened it yet


def hostfile_text(hosts: Sequence[Host], flavour: str) -> str:
    """A hostfile in the format of ``flavour`` (Open MPI ``h slots=N``, MPICH ``h:N``)."""
    lines = []
    for h in hosts:
        if flavour == "openmpi":
            lines.append(h.name if h.slots is None else f"{h.name} slots={h.slots}")
        elif flavour == "mpich":
            lines.append(h.name if h.slots is None else f"{h.name}:{h.slots}")
        else:
            lines.append(h.name)
    return "\n".join(lines) + "\n"


def total_slots(hosts: Sequence[Host]) -> int | None:
    """Sum of the hosts' slots, or None when any host leaves it to the launcher."""
    if not hosts or any(h.slots is None for h in hosts):
        return None
    return sum(h.slots or 0 for h in hosts)


def slot_name(h: Host, sep: str) -> str:
    return h.name if h.slots is None else f"{h.name}{sep}{h.slots}"


def multi_host(hosts: Sequence[Host], local_names: frozenset[str]) -> bool:
    """Does a launch on ``hosts`` span hosts: several of them, or one that is not this machine
    (one of ``local_names``)?"""
    return len({h.name for h in hosts}) > 1 or any(h.name not in local_names for h in hosts)
