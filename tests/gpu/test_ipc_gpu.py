"""The ipc engine on the GPU: every collective x dtype x op against NumPy, stream order, CUDA
graphs, and the faults (a mismatched call, a missing rank, a killed rank) at 2-4 ranks that
share one GPU (or one GPU each). The checks of each rank count run in one job
(tests/gpu/jobs.py), the faults last; the killed rank has a job of its own. Run on the GPU
machine, with and without the MPS daemon:

    python -m pytest -m gpu tests/gpu/test_ipc_gpu.py
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import pytest

from tests.gpu.jobs import Check, params, time_left, time_sliced
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


SLICED_DTYPES = ("bool", "int64", "bfloat16", "float32")
"""The dtypes of the matrix where the ranks time-slice the GPU (:func:`time_sliced`): bool's
logical ops, an integer, the 2-byte float the kernels widen, a float; the full matrix (every
dtype, the same kernels) runs with MPS, where the ranks' kernels run side by side as on a GPU
per rank. Time-sliced, each ipc kernel waits a slice for its peers', and the full matrix at 2-4
ranks alone outlasts a GPU session's run."""


def rank_ipc_matrix(comm, lib, dtypes=GPU_DTYPES):
    """Every collective, dtype and op, twice: with a 64 KiB workspace and a 4 KiB one-shot
    limit (two-shot, many launches and many rounds at small sizes), then with the defaults."""
    from cudampi.comm import Communicator

    _setup(comm, lib)
    some = ("float32", "float16", "bfloat16", "int64", "bool", "complex64")
    counts = []
    for small in ("1", "0"):
        f = Failures(comm.rank)
        sizes = (0, 1, 7, 1000, 100003) if small == "1" else (0, 1, 5, 4099, 1 << 20)
        with Communicator(comm, config=_config(small)) as c:
            run_matrix(
                c,
                [lib],
                ["ipc"],
                f,
                sizes=sizes,
                dtypes=dtypes,
                some=tuple(d for d in some if d in dtypes),
            )
            run_async(c, lib, ["ipc"], f)
            c.synchronize()
        f.finish()
        counts.append(f.checked)
    return f"checked {counts[0]} results (64 KiB workspace), {counts[1]} (defaults)"


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
    return "odd offsets, stream order and bitwise agreement ok"


def rank_ipc_graph(comm):
    """An allreduce captured in a CUDA graph and replayed with new inputs; calls captured on
    two streams of one graph that nothing else orders (as FSDP2's all-gather and reduce-scatter
    streams) replay one after another; a freed and reused torch block is read fresh."""
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
        _two_streams_in_one_graph(comm, c)
        for k in range(3):
            t = torch.full((1 << 18,), float(k + comm.rank), device="cuda")
            c.allreduce(t, out=t)
            want = sum(k + r for r in range(comm.size))
            assert (t == want).all().item(), (k, t[:4])
            del t
        c.synchronize()
    return "graph capture and replay ok"


def _two_streams_in_one_graph(comm, c, calls=4):
    """Calls on two side streams of one capture, each stream's alone in order: only the
    communicator's edges keep a replay from running a sum and a max side by side on a rank
    (kernels that would meet the peers' other call: a mismatch, or a wrong sum)."""
    import torch

    a, b = torch.zeros(1 << 12, device="cuda"), torch.zeros(1 << 12, device="cuda")
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    for s, x, op in ((sa, a, "sum"), (sb, b, "max")):  # warm up each call on its stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            c.allreduce(x, op, out=x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        sa.wait_stream(main)
        sb.wait_stream(main)
        for _ in range(calls):
            with torch.cuda.stream(sa):
                c.allreduce(a, "sum", out=a)
            with torch.cuda.stream(sb):
                c.allreduce(b, "max", out=b)
        main.wait_stream(sa)
        main.wait_stream(sb)
    n = comm.size
    for k in range(1, 4):
        a.fill_(k * (comm.rank + 1))
        b.fill_(k * (comm.rank + 1))
        graph.replay()
        torch.cuda.synchronize()
        want = k * sum(r + 1 for r in range(n)) * n ** (calls - 1)
        assert (a == want).all().item(), ("sum on stream a", k, a[:4], want)
        assert (b == k * n).all().item(), ("max on stream b", k, b[:4], k * n)


def rank_ipc_faults(comm, case):
    """mismatch: rank 0 reduces 1000 elements, the others 999. missing: the last rank skips
    the call. Every rank that calls must raise within the timeout (5 s here) and its
    communicator refuses further calls; a rank whose kernel found the cause names it, the
    others abandon the call because of it (a CommError that says so), as NCCL's abort does."""
    import cupy

    from cudampi.comm import Communicator
    from cudampi.errors import CommError, MismatchError

    _setup(comm, "cupy")
    skips = case == "missing" and comm.rank == comm.size - 1
    raised, wrong = "", []
    with Communicator(comm, path="ipc", config=_config("0", timeout="5")) as c:
        c.allreduce(cupy.ones(8, cupy.float32))
        c.synchronize()
        t0 = time.monotonic()
        if skips:
            time.sleep(8)  # past the others' timeout
        else:
            try:
                if case == "mismatch":
                    c.allreduce(cupy.ones(1000 if comm.rank == 0 else 999, cupy.float32))
                else:
                    c.allreduce(cupy.ones(1000, cupy.float32))
                c.synchronize()
                wrong.append(f"rank {comm.rank}: no error")
            except (CommError, MismatchError) as exc:
                took = time.monotonic() - t0
                raised = f"rank {comm.rank}: RAISED {type(exc).__name__} after {took:.1f} s: {exc}"
                want = MismatchError if case == "mismatch" else CommError
                abandoned = "because another rank's collective failed" in str(exc)
                if took >= 20 or not (isinstance(exc, want) or abandoned):
                    wrong.append(f"{raised} (want {want.__name__} within 20 s)")
                try:  # the communicator refuses further calls with the same error
                    c.allreduce(cupy.ones(8, cupy.float32))
                    wrong.append(f"rank {comm.rank}: a failed communicator accepted a call")
                except (CommError, MismatchError):
                    pass
    everyone = comm.allgather((raised, wrong))
    assert not [w for _, ws in everyone for w in ws], everyone
    out = "\n".join(r for r, _ in everyone)
    callers = comm.size if case == "mismatch" else comm.size - 1
    assert out.count("RAISED") == callers, out[-6000:]
    if case == "mismatch":
        assert "RAISED MismatchError" in out, out[-4000:]  # the cause, on a rank that found it
        assert "1000 elements" in out and "999 elements" in out, out[-4000:]
    else:
        assert "did not arrive" in out, out[-4000:]
    return f"raised on {callers} ranks"


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
    proc = run_mpi(2, __file__, "rank_ipc_killed", timeout=time_left(120), check=False, env=env)
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
    return "two communicators and a split agree"


def rank_ipc_registered(comm):
    """Large allreduces on the same tensors: after the first calls the peers address them in
    place (registered); in place and not, a segment given back (empty_cache) and made again.
    Then with 4 MiB data buffers (a 12 MiB call is one launch: three rounds through the buffers
    until every rank registered both tensors, then one round in place), and with half the
    ranks registering (CUDAMPI_IPC_REGISTER is each rank's own: rounds, some ranks read in
    place, some staged, some pushed into, some fetching)."""
    import torch

    from cudampi.comm import Communicator

    _setup(comm, "torch-cuda")
    n, size, rank = 3 << 20, comm.size, comm.rank
    registers = rank % 2 == 0
    settings = [
        ("as set", {}, True),
        ("4M buffers", {"ipc_bytes": "4M"}, True),
        ("4M buffers, half registering", {"ipc_bytes": "4M", "ipc_register": str(int(registers))}, registers),
    ]  # fmt: skip
    said = []
    for what, over, expect in settings:
        # 12 MiB runs two-shot (registration is for two-shot) whatever the ranks share
        cfg = _config("0", ipc_oneshot_bytes="512K", **over)
        with Communicator(comm, path="ipc", config=cfg) as c:
            for round_ in range(2 if not over else 1):
                x = torch.empty(n, device="cuda")
                y = torch.empty(n, device="cuda")
                for k in range(6):
                    x.fill_(k + rank)
                    c.allreduce(x, out=x)
                    assert (x == sum(k + r for r in range(size))).all().item(), (what, round_, k)
                    x.fill_(k * rank + 1)
                    c.allreduce(x, "max", out=y)
                    assert (y == k * (size - 1) + 1).all().item(), (what, round_, k)
                del x, y
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            c.synchronize()
            engine = next(e for e in c._engines.stream_ordered())
            assert (engine.registered_calls > 0) == expect, (what, engine.registered_calls)
            said.append(f"{what}: {engine.registered_calls}")
    return "registered calls: " + ", ".join(said)


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
    return f"hierarchical: checked {f.checked} results"


__all__ = ["gen", "to_lib"]


# ---------------------------------------------------------------------- point-to-point


def _fill(lib, n, dtype, seed):
    """n elements of dtype, distinct per seed (bytes that show a misplaced chunk)."""
    import numpy as np

    host = ((np.arange(n, dtype=np.int64) * 7919 + seed * 104729) % 251).astype(dtype)
    return to_lib(host, lib, dtype), host


def rank_ipc_p2p(comm, lib):
    """:func:`_p2p_matches` with a 64 KiB workspace (many chunks), then with the defaults."""
    return ", ".join(f"{_p2p_matches(comm, lib, small)} checked" for small in ("1", "0"))


def _p2p_matches(comm, lib, small):
    """sendrecv around the ring (to self too), blocking send/recv in pairs, a batch of
    isend/irecv with every peer, several messages of one pair in order (tags, any tag), a buffer
    at an odd offset; sizes from empty to past the eager size (many chunks with small=1)."""
    import numpy as np

    from cudampi.comm import Communicator

    _setup(comm, lib)
    n, me = comm.size, comm.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    f = Failures(me)
    sizes = (0, 1, 7, 1000, 100003) if small == "1" else (0, 1, 5, 4099, 1 << 20, 3 << 20)
    dtypes = ("float32", "float16", "int64", "uint8")
    with Communicator(comm, path="ipc", config=_config(small)) as c:
        for dt in dtypes:
            for size in sizes:
                x, _ = _fill(lib, size, dt, me)
                out = to_lib(np.zeros(size, dt), lib, dt)
                c.sendrecv(x, nxt, out, prv)
                f.check(same(out, _fill("numpy", size, dt, prv)[1], dt), f"ring {dt} {size}")
                c.sendrecv(x, me, out, me, tag=3)
                f.check(same(out, _fill("numpy", size, dt, me)[1], dt), f"self {dt} {size}")
        # blocking, in an order that cannot wait for ever: even ranks send first
        big = 5 << 20 if small == "0" else 300_000
        for size in (3, big):
            x, _ = _fill(lib, size, "uint8", me)
            out = to_lib(np.zeros(size, "uint8"), lib, "uint8")
            partner = me ^ 1
            if partner < n:
                if me % 2 == 0:
                    c.send(x, partner, tag=5)
                    c.recv(out, partner, tag=5)
                else:
                    c.recv(out, partner, tag=5)
                    c.send(x, partner, tag=5)
                want = _fill("numpy", size, "uint8", partner)[1]
                f.check(same(out, want, "uint8"), f"pairs {size}")
        # a batch: every rank sends every rank (itself too) two messages, both directions at once
        size = big
        outs, handles = {}, []
        for peer in range(n):
            for k in range(2):
                outs[peer, k] = to_lib(np.zeros(size, "float32"), lib, "float32")
                handles.append(c.irecv(outs[peer, k], peer, tag=10 + k))
        sends = [_fill(lib, size, "float32", 100 * me + k)[0] for k in range(2)]
        for peer in range(n):
            for k in range(2):
                handles.append(c.isend(sends[k], peer, 10 + k))
        for h in handles:
            h.wait()
        for (peer, k), got in outs.items():
            want = _fill("numpy", size, "float32", 100 * peer + k)[1]
            f.check(same(got, want, "float32"), f"batch from {peer} #{k}")
        # any tag, in order
        x, _ = _fill(lib, 64, "int32", me)
        out = to_lib(np.zeros(64, "int32"), lib, "int32")
        from mpi4py import MPI

        c.sendrecv(x, nxt, out, prv, tag=9)
        f.check(same(out, _fill("numpy", 64, "int32", prv)[1], "int32"), "tag 9")
        h = c.irecv(out, prv, MPI.ANY_TAG)
        c.send(x, nxt, tag=77)
        h.wait()
        f.check(same(out, _fill("numpy", 64, "int32", prv)[1], "int32"), "any tag")
        # after point-to-point, a collective on the same communicator is in order
        y = c.allreduce(to_lib(np.ones(1000, "float32"), lib, "float32"))
        f.check(same(y, np.full(1000, n, "float32"), "float32"), "allreduce after p2p")
        c.synchronize()
    f.finish()
    return f.checked


def rank_ipc_p2p_stream_graph(comm):
    """A send waits for the caller's stream (a slow fill before it is seen); a buffer at an
    odd offset; a sendrecv captured in a CUDA graph and replayed; torch's batch_isend_irecv
    through the cudampi backend (CUDAMPI_PATH=ipc)."""
    import torch
    import torch.distributed as dist

    from cudampi.comm import Communicator

    _setup(comm, "torch-cuda")
    n, me = comm.size, comm.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    with Communicator(comm, path="ipc") as c:
        base = torch.zeros((1 << 20) + 3, device="cuda")
        x = base[1:-2]
        out = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(200_000_000)
        x.fill_(me + 1)
        c.sendrecv(x, nxt, out, prv)
        assert (out == prv + 1).all().item(), out[:4]
        assert base[0].item() == 0 and base[-2:].abs().sum().item() == 0
        static_in = torch.zeros(1 << 16, device="cuda")
        static_out = torch.zeros(1 << 16, device="cuda")
        c.sendrecv(static_in, nxt, static_out, prv)  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.sendrecv(static_in, nxt, static_out, prv)
        for k in range(1, 4):
            static_in.fill_(k * 10 + me)
            graph.replay()
            torch.cuda.synchronize()
            assert (static_out == k * 10 + prv).all().item(), (k, static_out[:4])
        c.synchronize()
    from tests.mpi.test_torch_ddp import init

    init()
    send = torch.full((3 << 20,), float(me), device="cuda")
    recv = torch.zeros(3 << 20, device="cuda")
    ops = [dist.P2POp(dist.irecv, recv, prv), dist.P2POp(dist.isend, send, nxt)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert (recv == prv).all().item(), recv[:4]
    pg = dist.distributed_c10d._get_default_group()
    assert pg.communicator.path_for("send", send) == "ipc"
    pg.communicator.synchronize()
    dist.destroy_process_group()
    return "p2p stream order, graph and batch ok"


def _put(dst, host, lib):
    """Copy the NumPy array ``host`` into the device array (or view) ``dst``."""
    if lib == "torch-cuda":
        import torch

        dst.copy_(torch.from_numpy(host))
    else:
        import cupy

        dst[...] = cupy.asarray(host)


def rank_ipc_p2p_in_place(comm, lib):
    """:func:`_p2p_in_place` with the defaults, then with a 64 KiB workspace."""
    return ", ".join(_p2p_in_place(comm, lib, small) for small in ("0", "1"))


def _p2p_in_place(comm, lib, small):
    """Messages past the eager size on the same buffers: from the third round on, the receiver
    reads them in place (the engine counts it). Every round sends new bytes (nothing stale is
    read), at an odd offset every other round, and the sender overwrites its buffer as soon as
    the call returns (a send read in place ends only once read). Then a batch that mixes a send
    read in place with inbox messages to every peer; with torch, a segment given back and made
    again (a new registration), and a sendrecv captured in a CUDA graph and replayed."""
    import numpy as np

    from cudampi.comm import Communicator

    _setup(comm, lib)
    n, me = comm.size, comm.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    f = Failures(me)
    size = (5 << 20) + 3

    def data(k, rank, nbytes=size):
        return _fill("numpy", nbytes, "uint8", 1000 * k + rank)[1]

    with Communicator(comm, path="ipc", config=_config(small)) as c:
        x = to_lib(np.zeros(size + 16, "uint8"), lib, "uint8")
        out = to_lib(np.zeros(size + 16, "uint8"), lib, "uint8")
        for k in range(6):
            off = k % 2  # aligned (four loads in flight a thread), then byte by byte
            xs, os_ = x[off : off + size], out[off : off + size]
            _put(xs, data(k, me), lib)
            c.sendrecv(xs, nxt, os_, prv)
            _put(xs, np.full(size, 255, "uint8"), lib)
            f.check(same(os_, data(k, prv), "uint8"), f"round {k}")
        engine = next(e for e in c._engines.stream_ordered())
        f.check(engine.inplace_sends >= 4, f"{engine.inplace_sends} sends read in place of 6")
        # a batch: the large send to nxt (read in place) beside small messages with every peer
        small_out = {p: to_lib(np.zeros(1000, "uint8"), lib, "uint8") for p in range(n)}
        handles = [c.irecv(out[:size], prv, tag=4)]
        handles += [c.irecv(small_out[p], p, tag=5) for p in range(n)]
        _put(x[:size], data(7, me), lib)
        before = engine.inplace_sends
        handles.append(c.isend(x[:size], nxt, tag=4))
        tiny = to_lib(data(8, me, 1000), lib, "uint8")
        handles += [c.isend(tiny, p, tag=5) for p in range(n)]
        for h in handles:
            h.wait()
        f.check(engine.inplace_sends == before + 1, "the batch's large send read in place")
        f.check(same(out[:size], data(7, prv), "uint8"), "batch, large")
        for p in range(n):
            f.check(same(small_out[p], data(8, p, 1000), "uint8"), f"batch, small from {p}")
        if lib == "torch-cuda":
            import torch

            del x, out, xs, os_, handles, h  # (a receive's handle holds its buffer)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the registered segments go back to CUDA
            x = torch.zeros(size, dtype=torch.uint8, device="cuda")
            out = torch.zeros(size, dtype=torch.uint8, device="cuda")
            for k in range(4):
                _put(x, data(20 + k, me), lib)
                c.sendrecv(x, nxt, out, prv)
                f.check(same(out, data(20 + k, prv), "uint8"), f"new segment, round {k}")
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                c.sendrecv(x, nxt, out, prv)
            for k in range(3):
                _put(x, data(30 + k, me), lib)
                graph.replay()
                torch.cuda.synchronize()
                f.check(same(out, data(30 + k, prv), "uint8"), f"graph replay {k}")
        c.synchronize()
    f.finish()
    return f"sends read in place: {engine.inplace_sends}"


def rank_ipc_p2p_faults(comm, case):
    """size: rank 1 receives 200 bytes where rank 0 sends 100. tag: tag 1 sent, tag 2 received.
    missing: rank 1 receives, rank 0 never sends. bothsend: both ranks send 8 MiB first (past
    the eager size). inplace: rank 1 receives 6 MiB of a send of 8 MiB it reads in place.
    Every rank that calls raises within the timeout (5 s) with the cause."""
    import cupy

    from cudampi.comm import Communicator
    from cudampi.errors import CommError, MismatchError

    _setup(comm, "cupy")
    me = comm.rank
    raised, wrong = "", ""
    with Communicator(comm, path="ipc", config=_config("0", timeout="5")) as c:
        c.allreduce(cupy.ones(8, cupy.float32))
        c.synchronize()
        t0 = time.monotonic()
        if case == "missing" and me == 0:
            time.sleep(8)  # skips the call, past rank 1's timeout
        else:
            try:
                _p2p_fault(c, case, me)
                c.allreduce(cupy.ones(8, cupy.float32))  # the sender learns of it here
                c.synchronize()
                wrong = f"rank {me}: no error"
            except (CommError, MismatchError) as exc:
                took = time.monotonic() - t0
                raised = f"rank {me}: RAISED {type(exc).__name__} after {took:.1f} s: {exc}"
                wrong = "" if took < 20 else f"{raised} (not within 20 s)"
    everyone = comm.allgather((raised, wrong))
    assert not [w for _, w in everyone if w], everyone
    out = "\n".join(r for r, _ in everyone)
    callers = 1 if case == "missing" else 2
    assert out.count("RAISED") == callers, out[-6000:]
    if case in ("size", "tag", "inplace"):
        assert "RAISED MismatchError" in out and "match in the order" in out, out[-4000:]
        assert ("200 bytes" in out and "100 bytes" in out) or case != "size", out[-4000:]
        assert f"{8 << 20} bytes" in out or case != "inplace", out[-4000:]
    else:
        assert "did not make the matching" in out, out[-4000:]
    if case == "bothsend":
        assert "use sendrecv" in out, out[-4000:]
    return f"raised on {callers} rank(s)"


def _p2p_fault(c, case, me):
    """The calls of fault ``case`` (:func:`rank_ipc_p2p_faults`) on rank ``me``."""
    import cupy

    if case == "size":
        if me == 0:
            c.send(cupy.ones(100, cupy.uint8), 1)
        else:
            c.recv(cupy.ones(200, cupy.uint8), 0)
    elif case == "tag":
        if me == 0:
            c.send(cupy.ones(100, cupy.uint8), 1, tag=1)
        else:
            c.recv(cupy.ones(100, cupy.uint8), 0, tag=2)
    elif case == "missing":
        c.recv(cupy.ones(100, cupy.uint8), 0)
    elif case == "inplace":
        # 8 MiB sent on one buffer until rank 1 reads it in place, then rank 1 receives
        # 6 MiB: the size is checked on a send read in place too
        big, into = cupy.ones(8 << 20, cupy.uint8), cupy.empty(8 << 20, cupy.uint8)
        for _ in range(3):
            c.sendrecv(big, 1 - me, into, 1 - me)
            c.synchronize()
        if me == 0:
            c.send(big, 1)
        else:
            c.recv(into[: 6 << 20], 0)
    else:
        big = cupy.ones(8 << 20, cupy.uint8)
        c.send(big, 1 - me)
        c.recv(big, 1 - me)


def checks() -> list[Check]:
    """Every check of this file, in the order its jobs run them (one job per rank count): the
    collectives, then point-to-point, then the faults (a failed communicator is the last thing
    a job makes)."""
    libs = _libs()
    torch = None if importlib.util.find_spec("torch") else "needs torch"
    ipc = (("CUDAMPI_PATH", "ipc"),)
    # Time-sliced ranks (no MPS, more ranks than GPUs) wait a slice for each other at every
    # step of every call: there the matrix takes SLICED_DTYPES, the other checks their smaller
    # rank counts and hierarchical one library; the code paths are the same (the full set runs
    # with MPS or a GPU per rank).
    out = []
    for n in (2, 3, 4):
        for lib in libs:
            name = f"every_collective_dtype_and_op_matches_numpy[{lib}-{n}]"
            if not time_sliced(n):
                out.append(Check(name, rank_ipc_matrix, (lib,), ranks=n, timeout=900))
            elif n < 4:
                out.append(Check(name, rank_ipc_matrix, (lib, SLICED_DTYPES), ranks=n))
    for n in (2, 4):
        name = f"odd_offsets_stream_order_and_same_bits[{n}]"
        out.append(Check(name, rank_ipc_odd_and_order, ranks=n, skip=torch))
    for n in (2, 3):
        name = f"cuda_graph_capture_and_replay[{n}]"
        out.append(Check(name, rank_ipc_graph, ranks=n, skip=torch))
    out.append(Check("several_communicators_and_splits", rank_ipc_check_same, ranks=4))
    for n in (2, 3):
        name = f"registered_buffers_in_place_and_reused[{n}]"
        out.append(Check(name, rank_ipc_registered, ranks=n, skip=torch))
    for lib in libs[-1:] if time_sliced(4) else libs:
        name = f"hierarchical_across_two_pretend_nodes[{lib}]"
        out.append(Check(name, rank_ipc_hier, (lib,), ranks=4, timeout=600))
    for n in (2, 3, 4):
        for lib in libs:
            name = f"point_to_point_matches_what_was_sent[{lib}-{n}]"
            out.append(Check(name, rank_ipc_p2p, (lib,), ranks=n, timeout=600))
    for n in (2, 3):
        name = f"point_to_point_stream_order_graph_and_torch_batch[{n}]"
        out.append(Check(name, rank_ipc_p2p_stream_graph, ranks=n, env=ipc, skip=torch))
    for n in (2,) if time_sliced(3) else (2, 3):
        for lib in libs:
            name = f"point_to_point_large_messages_are_read_in_place[{lib}-{n}]"
            out.append(Check(name, rank_ipc_p2p_in_place, (lib,), ranks=n))
    for case in ("mismatch", "missing"):
        name = f"mismatch_and_missing_rank_raise_on_every_rank[{case}]"
        out.append(Check(name, rank_ipc_faults, (case,), ranks=3, timeout=120))
    for case in ("size", "tag", "missing", "bothsend", "inplace"):
        name = f"point_to_point_faults_raise_on_every_rank[{case}]"
        out.append(Check(name, rank_ipc_p2p_faults, (case,), ranks=2, timeout=120))
    return out


@pytest.mark.parametrize("check", params(checks()))
def test_check(check, gpu_jobs):
    gpu_jobs.verify(check)
