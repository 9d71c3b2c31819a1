"""One Communicator called from several threads at once: its collectives run one at a time, each
whole, so every rank's k-th call meets every other rank's k-th call. Calls from racing threads
may pair across threads (the ranks' threads race differently), which a RuntimeWarning says;
but no call mixes with another, loses data or hangs."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi

N = 100_000
"""Elements per call: large enough that MPI and cudampi's algorithms move each call in several
messages, which calls running at once interleave."""
THREADS, CALLS = 3, 16


def rank_threads_share_a_communicator(comm):
    import threading
    import warnings

    import numpy as np

    from cudampi.comm import Communicator

    r, size = comm.rank, comm.size
    c = Communicator(comm)
    # each call is told apart by an id in this rank's own slots (at both ends of the array)
    ident = {(p, t, i): float(1 + 1000 * t + i) for p in range(3) for t in range(THREADS)
             for i in range(CALLS)}  # fmt: skip
    got: dict[tuple[int, int, int], tuple[float, ...]] = {}

    def work(p: int, path: str, t: int) -> None:
        keep = np.zeros(N)  # the in-place calls repeat on this very array (the short path)
        for i in range(CALLS):
            x = keep if i % 2 else np.zeros(N)
            x[:] = 0
            x[r] = x[N - 1 - r] = ident[(p, t, i)]
            if i % 2:
                out = x
                c.allreduce(x, out=x, path=path)
            else:
                out = c.allreduce(x, path=path)
            got[(p, t, i)] = (*out[:size].tolist(), *out[N - size :].tolist())

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for p, path in enumerate(("host", "staged", "gpu-ring")):
            threads = [threading.Thread(target=work, args=(p, path, t)) for t in range(THREADS)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
    c.close()
    ids = set(ident.values())
    # every result is one call of each rank, whole: its id in that rank's slots at both ends
    mixed = [v for v in got.values() if any(v[k] not in ids or v[k] != v[-1 - k]
                                            for k in range(size))]  # fmt: skip
    assert not mixed, f"rank {r}: {len(mixed)} of {len(got)} results mix calls: {mixed[:3]}"
    for p in range(3):  # each of this rank's calls met the others exactly once
        mine = sorted(v[r] for k, v in got.items() if k[0] == p)
        assert mine == sorted(ident[k] for k in ident if k[0] == p), f"rank {r}: {mine}"
    pairs = comm.allgather(sorted(got.values()))
    assert all(p == pairs[0] for p in pairs), f"rank {r}: the ranks saw different pairings"
    warned = [str(w.message) for w in said if "another thread's collective" in str(w.message)]
    assert len(warned) == 1, f"rank {r}: {warned}"
    if r == 0:
        print(f"{len(got)} calls from {THREADS} threads: whole, paired alike", flush=True)


def test_threads_sharing_a_communicator_run_its_calls_one_at_a_time():
    proc = run_mpi(2, __file__, "rank_threads_share_a_communicator", timeout=240)
    assert f"{3 * THREADS * CALLS} calls from {THREADS} threads" in proc.stdout
