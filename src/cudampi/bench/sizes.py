"""The size sweep of ``-b/-e/-f/-i``, as nccl-tests walks it."""

from __future__ import annotations

from cudampi.config import parse_size
from cudampi.errors import ConfigError


def parse_bytes(text: str | int, flag: str) -> int:
    """A byte count such as ``8``, ``64K``, ``1G`` (binary units); ConfigError names ``flag``."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc}") from None


def size_sweep(minbytes: int, maxbytes: int, factor: float = 2.0, step: int = 0) -> list[int]:
    """Sizes from ``minbytes`` to ``maxbytes``: times ``factor``, or plus ``step`` when given.

    nccl-tests: ``-f`` multiplies (factor > 1), ``-i`` adds (used when ``-f`` is not > 1).
    """
    if minbytes < 0 or maxbytes < 0:
        raise ConfigError(f"sizes cannot be negative: -b {minbytes!r} -e {maxbytes!r}")
    if maxbytes < minbytes:
        raise ConfigError(
            f"-e {maxbytes!r} is below -b {minbytes!r}: the sweep would be empty; "
            "give -e at least as large as -b"
        )
    if step < 0:
        raise ConfigError(f"-i (step bytes) cannot be negative, got {step!r}")
    if factor <= 1.0 and step == 0:
        if minbytes == maxbytes:
            return [minbytes]
        raise ConfigError(
            f"-f {factor!r} does not grow the size and no -i step was given; "
            "use -f 2 (double each time) or -i BYTES (add each time)"
        )
    if minbytes == 0 and factor > 1.0 and step == 0:
        raise ConfigError("-b 0 with a factor never grows; start at -b 1 or more")
    sizes: list[int] = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(size)
        nxt = int(size * factor) if factor > 1.0 else size + step
        if nxt <= size:
            nxt = size + 1
        size = nxt
    return sizes


def human_bytes(n: int) -> str:
    """``1048576`` -> ``1M`` (binary units, as -b/-e accept them)."""
    for suffix, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{suffix}"
    return str(n)
