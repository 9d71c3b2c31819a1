"""A small host allreduce travels in its own cross-rank check (cudampi.comm.carry): one exchange
instead of the check and MPI's allreduce, the same results as the NumPy oracle on every rank,
and every disagreement still raised on every rank. Real ranks at 2 and 3."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi

DTYPES = ("float32", "float64", "int32", "int8", "uint16", "bool", "float16", "complex64")


def _ops(dtype):
    from cudampi.comm.arrays import ops_allowed

    return [op for op in ops_allowed(dtype) if not (op == "avg" and dtype == "bool")]


def rank_carried_matches_numpy(comm):
    import numpy as np
    import torch

    from cudampi.comm import Communicator
    from cudampi.comm.engines import KINDS
    from cudampi.comm.validate import CARRY_BYTES
    from tests.oracle import reduce

    engine_calls = []
    for kind in (KINDS["mpi"], KINDS["alg"]):
        real = kind.allreduce

        def counted(self, xf, of, op, dtype, real=real):
            engine_calls.append(int(xf.shape[0]) * self.ops.itemsize(xf))
            return real(self, xf, of, op, dtype)

        kind.allreduce = counted
    r, n = comm.rank, comm.size
    rng = np.random.default_rng(7)
    with Communicator(comm) as c:
        for dtype in DTYPES:
            count = max(1, CARRY_BYTES // np.dtype(dtype).itemsize)
            for op in _ops(dtype):
                values = [
                    (
                        rng.integers(1, 5, count) if dtype != "bool" else rng.integers(0, 2, count)
                    ).astype(dtype)
                    for _ in range(n)
                ]
                want = reduce(values, op).astype(dtype)
                # avg divides each share in the dtype here, the sum in float64 in the oracle
                rtol = 2e-3 if dtype == "float16" else 1e-5
                same = (
                    np.array_equal
                    if op != "avg" or dtype[0] in "iub"
                    else lambda a, b, rtol=rtol: np.allclose(a, b, rtol=rtol)
                )
                x, out = values[r].copy(), np.empty(count, dtype)
                for _ in range(3):  # the full path, then the repeat path, on the same arrays
                    got = c.allreduce(x, op, out=out)
                    assert got is out and same(out, want), (dtype, op, out, want)
                if dtype != "float16":
                    t = torch.from_numpy(values[r].copy())
                    c.allreduce(t, op, out=t)
                    assert same(t.numpy(), want), (dtype, op, "torch")
        assert not engine_calls, f"carried calls reached MPI's allreduce: {engine_calls}"
        big = np.ones(CARRY_BYTES // 4 + 1, np.float32)
        assert c.allreduce(big).tolist() == [float(n)] * big.size
        assert engine_calls == [big.nbytes], engine_calls
    if r == 0:
        print("carried ok", flush=True)


@pytest.mark.parametrize("n", [2, 3])
def test_a_small_host_allreduce_travels_in_its_check_with_numpys_results(n):
    proc = run_mpi(n, __file__, "rank_carried_matches_numpy", timeout=240)
    assert "carried ok" in proc.stdout


def rank_carried_disagreements(comm):
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.validate import CARRY_BYTES
    from cudampi.errors import CommError, MismatchError
    from tests.mpi.test_comm_validation import _expect

    r, last = comm.rank, comm.size - 1
    with Communicator(comm) as c:
        # both carried, different counts
        _expect(c, lambda: c.allreduce(np.ones(3 + (r == last), np.float32)), MismatchError,
                "count")  # fmt: skip
        # carried on some ranks, too large to carry on the last
        size = CARRY_BYTES // 4 + (8 if r == last else 0)
        _expect(c, lambda: c.allreduce(np.ones(size, np.float32)), MismatchError, "count")
        # another dtype of the same size on the last rank
        dt = np.int32 if r == last else np.float32
        _expect(c, lambda: c.allreduce(np.ones(4, dt)), MismatchError, "dtype")
        # another op on the last rank
        _expect(c, lambda: c.allreduce(np.ones(4), "max" if r == last else "sum"),
                MismatchError, "op")  # fmt: skip
        # the last rank refuses its own arguments: every rank raises, naming it
        op = "bogus" if r == last else "sum"
        _expect(c, lambda: c.allreduce(np.ones(4), op), CommError, "bogus" if r == last else
                f"rank {last}")  # fmt: skip
        # the repeat path meets a full path that differs: the last rank's array is another
        x, out = np.ones(4), np.empty(4)
        for _ in range(2):
            c.allreduce(x, out=out)
        y = np.ones(5) if r == last else x
        _expect(c, lambda: c.allreduce(y, out=np.empty(y.size) if r == last else out),
                MismatchError, "count")  # fmt: skip
    if r == 0:
        print("disagreements ok", flush=True)


@pytest.mark.parametrize("n", [2, 3])
def test_carried_calls_that_disagree_raise_on_every_rank(n):
    proc = run_mpi(n, __file__, "rank_carried_disagreements", timeout=240)
    assert "disagreements ok" in proc.stdout
