"""The ipc engine on the GPU: every collective x dtype x op against NumPy, stream order, CUDA
graphs, and the faults (a mismatched call, a missing rank, a killed rank) at 2-4 ranks that
share one GPU (or one GPU each). Run on the GPU machine, with and without the MPS daemon:

    python -m pytest -m gpu tests/gpu/test_ipc_gpu.py
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest

from tests.gpu.test_comm_gpu import GPU_DTYPES, _libs, _setup
from tests.mpi.test_comm_collectives import Failures, gen, run_async, run_matrix, same, to_lib
from tests.mpirun import run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

if not importlib.util.find_spec("cupy"):
    pytestmark.append(pytest.mark.skip(reason="the ipc engine needs CuPy"))


def _config(small: str, **kw: str):
    from cudampi.config import Config

    over = {"ipc_bytes": "64K", "ipc_oneshot_bytes": "4K"} if small == "1" else {}
    over.update(kw)
    return Config.load(over, env=None, strict_env=False)


def rank_ipc_matrix(comm, lib, small):
    """Every collective, dtype and op; with small=1 a 64 KiB workspace and a 4 KiB one-shot
    limit, so two-shot, many launches and many rounds run at small sizes."""
    from cudampi.comm import Communicator

    _setup(comm, lib)
    f = Failures(comm.rank)
    sizes = (0, 1, 7, 1000, 100003) if small == "1" else (0, 1, 5, 4099, 1 << 20)
    with Communicator(comm, config=_config(small)) as c:
        run_matrix(
            c,
            [lib],
            ["ipc"],
            f,
            sizes=sizes,
            dtypes=GPU_DTYPES,
            some=("float32", "float16", "bfloat16", "int64", "bool", "complex64"),
        )
        run_async(c, lib, ["ipc"], f)
        c.synchronize()
    f.finish()
    if comm.rank == 0:
        print(f"checked {f.checked} results")


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("lib", _libs())
def test_every_collective_dtype_and_op_matches_numpy(n, lib):
    for small in ("1", "0"):
        run_mpi(n, __file__, "rank_ipc_matrix", lib, small, timeout=900)


def rank_ipc_odd_and_order(comm):
    """A buffer at an odd offset inside a tensor; a slow kernel enqueued before the call on the
    caller's stream is waited for; two streams in turn; bitwise-equal results on every rank."""
    import numpy as np
    import torch

    from cudampi.comm import Communicator

    _setup(comm, "torch-cuda")
    with Communicator(comm, path="ipc") as c:
        for n in (1, 1001, 1 << 20):
            base = torch.zeros(n + 3, device="cuda")
            x = base[1 : n + 1]  # 4 bytes past a 16-byte boundary
            x.copy_(torch.arange(n, device="cuda") * (comm.rank + 1))
            c.allreduce(x, out=x)
            want = np.arange(n, dtype=np.float32) * sum(r + 1 for r in range(comm.size))
            assert np.array_equal(x.cpu().numpy(), want), n
            assert base[0].item() == 0 and base[n + 1 :].abs().sum().item() == 0, "wrote outside"
        # stream order: the fill runs after ~0.1 s of GPU sleep on the caller's stream
        s = torch.cuda.Stream()
        x = torch.zeros(1 << 22, device="cuda")
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)
            x.fill_(comm.rank + 1)
            c.allreduce(x, out=x)
            y = c.allreduce(x, async_op=True)
        s.synchronize()
        total = sum(r + 1 for r in range(comm.size))
        assert (x == total).all().item() and (y.wait(timeout=60) == total * comm.size).all()
        # random data: every rank ends with the same bits (one reduction order everywhere)
        g = torch.Generator(device="cuda").manual_seed(comm.rank)
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            r = torch.randn(333_333, device="cuda", generator=g).to(dt)
            c.allreduce(r, out=r)
            bits = r.view(torch.int16 if dt != torch.float32 else torch.int32).cpu().numpy()
            everyone = comm.allgather(bits.tobytes())
            assert all(b == everyone[0] for b in everyone), f"{dt}: ranks differ"
        c.synchronize()
    if comm.rank == 0:
        print("odd offsets, stream order and bitwise agreement ok")


@pytest.mark.parametrize("n", [2, 4])
def test_odd_offsets_stream_order_and_same_bits(n):
    if not importlib.util.find_spec("torch"):
        pytest.skip("needs torch")
    run_mpi(n, __file__, "rank_ipc_odd_and_order", timeout=300)


def rank_ipc_graph(comm):
    """An allreduce captured in a CUDA graph and replayed with new inputs; a freed and reused
    torch block is read fresh."""
    import torch

    from cudampi.comm import Communicator

    _setup(comm, "torch-cuda")
    total = sum(r + 1 for r in range(comm.size))
    with Communicator(comm, path="ipc") as c:
        static = torch.zeros(1 << 16, device="cuda")
        c.allreduce(static, out=static)  # warm up: compile, workspace (not while capturing)
        c.allreduce(static, "max", out=static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.allreduce(static, out=static)
            c.allreduce(static, "max", out=static)
        for k in range(1, 4):
            static.fill_(k * (comm.rank + 1))
            graph.replay()
            torch.cuda.synchronize()
            assert (static == k * total).all().item(), (k, static[:4])
        for k in range(3):
            t = torch.full((1 << 18,), float(k + comm.rank), device="cuda")
            c.allreduce(t, out=t)
            want = sum(k + r for r in range(comm.size))
            assert (t == want).all().item(), (k, t[:4])
            del t
        c.synchronize()
    if comm.rank == 0:
        print("graph capture and replay ok")


@pytest.mark.parametrize("n", [2, 3])
def test_cuda_graph_capture_and_replay(n):
    if not importlib.util.find_spec("torch"):
        pytest.skip("needs torch")
    run_mpi(n, __file__, "rank_ipc_graph", timeout=300)


def rank_ipc_faults(comm, case):
    """mismatch: rank 0 reduces 1000 elements, the others 999. missing: the last rank skips
    the call. Every rank that calls must raise within the timeout (5 s here)."""
    import cupy

    from cudampi.comm import Communicator
    from cudampi.errors import CommError, MismatchError

    _setup(comm, "cupy")
    last = comm.size - 1
    with Communicator(comm, path="ipc", config=_config("0", timeout="5")) as c:
        c.allreduce(cupy.ones(8, cupy.float32))
        c.synchronize()
        t0 = time.monotonic()
        try:
            if case == "mismatch":
                c.allreduce(cupy.ones(1000 if comm.rank == 0 else 999, cupy.float32))
            elif comm.rank != last:
                c.allreduce(cupy.ones(1000, cupy.float32))
            c.synchronize()
            if case == "missing" and comm.rank == last:
                print(f"rank {comm.rank}: skipped the call", flush=True)
                time.sleep(8)
                raise SystemExit(0)
            raise AssertionError(f"rank {comm.rank}: no error")
        except (CommError, MismatchError) as exc:
            took = time.monotonic() - t0
            print(f"rank {comm.rank}: RAISED {type(exc).__name__} after {took:.1f} s: {exc}")
            assert took < 20
            want = MismatchError if case == "mismatch" else CommError
            assert isinstance(exc, want), exc
        # the communicator refuses further calls with the same error
        try:
            c.allreduce(cupy.ones(8, cupy.float32))
            raise AssertionError("a failed communicator accepted a call")
        except (CommError, MismatchError):
            pass


@pytest.mark.parametrize("case", ["mismatch", "missing"])
def test_mismatch_and_missing_rank_raise_on_every_rank(case):
    proc = run_mpi(3, __file__, "rank_ipc_faults", case, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    callers = 3 if case == "mismatch" else 2
    assert out.count("RAISED") == callers, out[-6000:]
    if case == "mismatch":
        assert "1000 elements" in out and "999 elements" in out, out[-4000:]
    else:
        assert "did not arrive" in out, out[-4000:]


def rank_ipc_killed(comm):
    import cupy

    from cudampi.comm import Communicator
    from cudampi.errors import CommError

    _setup(comm, "cupy")
    with Communicator(comm, path="ipc", config=_config("0", timeout="60")) as c:
        c.allreduce(cupy.ones(8, cupy.float32))
        c.synchronize()
        comm.Barrier()
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            c.allreduce(cupy.ones(1 << 20, cupy.float32))
            c.synchronize()
        except CommError as exc:
            print(
                f"rank {comm.rank}: RAISED after {time.monotonic() - t0:.1f} s: {exc}", flush=True
            )
            os._exit(3)


def test_a_killed_rank_makes_the_others_raise_not_hang():
    from tests.mpirun import is_open_mpi

    env = {"PRTE_MCA_state_base_recoverable": "1"} if is_open_mpi() else {}
    proc = run_mpi(2, __file__, "rank_ipc_killed", timeout=120, check=False, env=env)
    out = proc.stdout + proc.stderr
    assert "rank 0: RAISED" in out and "ended while this communicator" in out, out[-6000:]


def rank_ipc_check_same(comm):
    """The workspace of a second communicator and a split one work beside the first."""
    import cupy

    from cudampi.comm import Communicator

    _setup(comm, "cupy")
    with Communicator(comm, path="ipc") as a, Communicator(comm, path="ipc") as b:
        x = cupy.full(1000, comm.rank + 1, cupy.float32)
        ya, yb = a.allreduce(x), b.allreduce(x, "max")
        sub = a.split(comm.rank % 2)
        assert sub is not None
        z = sub.allreduce(x)
        want = sum(r + 1 for r in range(comm.rank % 2, comm.size, 2))
        assert same(ya, [sum(r + 1 for r in range(comm.size))] * 1000, "float32")
        assert same(yb, [comm.size] * 1000, "float32")
        assert same(z, [want] * 1000, "float32")
        sub.close()


def test_several_communicators_and_splits():
    run_mpi(4, __file__, "rank_ipc_check_same", timeout=300)


def rank_ipc_registered(comm):
    """Large allreduces on the same tensors: after the first calls the peers address them in
    place (registered); in place and not, a segment given back (empty_cache) and made again."""
    import torch

    from cudampi.comm import Communicator

    _setup(comm, "torch-cuda")
    n, size, rank = 3 << 20, comm.size, comm.rank
    # 12 MiB runs two-shot (registration is for two-shot) whatever the ranks share
    with Communicator(comm, path="ipc", config=_config("0", ipc_oneshot_bytes="512K")) as c:
        for round_ in range(2):
            x = torch.empty(n, device="cuda")
            y = torch.empty(n, device="cuda")
            for k in range(6):
                x.fill_(k + rank)
                c.allreduce(x, out=x)
                assert (x == sum(k + r for r in range(size))).all().item(), (round_, k)
                x.fill_(k * rank + 1)
                c.allreduce(x, "max", out=y)
                assert (y == k * (size - 1) + 1).all().item(), (round_, k)
            del x, y
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        c.synchronize()
        engine = next(e for e in c._engines.stream_ordered())
        assert engine.registered_calls > 0, "no call ran on registered buffers"
    if rank == 0:
        print(f"registered calls: {engine.registered_calls}")


@pytest.mark.parametrize("n", [2, 3])
def test_registered_buffers_in_place_and_reused(n):
    if not importlib.util.find_spec("torch"):
        pytest.skip("needs torch")
    run_mpi(n, __file__, "rank_ipc_registered", timeout=300)


def rank_ipc_hier(comm, lib):
    """4 ranks cut into 2 "nodes" of 2: ipc kernels inside each, the cross-node step through
    gpu-ring (where device p2p is proven) or staged; every collective against NumPy."""
    from cudampi.comm import Communicator

    _setup(comm, lib)
    f = Failures(comm.rank)
    with Communicator(comm, config=_config("1", node_ranks="2")) as c:
        run_matrix(
            c, [lib], ["ipc"], f, sizes=(0, 1, 7, 100003), dtypes=("float32", "bfloat16", "int64"),
            some=("float32", "float16"),
        )  # fmt: skip
    f.finish()
    if comm.rank == 0:
        print(f"hierarchical: checked {f.checked} results")


@pytest.mark.parametrize("lib", _libs())
def test_hierarchical_across_two_pretend_nodes(lib):
    run_mpi(4, __file__, "rank_ipc_hier", lib, timeout=600)


__all__ = ["gen", "to_lib"]
