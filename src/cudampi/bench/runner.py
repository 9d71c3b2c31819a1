"""Time every (collective, path, dtype, redop) over the size sweep, check the data, agree.

Per size: one probe call whose failure on any rank skips the block (with the first rank's
reason) instead of crashing, the rest of the warmup, a barrier, ``iters`` timed calls ended by a
device sync, each rank's average reduced to min/avg/max over the ranks, then (``check``) fresh
buffers, one more call and the wrong elements summed over ranks. Every decision that changes how
many calls a rank makes (skips, ``time_limit``) is agreed over MPI first, so ranks never
disagree on the sequence of collectives.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cudampi.bench import limits
from cudampi.bench.adapters import PathAdapter, Skip, attempt, describe_error, open_path
from cudampi.bench.dtypes import ITEMSIZE
from cudampi.bench.metrics import algbw, busbw, collective_layout
from cudampi.bench.registry import UNITS, Case
from cudampi.bench.results import REPEATS, BenchResult, Row, SkipNote
from cudampi.bench.session import Session
from cudampi.comm.arrays import Checks, Unsupported, checks_for


@dataclass(frozen=True)
class Spec:
    """What to run. ``iters``/``warmup`` as nccl-tests' -n/-w; ``time_limit`` (seconds, 0 = off)
    lowers both for a size whose calls are slow, so a 1 GB staged row cannot take minutes."""

    ops: tuple[str, ...]
    paths: tuple[str, ...]
    dtypes: tuple[str, ...] = ("float32",)
    redops: tuple[str, ...] = ("sum",)
    root: int = 0
    sizes: tuple[int, ...] = (8,)
    warmup: int = 5
    iters: int = 20
    check: bool = True
    time_limit: float = 0.0
    array: str = "auto"
    corrupt_rank: int | None = None
    """Test-only: this rank changes element 0 of its result buffer before the check reads it."""
    in_place: bool = False
    """cudampi's paths reduce in place (the torch paths always do)."""
    progress: bool = True
    meta: dict[str, Any] = field(default_factory=dict)


def lib_kind(path: str, array: str, device: str, dtype: str) -> str:
    """Which array library a path's buffers use for ``--array`` (auto picks per path/dtype)."""
    if path.startswith("torch-"):
        return "torch"
    if array != "auto":
        return array
    if device == "cpu":
        return "torch" if dtype == "bfloat16" else "numpy"
    try:
        import torch  # noqa: F401

        return "torch"
    except ImportError:
        return "cupy"


class Runner:
    """Holds the adapters (made once, in the same order on every rank) and runs blocks."""

    def __init__(self, session: Session, spec: Spec, log: Callable[[str], None] | None = None):
        self.s = session
        self.spec = spec
        self.libs: dict[str, Checks | str] = {}
        self.adapters: dict[tuple[str, str], PathAdapter | str] = {}
        self.rows: list[Row] = []
        self.skips: list[SkipNote] = []
        self.choices: list[dict[str, Any]] = []
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._last = time.monotonic()
        if "torch-cudampi" in spec.paths:
            session.torch_default = "cudampi"

    def log(self, text: str, *, force: bool = True) -> None:
        if self.spec.progress and self.s.rank == 0 and (force or time.monotonic() - self._last > 2):
            self._log(text)
            self._last = time.monotonic()

    # -- resources -----------------------------------------------------------------------------
    def lib(self, kind: str) -> Checks:
        if kind not in self.libs:
            try:
                self.libs[kind] = checks_for(kind, self.s.device)
            except Unsupported as exc:
                self.libs[kind] = str(exc)
        lib = self.libs[kind]
        if isinstance(lib, str):
            raise Skip(lib)
        return lib

    def adapter(self, path: str, lib: Checks) -> PathAdapter:
        key = (path, lib.name)
        if key not in self.adapters:
            made, agreed = attempt(
                self.s, lambda: open_path(path, lib, self.s, in_place=self.spec.in_place)
            )
            if agreed is not None and made is not None:
                made.close()
            self.adapters[key] = agreed if agreed is not None else made  # type: ignore[assignment]
        adapter = self.adapters[key]
        if isinstance(adapter, str):
            raise Skip(adapter)
        return adapter

    def close(self) -> None:
        for a in self.adapters.values():
            if isinstance(a, PathAdapter):
                a.close()
        self.adapters.clear()

    # -- the sweep -----------------------------------------------------------------------------
    def blocks(self) -> list[tuple[str, str, str, str | None]]:
        """(op, path, dtype, redop) in run order: the copy peer first, once per dtype."""
        out: list[tuple[str, str, str, str | None]] = []
        for dtype in self.spec.dtypes:
            if "copy" in self.spec.paths:
                out.append(("copy", "copy", dtype, None))
            for op in self.spec.ops:
                unit = UNITS[op]
                for redop in self.spec.redops if unit.reduces else (None,):
                    out.extend((op, p, dtype, redop) for p in self.spec.paths if p != "copy")
        return out

    def run(self) -> BenchResult:
        blocks = self.blocks()
        for i, (op, path, dtype, redop) in enumerate(blocks):
            self.log(f"# [{i + 1}/{len(blocks)}] {op} {path} {dtype} {redop or ''}".rstrip())
            self.block(op, path, dtype, redop)
        spec = self.spec
        limit = limits.physical_limit(
            self.s, lambda: self.lib(lib_kind("copy", spec.array, self.s.device, "float32"))
        )
        return BenchResult(
            meta=self.spec.meta,
            rows=tuple(self.rows),
            skips=tuple(self.skips),
            limit=limit,
            extra={"choices": self.choices},
        )

    def skip(self, op: str, path: str, dtype: str, redop: str | None, reason: str) -> None:
        self.skips.append(SkipNote(op, path, dtype, redop, reason))
        self.log(f"#   skipped: {reason}")

    def block(self, op: str, path: str, dtype: str, redop: str | None) -> None:
        s, spec, unit = self.s, self.spec, UNITS[op]
        try:
            lib = self.lib(lib_kind(path, spec.array, s.device, dtype))
            lib.check_dtype(dtype)
            adapter = self.adapter(path, lib)
        except (Skip, Unsupported) as exc:
            self.skip(op, path, dtype, redop, str(exc))
            return
        reason = adapter.check(op, dtype, redop, s)
        if reason:
            self.skip(op, path, dtype, redop, reason)
            return
        choice = getattr(adapter, "choice", None)
        if choice is not None:  # what the Communicator said this path runs, and why
            self.choices.append(
                {
                    "op": op,
                    "path": path,
                    "dtype": dtype,
                    "redop": redop,
                    "engine": getattr(choice, "engine", ""),
                    "reason": getattr(choice, "reason", str(choice)),
                }
            )
        root = spec.root if unit.rooted else -1
        for nbytes in spec.sizes:
            layout = collective_layout(op, nbytes, ITEMSIZE[dtype], s.size)
            if layout.count == 0:
                continue  # below one aligned element per rank: nothing to move
            case = Case(
                lib, layout, s.rank, s.size, dtype, redop, max(root, 0), adapter.inplace_reduce
            )
            row = self.measure(unit, adapter, case, root)
            if isinstance(row, str):
                self.skip(op, path, dtype, redop, f"at {layout.size} B: {row}")
                return
            self.rows.append(row)
            self.log(
                f"#   {row.size:>12d} B  {row.time_us:10.1f} us  busbw {row.busbw:8.3f} GB/s",
                force=False,
            )

    def _call(self, unit: Any, adapter: PathAdapter, bufs: Any, case: Case) -> str | None:
        """One call and a device sync; the error text instead of raising (for the probe)."""
        try:
            unit.call(adapter, bufs, case)
            case.lib.sync()
        except Exception as exc:
            return describe_error(exc)
        return None

    def measure(self, unit: Any, adapter: PathAdapter, case: Case, root: int) -> Row | str:
        s, spec, lib = self.s, self.spec, case.lib
        error: str | None = None
        bufs = None
        try:
            bufs = unit.prepare(case)
        except Exception as exc:
            error = describe_error(exc)
        agreed = s.first_error(error)
        if agreed is not None:
            return agreed
        # probe call: also the first warmup call
        t0 = time.perf_counter()
        error = self._call(unit, adapter, bufs, case)
        t_first = time.perf_counter() - t0
        agreed = s.first_error(error)
        if agreed is not None:
            return agreed
        est = s.agree_max(t_first)
        warm_left = max(spec.warmup - 1, 0)
        if warm_left:
            t0 = time.perf_counter()
            unit.call(adapter, bufs, case)
            lib.sync()
            est = s.agree_max(time.perf_counter() - t0)
            warm_left -= 1
        iters = spec.iters
        if spec.time_limit > 0 and est > 0:
            fit = int(spec.time_limit / est)
            iters = max(1, min(iters, fit))
            warm_left = min(warm_left, max(fit // 4, 0))
        for _ in range(warm_left):
            unit.call(adapter, bufs, case)
        lib.sync()
        s.barrier()
        # The timed calls in rounds, each timed on its own: their spread tells noise apart from
        # a figure (nccl-tests prints one number however much the runs disagreed).
        rounds = [n for n in split_rounds(iters, REPEATS) if n]
        per_round: list[float] = []
        t0 = time.perf_counter()
        for n in rounds:
            r0 = time.perf_counter()
            for _ in range(n):
                unit.call(adapter, bufs, case)
            lib.sync()
            per_round.append((time.perf_counter() - r0) / n)
        per_call = (time.perf_counter() - t0) / iters
        tmin, tavg, tmax = s.stats(per_call)
        spread = s.agree_max(max(per_round) / min(per_round) if min(per_round) > 0 else 1.0)
        wrong: int | None = None
        if spec.check:
            del bufs
            bufs = unit.prepare(case)
            unit.call(adapter, bufs, case)
            lib.sync()
            if spec.corrupt_rank == s.rank:
                lib.corrupt(unit.result(bufs))
            expected = unit.expected(case)
            mine = (
                0 if expected is None else lib.count_wrong(unit.result(bufs), expected, case.dtype)
            )
            wrong = s.total(mine)
        del bufs
        L = case.layout
        return Row(
            op=unit.name,
            path=adapter.name,
            dtype=case.dtype,
            redop=case.redop,
            root=root,
            size=L.size,
            count=L.count,
            iters=iters,
            time_us=tavg * 1e6,
            time_min_us=tmin * 1e6,
            time_max_us=tmax * 1e6,
            algbw=algbw(L.size, tavg),
            busbw=busbw(unit.name, L.size, tavg, s.size),
            wrong=wrong,
            spread=spread,
        )


def split_rounds(iters: int, rounds: int) -> list[int]:
    """``iters`` calls as ``rounds`` near-equal rounds (fewer when there are fewer calls)."""
    rounds = max(1, min(rounds, iters))
    base, extra = divmod(iters, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds)]


def run_collectives(session: Session, spec: Spec) -> BenchResult:
    """Run ``spec`` on every rank of ``session``; every rank returns the same result."""
    runner = Runner(session, spec)
    try:
        return runner.run()
    finally:
        runner.close()
