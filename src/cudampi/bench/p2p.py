"""``cudampi bench p2p``: OSU-style latency, bandwidth and bidirectional bandwidth between
ranks 0 and 1, for host and device buffers, per path.

As the OSU micro-benchmarks: latency is half a ping-pong round trip; bandwidth is a window of
``--window`` non-blocking sends answered by one short ack; bidirectional bandwidth is both
ranks sending a window at once. MB/s is 1e6 bytes per second; times and rates are rank 0's.
Other ranks wait. Data are checked: each side's receive buffer must hold the peer's pattern.

Paths: ``cudampi`` (Communicator send/recv, device buffers direct where the probe proved MPI
p2p CUDA-aware, else staged), ``ipc`` (the same calls with path='ipc': cudampi's GPU kernels
over CUDA IPC, device buffers on one node), ``mpi`` (mpi4py directly; device buffers only where proven),
``torch-gloo``/``torch-nccl``/``torch-cudampi`` (torch.distributed isend/irecv).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from typing import Any

from cudampi.bench.adapters import TORCH_PATHS, Skip, attempt, describe_error
from cudampi.bench.session import Session
from cudampi.comm.arrays import Checks, Unsupported, checks_for
from cudampi.errors import ConfigError


@dataclass(frozen=True)
class P2PRow:
    path: str
    buffers: str
    size: int
    iters: int
    latency_us: float
    bw_mbps: float
    bibw_mbps: float
    wrong: int | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class P2PResult:
    meta: dict[str, Any]
    rows: tuple[P2PRow, ...]
    skips: tuple[tuple[str, str, str], ...]
    min_bw_gbps: float | None = None

    @property
    def wrong(self) -> int:
        return sum(r.wrong or 0 for r in self.rows)

    def below_min(self) -> list[tuple[str, str, float]]:
        if self.min_bw_gbps is None:
            return []
        peak: dict[tuple[str, str], float] = {}
        for r in self.rows:
            k = (r.path, r.buffers)
            peak[k] = max(peak.get(k, 0.0), r.bw_mbps / 1e3)
        return [(p, b, v) for (p, b), v in peak.items() if v < self.min_bw_gbps]

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and not self.below_min()

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "cudampi-bench-p2p",
            "meta": self.meta,
            "results": [r.to_json() for r in self.rows],
            "skipped": [{"path": p, "buffers": b, "reason": w} for p, b, w in self.skips],
            "verdict": {
                "ok": self.ok,
                "wrong": self.wrong,
                "min_bw_gbps": self.min_bw_gbps,
                "below_min": [
                    {"path": p, "buffers": b, "peak_gbps": v} for p, b, v in self.below_min()
                ],
            },
        }


# -- adapters: isend/irecv returning something with wait() ------------------------------------
class _P2P:
    name = "?"

    def isend(self, x: Any, dest: int) -> Any:
        raise NotImplementedError

    def irecv(self, x: Any, source: int) -> Any:
        raise NotImplementedError

    @staticmethod
    def waitall(reqs: list[Any]) -> None:
        for r in reqs:
            r.wait()

    def close(self) -> None:
        pass


class _Cudampi(_P2P):
    def __init__(self, session: Session, path: str, lib: Checks) -> None:
        from cudampi.comm import Communicator

        self.name = path
        if path == "ipc":
            from cudampi.comm.paths import unavailable

            why = "ipc moves device arrays" if lib.device != "cuda" else unavailable().get("ipc")
            if why is not None:
                raise Skip(why)
        self.comm = Communicator(session.world, path=None if path == "cudampi" else path)

    def isend(self, x: Any, dest: int) -> Any:
        return self.comm.isend(x, dest)

    def irecv(self, x: Any, source: int) -> Any:
        return self.comm.irecv(x, source)

    def close(self) -> None:
        self.comm.close()


class _MpiReq:
    def __init__(self, req: Any) -> None:
        self.req = req

    def wait(self) -> None:
        self.req.Wait()


class _Mpi(_P2P):
    name = "mpi"

    def __init__(self, session: Session, lib: Checks) -> None:
        self.comm = session.world.Dup()
        self.lib = lib
        if lib.device == "cuda":
            from mpi4py import MPI

            from cudampi.comm.paths import device_support
            from cudampi.config import Config
            from cudampi.probe import capabilities as capmod

            cfg = Config.load()
            found = capmod.lookup(cfg.cache_dir, MPI.Get_library_version())
            support = device_support(cfg, found.entry, found.note)
            if not support.p2p:
                self.comm.Free()
                raise Skip(
                    f"MPI point-to-point on device memory is not proven CUDA-aware here "
                    f"({support.p2p_why}); "
                    "device Send segfaults on non-CUDA-aware Open MPI. Run `cudampi doctor`, or "
                    "preload UCX with --mca pml ucx (see docs)"
                )

    def _buf(self, x: Any) -> Any:
        if self.lib.name == "torch" and self.lib.device == "cpu":
            return x.numpy()
        return x  # NumPy, or a device array mpi4py reads through DLPack/CAI

    def isend(self, x: Any, dest: int) -> Any:
        return _MpiReq(self.comm.Isend(self._buf(x), dest, 7))

    def irecv(self, x: Any, source: int) -> Any:
        return _MpiReq(self.comm.Irecv(self._buf(x), source, 7))

    def close(self) -> None:
        self.comm.Free()


class _Torch(_P2P):
    def __init__(self, name: str, session: Session, lib: Checks) -> None:
        self.name = name
        backend = TORCH_PATHS[name]
        why = session.nccl_refusal(lib.device) if backend == "nccl" else None
        if why is not None:
            raise Skip(why)
        if backend == "gloo" and lib.device == "cuda":
            # Seen on the H200 (torch 2.11): gloo writev()s the device pointer -> EFAULT, abort.
            raise Skip("gloo's send/recv take CPU tensors only (CUDA tensors abort with EFAULT)")
        import torch.distributed as dist

        self.dist = dist
        self.group = session.torch_group(backend)

    def isend(self, x: Any, dest: int) -> Any:
        return self.dist.isend(x, dest, group=self.group)

    def irecv(self, x: Any, source: int) -> Any:
        return self.dist.irecv(x, source, group=self.group)


def _open(path: str, session: Session, lib: Checks) -> _P2P:
    if path in ("cudampi", "ipc"):
        return _Cudampi(session, path, lib)
    if path == "mpi":
        return _Mpi(session, lib)
    if path in TORCH_PATHS:
        if lib.name != "torch":
            raise Skip(f"{path} moves torch tensors only")
        return _Torch(path, session, lib)
    raise ConfigError(f"unknown p2p path {path!r}")


def _lib_for(path: str, buffers: str, session: Session, array: str) -> Checks:
    device = "cpu" if buffers == "host" else "cuda"
    if device == "cuda" and session.device != "cuda":
        raise Skip("device buffers need --device cuda and a GPU")
    if path.startswith("torch-"):
        kind = "torch"
    elif array != "auto":
        kind = array
    elif device == "cpu":
        kind = "numpy"
    else:
        try:
            import torch  # noqa: F401

            kind = "torch"
        except ImportError:
            kind = "cupy"
    try:
        return checks_for(kind, device)
    except Unsupported as exc:
        raise Skip(str(exc)) from None


def _start(path: str, buffers: str, session: Session, array: str) -> tuple[Checks, _P2P]:
    """The array library and the open path of one (path, buffers) row."""
    lib = _lib_for(path, buffers, session, array)
    return lib, _open(path, session, lib)


# -- the measurements ----------------------------------------------------------------------------
def _pingpong(p: _P2P, rank: int, x: Any, y: Any, n: int) -> None:
    for _ in range(n):
        if rank == 0:
            p.isend(x, 1).wait()
            p.irecv(y, 1).wait()
        else:
            p.irecv(y, 0).wait()
            p.isend(x, 0).wait()


def _window(p: _P2P, rank: int, x: Any, y: Any, ack: Any, window: int, n: int) -> None:
    for _ in range(n):
        if rank == 0:
            p.waitall([p.isend(x, 1) for _ in range(window)])
            p.irecv(ack, 1).wait()
        else:
            p.waitall([p.irecv(y, 0) for _ in range(window)])
            p.isend(ack, 0).wait()


def _bidir(p: _P2P, rank: int, x: Any, y: Any, window: int, n: int) -> None:
    peer = 1 - rank
    for _ in range(n):
        reqs = [p.irecv(y, peer) for _ in range(window)]
        reqs += [p.isend(x, peer) for _ in range(window)]
        p.waitall(reqs)


def _timed(lib: Checks, fn: Any, *args: Any) -> float:
    lib.sync()
    t0 = time.perf_counter()
    fn(*args)
    lib.sync()
    return time.perf_counter() - t0


def run_p2p(session: Session, o: Any, meta: dict[str, Any]) -> P2PResult:
    s = session
    if s.size < 2:
        raise ConfigError("cudampi bench p2p needs at least 2 ranks (ranks 0 and 1 exchange)")
    if "torch-cudampi" in o.paths:
        s.torch_default = "cudampi"
    rows: list[P2PRow] = []
    skips: list[tuple[str, str, str]] = []
    active = s.rank in (0, 1)
    for path in o.paths:
        for buffers in o.buffers:
            made, agreed = attempt(s, functools.partial(_start, path, buffers, s, o.array))
            if agreed is not None:
                if made is not None:
                    made[1].close()
                skips.append((path, buffers, agreed))
                continue
            assert made is not None
            lib, adapter = made
            if s.rank == 0 and not o.quiet:
                import sys

                print(f"# p2p {path} {buffers}", file=sys.stderr, flush=True)
            try:
                rows += _sweep(s, o, path, buffers, lib, adapter, active)
            except Skip as exc:
                skips.append((path, buffers, str(exc)))
            finally:
                adapter.close()
    return P2PResult(meta=meta, rows=tuple(rows), skips=tuple(skips), min_bw_gbps=o.min_busbw)


def _sweep(
    s: Session, o: Any, path: str, buffers: str, lib: Checks, p: _P2P, active: bool
) -> list[P2PRow]:
    rows = []
    for size in o.sizes:
        count = max(size, 1)  # uint8 elements: size bytes
        x = lib.pattern(count, s.rank, "bits", "uint8")
        y = lib.empty((count,), "uint8")
        ack = lib.empty((1,), "uint8")
        lib.sync()  # the kernels that made x must be done before MPI reads it on its own streams
        error = None
        if active:
            try:
                _pingpong(p, s.rank, x, y, 1)
                lib.sync()
            except Exception as exc:
                error = describe_error(exc)
        agreed = s.first_error(error)
        if agreed is not None:
            raise Skip(f"at {size} B: {agreed}")
        iters = o.iters if size <= (1 << 20) else max(o.iters // 10, 5)
        if o.time_limit > 0:
            t1 = _timed(lib, _pingpong, p, s.rank, x, y, 1) if active else 0.0
            est = s.agree_max(t1 * o.window)  # a window moves `window` messages
            if est > 0:
                iters = max(1, min(iters, int(o.time_limit / 3 / est)))
        lat = bw = bibw = 0.0
        if active:
            _pingpong(p, s.rank, x, y, o.warmup)
            t = _timed(lib, _pingpong, p, s.rank, x, y, iters)
            lat = t / (2 * iters) * 1e6
            wrong_lat = _check(lib, s.rank, y, count, o)
            _window(p, s.rank, x, y, ack, o.window, max(o.warmup // 2, 1))
            t = _timed(lib, _window, p, s.rank, x, y, ack, o.window, iters)
            bw = size * o.window * iters / t / 1e6
            _bidir(p, s.rank, x, y, o.window, max(o.warmup // 2, 1))
            t = _timed(lib, _bidir, p, s.rank, x, y, o.window, iters)
            bibw = 2 * size * o.window * iters / t / 1e6
            wrong_bi = _check(lib, s.rank, y, count, o)
            mine = wrong_lat + wrong_bi
        else:
            mine = 0
        vals = s.comm.bcast((lat, bw, bibw), root=0)
        wrong = s.total(mine) if o.check else None
        rows.append(P2PRow(path, buffers, size, iters, vals[0], vals[1], vals[2], wrong))
        if s.rank == 0 and not o.quiet and vals[0] * iters > 2e6:
            import sys

            print(f"#   {size} B: {vals[1]:.1f} MB/s", file=sys.stderr, flush=True)
    return rows


def _check(lib: Checks, rank: int, y: Any, count: int, o: Any) -> int:
    if not o.check:
        return 0
    if o.corrupt_rank == rank:
        lib.corrupt(y)
    return lib.count_wrong(y, lib.pattern64(count, 1 - rank, "bits"), "uint8")


# -- rendering ------------------------------------------------------------------------------------
def render_text(r: P2PResult) -> str:
    m = r.meta
    lines = [
        f"# cudampi bench p2p (OSU-style, rank 0 <-> rank 1): ranks {m.get('ranks')}  device "
        f"{m.get('device')}"
        + (f" [{m.get('gpu_name')}]" if m.get("gpu_name") else "")
        + f"  window {m.get('window')}  MB/s = 1e6 B/s",
        f"# MPI: {m.get('mpi_library', '?')}",
        "#",
    ]
    keys = list(dict.fromkeys((row.path, row.buffers) for row in r.rows))
    for path, buffers in keys:
        lines.append(f"# {path}, {buffers} buffers")
        lines.append(
            f"# {'Size':>10s}  {'Latency (us)':>13s}  {'Bandwidth (MB/s)':>17s}  {'Bi-Bandwidth (MB/s)':>20s}  {'#wrong':>6s}"
        )
        for row in r.rows:
            if (row.path, row.buffers) == (path, buffers):
                wrong = "N/A" if row.wrong is None else str(row.wrong)
                lines.append(
                    f"  {row.size:>10d}  {row.latency_us:13.2f}  {row.bw_mbps:17.2f}  {row.bibw_mbps:20.2f}  {wrong:>6s}"
                )
        lines.append("#")
    for path, buffers, why in r.skips:
        lines.append(f"# {path}, {buffers} buffers: skipped: {why}")
    if r.skips:
        lines.append("#")
    lines.append(f"# {'Out of bounds values':<20s} : {r.wrong} {'FAILED' if r.wrong else 'OK'}")
    problems = []
    if r.wrong:
        problems.append(f"{r.wrong} wrong bytes")
    for p, b, v in r.below_min():
        problems.append(f"{p} {b} peaked at {v:.3g} GB/s < --min-busbw {r.min_bw_gbps:g}")
    lines.append(
        f"# Verdict: {'OK' if not problems else 'FAILED'}: {len(r.rows)} rows, {len(r.skips)} skipped"
        + ("" if not problems else "; " + "; ".join(problems))
    )
    return "\n".join(lines) + "\n"


def render_csv(r: P2PResult) -> str:
    import csv
    import io

    buf = io.StringIO()
    fields = [f.name for f in dataclasses.fields(P2PRow)]
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for row in r.rows:
        w.writerow(row.to_json())
    return buf.getvalue()


def main(session: Session, o: Any, meta: dict[str, Any]) -> int:
    from cudampi.bench.output import emit

    meta = {**meta, "window": o.window}
    result = run_p2p(session, o, meta)
    emit(
        session,
        o,
        render_text(result),
        json.dumps(result.to_json(), indent=2) + "\n",
        render_csv(result),
    )
    if o.plot and session.rank == 0:
        from cudampi.bench.plot import plot_series

        series = {
            f"{p} {b}": [
                (row.size, row.bw_mbps / 1e3)
                for row in result.rows
                if (row.path, row.buffers) == (p, b)
            ]
            for p, b in dict.fromkeys((row.path, row.buffers) for row in result.rows)
        }
        plot_series(
            series, o.plot, title=f"p2p bandwidth, {meta.get('device')}", ylabel="bandwidth (GB/s)"
        )
    return 0 if result.ok else 1
