"""Frozen results of a benchmark run: rows, skips, the physical limit, and the verdict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Row:
    """One line of an nccl-tests table (one size of one collective on one path)."""

    op: str
    path: str
    dtype: str
    redop: str | None
    root: int
    size: int
    count: int
    iters: int
    time_us: float
    """Average over ranks of each rank's average time per call (nccl-tests' time column)."""
    time_min_us: float
    time_max_us: float
    algbw: float
    busbw: float
    wrong: int | None
    """Wrong elements summed over ranks; None when the data were not checked."""
    spread: float = 1.0
    """Slowest over fastest of the repeated timings of this size (the timed calls are taken in
    :data:`REPEATS` rounds; the worst rank's ratio). Above :data:`NOISE` the row is noise."""

    @property
    def noisy(self) -> bool:
        return self.spread > NOISE

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["noisy"] = self.noisy
        return d


REPEATS = 5
"""Rounds the timed calls of one size are split into (each timed on its own)."""

NOISE = 2.0
"""A size whose rounds differ by more than this factor is marked noisy, not reported as one
confident figure (a shared or unbound CPU: here an 8-byte allreduce took 1.4 us in one run and
457 us in the next)."""


@dataclass(frozen=True)
class SkipNote:
    """A path that did not run one case, and why."""

    op: str
    path: str
    dtype: str
    redop: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Limit:
    """The physical ceiling drawn on the plot: what the hardware can move per rank."""

    kind: str
    """``nvlink``, ``pcie``, ``hbm-copy`` (ranks share one GPU) or ``host-copy`` (CPU)."""
    gbps: float
    source: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BenchResult:
    """A whole ``cudampi bench`` run of collectives."""

    meta: dict[str, Any]
    rows: tuple[Row, ...]
    skips: tuple[SkipNote, ...]
    limit: Limit | None = None
    min_busbw: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wrong(self) -> int:
        return sum(r.wrong or 0 for r in self.rows)

    def peak_busbw(self) -> dict[tuple[str, str, str, str | None], float]:
        """Best busbw of each (op, path, dtype, redop) block."""
        out: dict[tuple[str, str, str, str | None], float] = {}
        for r in self.rows:
            key = (r.op, r.path, r.dtype, r.redop)
            out[key] = max(out.get(key, 0.0), r.busbw)
        return out

    def below_min(self) -> list[tuple[tuple[str, str, str, str | None], float]]:
        """Blocks whose peak busbw misses ``--min-busbw`` (the copy peer is never held to it)."""
        if self.min_busbw is None:
            return []
        return [
            (k, v)
            for k, v in sorted(self.peak_busbw().items(), key=lambda kv: str(kv[0]))
            if k[1] != "copy" and v < self.min_busbw
        ]

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and not self.below_min()

    def noisy(self) -> list[Row]:
        """Rows whose repeated timings varied more than :data:`NOISE` times."""
        return [r for r in self.rows if r.noisy]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "cudampi-bench-collectives",
            "meta": self.meta,
            "results": [r.to_json() for r in self.rows],
            "skipped": [s.to_json() for s in self.skips],
            "limit": self.limit.to_json() if self.limit else None,
            "verdict": {
                "ok": self.ok,
                "wrong": self.wrong,
                "min_busbw": self.min_busbw,
                "below_min_busbw": [
                    {"op": k[0], "path": k[1], "dtype": k[2], "redop": k[3], "peak_busbw": v}
                    for k, v in self.below_min()
                ],
                "noisy_rows": len(self.noisy()),
                "one_rank": self.meta.get("ranks") == 1,
            },
            **self.extra,
        }
