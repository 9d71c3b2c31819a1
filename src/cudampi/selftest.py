"""``cudampi launch -n 2 -m cudampi.selftest``: is this stack really working, end to end?

Rank 0 prints the stack in one line, then one line per check. Every rank checks real data:

- mpi4py with host (NumPy) arrays: Allreduce (sum of int64, max of float64), a ring Sendrecv,
  Bcast;
- :class:`cudampi.comm.Communicator` on every path (auto, host, gpu-ring, staged, native) with
  host arrays, and with device arrays (CuPy or torch) where a GPU is present: allreduce and a
  ring send/recv. A path that does not apply to an array (it raises the package's
  DeviceError/ConfigError before moving data) is listed as n/a with its reason.

Exit 0 when every check that ran gave the right data on every rank, 1 otherwise. ``--json``
prints the results as JSON (rank 0).
"""

from __future__ import annotations

import json
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from cudampi import names
from cudampi._version import __version__

PATHS = tuple(p for p in names.PATHS if p not in ("ipc", "nccl"))
"""Every path but ``ipc`` and ``nccl``, which need CuPy (and NCCL) that the selftest does not
ask for (their own tests cover them)."""
COUNT = 1000


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """ok, wrong, error or n/a."""
    detail: str = ""


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def stack_line(info: Any, comm: Any, hosts: int) -> str:
    """The whole stack in one line: cudampi, MPI, mpi4py, ranks/hosts/launcher, python, libs."""
    import mpi4py
    from mpi4py import MPI

    lib = MPI.Get_library_version().strip().splitlines()[0].strip()
    lib = lib.split(",")[0]
    parts = [
        f"cudampi {__version__}",
        f"{lib} (mpi4py {mpi4py.__version__})",
        f"{comm.size} rank(s) on {hosts} host(s) via {info.launcher}",
        f"python {platform.python_version()}",
    ]
    for dist, label in (
        ("numpy", "numpy"),
        ("torch", "torch"),
        ("cupy-cuda12x", "cupy"),
        ("cupy-cuda13x", "cupy"),
        ("libucx-cu12", "libucx"),
        ("libucx-cu13", "libucx"),
    ):
        v = _version(dist)
        if v:
            parts.append(f"{label} {v}")
    parts.append(f"GPU {info.device}" if info.device is not None else "no GPU")
    return " | ".join(parts)


def _mpi_checks(comm: Any) -> list[Check]:
    import numpy as np
    from mpi4py import MPI

    n, r = comm.size, comm.rank
    out: list[Check] = []

    def run(name: str, fn: Callable[[], str | None]) -> None:
        try:
            wrong = fn()
            out.append(Check(name, "wrong" if wrong else "ok", wrong or ""))
        except Exception as exc:
            out.append(Check(name, "error", f"{type(exc).__name__}: {exc}"))

    def allreduce_sum() -> str | None:
        x = np.arange(COUNT, dtype=np.int64) + r
        y = np.empty_like(x)
        comm.Allreduce(x, y, op=MPI.SUM)
        want = np.arange(COUNT, dtype=np.int64) * n + n * (n - 1) // 2
        bad = int(np.count_nonzero(y != want))
        return f"{bad} of {COUNT} elements wrong" if bad else None

    def allreduce_max() -> str | None:
        x = np.full(COUNT, float(r) + 0.5)
        y = np.empty_like(x)
        comm.Allreduce(x, y, op=MPI.MAX)
        bad = int(np.count_nonzero(y != n - 0.5))
        return f"{bad} of {COUNT} elements wrong" if bad else None

    def ring() -> str | None:
        x = np.full(COUNT, r, dtype=np.int32)
        y = np.full(COUNT, -1, dtype=np.int32)
        comm.Sendrecv(x, dest=(r + 1) % n, recvbuf=y, source=(r - 1) % n)
        bad = int(np.count_nonzero(y != (r - 1) % n))
        return f"{bad} of {COUNT} elements from rank {(r - 1) % n} wrong" if bad else None

    def bcast() -> str | None:
        x = np.arange(COUNT, dtype=np.float32) if r == 0 else np.zeros(COUNT, np.float32)
        comm.Bcast(x, root=0)
        bad = int(np.count_nonzero(x != np.arange(COUNT, dtype=np.float32)))
        return f"{bad} of {COUNT} elements wrong" if bad else None

    run("mpi4py host Allreduce sum int64", allreduce_sum)
    run("mpi4py host Allreduce max float64", allreduce_max)
    run("mpi4py host ring Sendrecv", ring)
    run("mpi4py host Bcast", bcast)
    return out


def _device_arrays(
    device: int | None,
) -> tuple[str, Callable[[Any], Any], Callable[[Any], Any]] | None:
    """(label, to_device(numpy), to_numpy(device array)) for CuPy or torch on the rank's GPU."""
    if device is None:
        return None
    try:
        import cupy

        with cupy.cuda.Device(device):
            cupy.zeros(1)

        def to_dev_cupy(a: Any) -> Any:
            with cupy.cuda.Device(device):
                return cupy.asarray(a)

        return f"cupy:{device}", to_dev_cupy, lambda a: cupy.asnumpy(a)
    except Exception:
        pass
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.device("cuda", device)
        return (
            f"torch:cuda:{device}",
            lambda a: torch.from_numpy(a).to(dev),
            lambda a: a.cpu().numpy(),
        )
    except Exception:
        return None


def _communicator_checks(comm: Any, device: int | None) -> list[Check]:
    import numpy as np

    from cudampi.errors import ConfigError, DeviceError

    try:
        from cudampi.comm import Communicator
    except Exception as exc:  # not written yet in this checkout: say so, do not fail
        return [Check("Communicator", "n/a", f"cudampi.comm unavailable: {exc}")]
    n, r = comm.size, comm.rank
    kinds: list[tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = [
        ("numpy", lambda a: a, lambda a: np.asarray(a))
    ]
    dev = _device_arrays(device)
    if dev is not None:
        kinds.append(dev)
    out: list[Check] = []
    try:
        cc = Communicator(comm)
    except Exception as exc:
        return [Check("Communicator()", "error", f"{type(exc).__name__}: {exc}")]
    with cc:
        for label, to_dev, to_np in kinds:
            for path in PATHS:
                name = f"Communicator {label} path={path}"
                try:
                    x = to_dev(np.arange(COUNT, dtype=np.float32) + r)
                    y = cc.allreduce(x, "sum", path=path)
                    got = to_np(y)
                    want = np.arange(COUNT, dtype=np.float32) * n + n * (n - 1) / 2
                    bad = int(np.count_nonzero(got != want))
                    s = to_dev(np.full(COUNT, r, dtype=np.int64))
                    t = to_dev(np.full(COUNT, -1, dtype=np.int64))
                    # Ring with the even ranks sending first (blocking send/recv, no deadlock).
                    dst, src = (r + 1) % n, (r - 1) % n
                    if n == 1:
                        h = cc.isend(s, dst, tag=7, path=path)
                        cc.recv(t, src, tag=7, path=path)
                        h.wait()
                    elif r % 2 == 0:
                        cc.send(s, dst, tag=7, path=path)
                        cc.recv(t, src, tag=7, path=path)
                    else:
                        cc.recv(t, src, tag=7, path=path)
                        cc.send(s, dst, tag=7, path=path)
                    bad_p2p = int(np.count_nonzero(to_np(t) != src))
                    chosen = cc.path_for("allreduce", x)
                    if bad or bad_p2p:
                        out.append(
                            Check(
                                name,
                                "wrong",
                                f"allreduce {bad}, send/recv {bad_p2p} of {COUNT} elements wrong",
                            )
                        )
                    else:
                        detail = (
                            f"allreduce + send/recv; auto -> {chosen}"
                            if path == "auto"
                            else "allreduce + send/recv"
                        )
                        out.append(Check(name, "ok", detail))
                except (DeviceError, ConfigError) as exc:
                    out.append(Check(name, "n/a", str(exc).split(". ")[0]))
                except Exception as exc:
                    out.append(Check(name, "error", f"{type(exc).__name__}: {exc}"))
    return out


def run_checks(comm: Any, info: Any) -> tuple[list[Check], int]:
    """This rank's checks and the number of bad results over all ranks."""
    from mpi4py import MPI

    checks = _mpi_checks(comm) + _communicator_checks(comm, info.device)
    mine = sum(c.status in ("wrong", "error") for c in checks)
    total = comm.allreduce(mine, op=MPI.SUM)
    return checks, int(total)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cudampi.selftest", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    import cudampi

    info = cudampi.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    start = time.perf_counter()
    hosts = len(set(comm.allgather(socket.gethostname())))
    checks, bad = run_checks(comm, info)
    # Which rank saw what: rank 0 reports the first failing rank's checks when its own are fine.
    all_checks = comm.gather([asdict(c) for c in checks], root=0)
    elapsed = time.perf_counter() - start
    if comm.rank == 0:
        assert all_checks is not None
        worst = next(
            (
                i
                for i, cs in enumerate(all_checks)
                if any(c["status"] in ("wrong", "error") for c in cs)
            ),
            0,
        )
        shown = all_checks[worst]
        verdict = "PASS" if bad == 0 else f"FAIL ({bad} bad result(s) over all ranks)"
        if args.json:
            print(
                json.dumps(
                    {
                        "stack": stack_line(info, comm, hosts),
                        "ranks": comm.size,
                        "hosts": hosts,
                        "checks_by_rank": all_checks,
                        "bad": bad,
                        "ok": bad == 0,
                        "seconds": round(elapsed, 3),
                    },
                    indent=2,
                )
            )
        else:
            print(stack_line(info, comm, hosts))
            for c in shown:
                line = f"  {c['status']:>5}  {c['name']}"
                print(line + (f": {c['detail']}" if c["detail"] else ""))
            print(
                f"selftest: {verdict} ({comm.size} rank(s), {elapsed:.2f} s)"
                + (f"; checks shown are rank {worst}'s" if worst else "")
            )
        sys.stdout.flush()
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
