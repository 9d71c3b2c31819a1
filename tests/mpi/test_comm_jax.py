"""JAX arrays on real MPI ranks: collectives and messages read them in place through DLPack and
return new JAX arrays; a call that would write into one (JAX arrays are immutable) is refused on
every rank. Results are checked twice: against the NumPy oracle, and with the JAX library's
:class:`~cudampi.comm.arrays.Checks` (the patterns, expected values and wrong-element count the
benchmarks use)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.mpi.test_comm_collectives import Failures, gen, reference, same, to_lib
from tests.mpirun import run_mpi

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        importlib.util.find_spec("jax") is None, reason="jax is not installed (pip install jax)"
    ),
]

DTYPES = ("float32", "float16", "bfloat16", "int32", "uint8", "bool", "complex64")
"""JAX's dtypes without jax_enable_x64 (its default), bfloat16 (moved as torch) included."""


def _refused_everywhere(c, call, f: Failures, what: str, *words: str) -> None:
    """``call`` raises a CommError on this rank (the rank whose arguments failed, or one naming
    it), with ``words`` in it."""
    from cudampi.errors import CommError

    try:
        call()
    except CommError as exc:
        f.check(all(w in str(exc) for w in words), f"{what}: {exc}")
    else:
        f.check(False, f"{what}: not refused")


def rank_jax(comm, path):
    import jax
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.arrays import checks_for

    size, rank = comm.size, comm.rank
    f = Failures(rank)
    with Communicator(comm, path=path) as c:
        for dtype in DTYPES:
            for n in (0, 1, 7, 1000):
                where = f"{path} {dtype} n={n}"
                for op in ("sum", "max") if dtype not in ("bool", "complex64") else ("sum",):
                    x = to_lib(gen(rank, n, dtype, op), "jax", dtype)
                    got = c.allreduce(x, op)
                    f.check(isinstance(got, jax.Array), f"allreduce returns a JAX array {where}")
                    f.check(
                        same(got, reference(size, n, dtype, op), dtype, op), f"allreduce {where}"
                    )
                    f.check(same(x, gen(rank, n, dtype, op), dtype), f"input kept {where}")
                x = to_lib(gen(rank, n, dtype), "jax", dtype)
                want = np.stack([gen(r, n, dtype) for r in range(size)])
                f.check(same(c.allgather(x), want, dtype), f"allgather {where}")
                g = c.gather(x, root=size - 1)
                f.check(same(g, want, dtype) if rank == size - 1 else g is None, f"gather {where}")
                # broadcast writes into x on the receiving ranks: they pass NumPy (torch) buffers
                mutable = "torch" if dtype == "bfloat16" else "numpy"
                b = c.broadcast(x if rank == 0 else to_lib(np.zeros(n), mutable, dtype), root=0)
                f.check(b is x if rank == 0 else same(b, gen(0, n, dtype), dtype), f"bcast {where}")
                _refused_everywhere(
                    c, lambda x=x: c.broadcast(x, root=0), f, f"bcast into JAX {where}", "immutable"
                )
                full = np.stack([gen(10 + i, n, dtype) for i in range(size)])
                tmpl = to_lib(full if rank == 0 else np.zeros_like(full), "jax", dtype)
                f.check(same(c.scatter(tmpl, root=0), full[rank], dtype), f"scatter {where}")
                xr = to_lib(gen(rank, size * n, dtype), "jax", dtype)
                red = reference(size, size * n, dtype, "sum")
                got = c.reduce_scatter(xr, "sum")
                f.check(same(got, red[rank * n : (rank + 1) * n], dtype), f"reduce_scatter {where}")
                blocks = [gen(100 * rank + j, n, dtype) for j in range(size)]
                xa = to_lib(np.concatenate(blocks), "jax", dtype)
                want = np.concatenate([gen(100 * j + rank, n, dtype) for j in range(size)])
                f.check(same(c.alltoall(xa), want, dtype), f"alltoall {where}")

        # the result is JAX's over cudampi's buffer: no copy on the way out (64-byte aligned)
        got = c.allreduce(to_lib(gen(rank, 1000, "float32"), "jax", "float32"))
        f.check(got.unsafe_buffer_pointer() % 64 == 0, "result buffer aligned for XLA")
        # async: the handle's wait gives the JAX array
        h = c.allreduce(to_lib(gen(rank, 33, "int32"), "jax", "int32"), async_op=True)
        f.check(same(h.wait(timeout=120), reference(size, 33, "int32", "sum"), "int32"), "async")

        # writing into a JAX array is refused on every rank: out=, out=x, a receive
        x = to_lib(gen(rank, 8, "float32"), "jax", "float32")
        _refused_everywhere(c, lambda: c.allreduce(x, out=x), f, "out=x", "jax", "immutable")
        out = to_lib(np.zeros(8), "jax", "float32")
        _refused_everywhere(c, lambda: c.allreduce(x, out=out), f, "out=", "read-only")
        # a JAX array is sent from in place; the receiver passes a NumPy buffer
        y = np.zeros(8, np.float32)
        c.sendrecv(x, (rank + 1) % size, y, (rank - 1) % size)
        f.check(same(y, gen((rank - 1) % size, 8, "float32"), "float32"), "sendrecv from JAX")

        # the benchmarks' check on JAX arrays: patterns in, expected values, wrong elements
        ck = checks_for("jax", "cpu")
        for kind, op in (("sum", "sum"), ("prod", "prod"), ("bits", "bxor"), ("sum", "avg")):
            dtype = "int32" if op == "bxor" else "float32"
            got = c.allreduce(ck.pattern(1000, rank, kind, dtype), op)
            exp = ck.reduce64([ck.pattern64(1000, r, kind) for r in range(size)], op)
            f.check(ck.count_wrong(got, exp, dtype) == 0, f"bench check {op}")
            wrong = ck.cast(exp + 1.0, dtype)  # a result that is off everywhere is counted so
            f.check(ck.count_wrong(wrong, exp, dtype) == 1000, f"bench check counts {op}")
    f.finish()
    if rank == 0:
        print(f"checked {f.checked} JAX results on {size} ranks", flush=True)


PATHS = ("host", "staged")


def rank_jax_paths(comm, paths):
    """:func:`rank_jax` on each of ``paths``, one after the other in this job: the job's start,
    JAX's import and its first compiles once, not per path; rank 0 says which path passed."""
    for path in paths.split(","):
        rank_jax(comm, path)
        if comm.rank == 0:
            print(f"path {path}: JAX results checked", flush=True)


@pytest.fixture(scope="module")
def jax_paths():
    """Every path of :data:`PATHS` in one 2-rank job (this file's tests run on one xdist
    worker: tests/conftest.py's TOGETHER); what rank 0 printed."""
    env = {"JAX_PLATFORMS": "cpu"}
    return run_mpi(2, __file__, "rank_jax_paths", ",".join(PATHS), timeout=600, env=env).stdout


@pytest.mark.parametrize("path", PATHS)
def test_collectives_on_jax_arrays_return_jax_arrays(path, jax_paths):
    assert f"path {path}: JAX results checked" in jax_paths, jax_paths[-3000:]
    assert "JAX results on 2 ranks" in jax_paths
