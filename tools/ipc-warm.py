"""Compile the ipc kernels ahead of a GPU session, many at a time (CuPy caches them on disk,
CUPY_CACHE_DIR): every dtype x op at the given rank counts, plus the exchange kernel.

    python tools/ipc-warm.py --ranks 2,3,4 [--jobs 16]
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor


def _one(name: str) -> tuple[str, float, str]:
    t = time.perf_counter()
    try:
        from cudampi.comm.ipc.workspace import kernel

        kernel(0, name)
        return name, time.perf_counter() - t, ""
    except Exception as exc:  # report every failure, not just the first
        return name, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[:2000]}"


def main() -> int:
    from cudampi.comm.arrays import ops_allowed
    from cudampi.comm.ipc import layout as L

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--jobs", type=int, default=8)
    args = ap.parse_args()
    names: list[str] = []
    for n in (int(x) for x in args.ranks.split(",")):
        names.append(L.exchange_name(n))
        for dt in L.KINDS:
            names += [L.reduce_name(dt, op, n) for op in ops_allowed(dt)]
            names += [L.twoshot_name(dt, op, n) for op in ops_allowed(dt)]
    names = list(dict.fromkeys(names))
    t0 = time.perf_counter()
    bad = 0
    ctx = multiprocessing.get_context("spawn")  # no CUDA state inherited by fork
    with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for name, secs, err in pool.map(_one, names):
            if err:
                bad += 1
                if bad <= 3:  # the rest usually fail the same way
                    print(f"FAILED {name} ({secs:.1f} s): {err}", flush=True)
    print(
        f"compiled {len(names) - bad} of {len(names)} kernels in {time.perf_counter() - t0:.0f} s"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
