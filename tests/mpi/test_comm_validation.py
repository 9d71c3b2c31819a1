"""Bad input raises a clear error on EVERY rank (no hang, no corruption), and the communicator
keeps working afterwards. NumPy only, so these spawns are cheap."""

from __future__ import annotations

from functools import partial

import pytest

from tests.mpirun import only_when_asked, run_mpi

pytestmark = pytest.mark.mpi


def _expect(c, fn, cls, *words):
    """Run ``fn`` on every rank; every rank must raise ``cls`` mentioning ``words``; then a
    correct allreduce proves the ranks are still in step."""
    import numpy as np

    try:
        fn()
    except cls as exc:
        msg = str(exc)
        for w in words:
            assert w in msg, f"rank {c.rank}: {w!r} not in {msg!r}"
    else:
        raise AssertionError(f"rank {c.rank}: no {cls.__name__} from {fn}")
    got = c.allreduce(np.ones(4, dtype=np.int32))
    assert got.tolist() == [c.size] * 4, "ranks out of step after the error"


def rank_mismatch(comm, debug):
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.config import Config
    from cudampi.errors import CommError, MismatchError

    r, last = comm.rank, comm.size - 1
    cfg = Config.load({"debug": debug == "1", "small_bytes": "64", "chunk_bytes": "32"}, env={})
    c = Communicator(comm, config=cfg)
    for path in ("host", "gpu-ring", "staged"):
        n = 10 + (r == last)
        _expect(
            c, partial(c.allreduce, np.ones(n), path=path), MismatchError, "count", f"rank {last}"
        )
        dt = np.float64 if r != last else np.float32
        _expect(
            c,
            partial(c.allreduce, np.ones(8, dtype=dt), path=path),
            MismatchError,
            "dtype",
            "float32",
            "float64",
        )
        op = "max" if r == last else "sum"
        _expect(c, partial(c.allreduce, np.ones(8), op, path=path), MismatchError, "op")
        root = 0 if r != last else last
        _expect(c, partial(c.broadcast, np.ones(8), root=root, path=path), MismatchError, "root")
        _expect(c, partial(c.reduce, np.ones(300), root=root, path=path), MismatchError, "root")
        # a non-contiguous array on one rank: that rank says why, the others name it
        a = np.ones((8, 4))[:, ::2] if r == last else np.ones((8, 2))
        _expect(c, partial(c.allreduce, a, path=path), CommError, "contiguous")
        _expect(
            c,
            partial(c.allreduce, np.ones(3), "mean" if r == last else "sum", path=path),
            CommError,
            "mean",
        )
        rc = [2] * comm.size if r != last else [1] * (comm.size - 1) + [comm.size + 1]
        _expect(
            c,
            partial(c.reduce_scatter, np.ones(2 * comm.size), counts=rc, path=path),
            MismatchError,
            "counts",
        )
        # alltoall whose recv_counts do not match what the senders send
        sc = [1] * comm.size
        rcv = [1] * comm.size if r != last else [2] + [1] * (comm.size - 1)
        _expect(
            c,
            partial(c.alltoall, np.ones(comm.size), send_counts=sc, recv_counts=rcv, path=path),
            MismatchError,
            "recv_counts",
        )
        # different collectives at the same point
        if r == last:
            _expect(
                c,
                partial(c.broadcast, np.ones(4), path=path),
                MismatchError,
                "different collectives",
            )
        else:
            _expect(
                c,
                partial(c.allreduce, np.ones(4), path=path),
                MismatchError,
                "different collectives",
            )
        # the path differs between ranks
        p2 = "gpu-ring" if r == last else "host"
        _expect(c, partial(c.allreduce, np.ones(4), path=p2), MismatchError, "path")
        # non-blocking: the error comes out of wait() on every rank
        h = c.allreduce(np.ones(5 + (r == last)), path=path, async_op=True)
        _expect(c, partial(h.wait, timeout=60), MismatchError, "count")
        # same element count, different shape: only the debug check sees it; the cheap one
        # lets it run (the data is the same either way)
        shape = (2, 3) if r == last else (3, 2)
        if debug == "1":
            _expect(c, partial(c.allreduce, np.ones(shape), path=path), MismatchError, "shape")
        else:
            assert c.allreduce(np.ones(shape), path=path).sum() == 6 * comm.size
    # the out array must fit
    _expect(c, partial(c.allreduce, np.ones(4), out=np.ones(5)), CommError, "out")
    _expect(
        c, partial(c.allreduce, np.ones(4), out=np.ones(4, dtype=np.float32)), CommError, "dtype"
    )
    _expect(c, partial(c.broadcast, np.ones(4), root=comm.size), CommError, "root")
    _expect(c, partial(c.allreduce, "not an array"), CommError, "not an array")
    _expect(
        c,
        partial(c.allreduce, np.ones(3, dtype=np.float32), "band"),
        CommError,
        "not defined for float32",
    )
    c.close()
    # ranks configured with different large-message algorithms would exchange different
    # messages: refused on every rank when the communicator is made
    algo = Config.load(
        {"algorithm": "direct" if r == last else "ring", "small_bytes": "64"}, env={}
    )
    try:
        Communicator(comm, config=algo)
    except MismatchError as exc:
        assert "algorithm" in str(exc) and "CUDAMPI_ALGORITHM" in str(exc), exc
    else:
        raise AssertionError("no MismatchError for different algorithms")
    comm.Barrier()
    if r == 0:
        print(f"mismatch checks passed on {comm.size} ranks")


@pytest.mark.parametrize("n,debug", [(2, "0"), (3, "0"), (3, "1")])
def test_mismatched_or_bad_input_raises_on_every_rank(n, debug):
    proc = run_mpi(n, __file__, "rank_mismatch", debug, timeout=180)
    assert f"passed on {n} ranks" in proc.stdout


def rank_env_and_probe_cache(comm, cache_dir):
    """CUDAMPI_PATH and CUDAMPI_DEBUG from the environment; capabilities from the probe cache."""
    import os

    import numpy as np
    from mpi4py import MPI

    from cudampi.comm import Communicator
    from cudampi.config import Config
    from cudampi.errors import MismatchError
    from cudampi.probe import capabilities as capmod

    assert os.environ["CUDAMPI_PATH"] == "staged" and os.environ["CUDAMPI_DEBUG"] == "1"
    with Communicator(comm) as c:
        assert c.config.debug and c.config.path == "staged"
        choice = c.path_for("allreduce", np.ones(4))
        assert choice == "staged" and choice.engine == "staged", (choice, choice.reason)
        assert c.capabilities is None and not c.device_support.p2p
        got = c.allreduce(np.full(1000, comm.rank, dtype=np.int32))
        assert (got == sum(range(comm.size))).all()
        # a per-call path wins over the environment
        assert c.path_for("allreduce", np.ones(4)) == "staged"
        shape = (2, 3) if comm.rank == 0 else (3, 2)
        try:
            c.allreduce(np.ones(shape), path="host")
        except MismatchError as exc:
            assert "shape" in str(exc)
        else:
            raise AssertionError("CUDAMPI_DEBUG=1 must compare shapes")
    # a probe result for this very stack on this host is read; what it proved drives the path
    if comm.rank == 0:
        capmod.save(cache_dir, _entry(capmod, MPI, device_p2p={"status": "crash", "detail": "t"}))
    comm.Barrier()
    cfg = Config.load({"cache_dir": cache_dir}, env={})
    with Communicator(comm, config=cfg) as c:
        assert c.capabilities is not None and c.capabilities.device_p2p.status == "crash"
        assert not c.device_support.p2p and "found device point-to-point crash" in (
            c.device_support.p2p_why
        )
    if comm.rank == 0:
        print("env and cache ok")


def test_env_settings_and_probe_cache_drive_the_path(tmp_path):
    proc = run_mpi(
        2,
        __file__,
        "rank_env_and_probe_cache",
        str(tmp_path / "cache"),
        env={
            "CUDAMPI_PATH": "staged",
            "CUDAMPI_DEBUG": "1",
            "CUDAMPI_CACHE_DIR": str(tmp_path / "empty"),
        },
        timeout=120,
    )
    assert "env and cache ok" in proc.stdout


def _entry(capmod, MPI, **fields):
    """A cache entry of this rank's very stack on this host."""
    import os
    import socket

    lib = MPI.Get_library_version()
    base = capmod.Capabilities(
        key=capmod.stack_key(lib, os.environ),
        mpi_library=lib,
        host_staged=capmod.ProbeOutcome("ok"),
        host=socket.gethostname(),
        env=capmod.stack_env(os.environ),
    )
    return capmod.Capabilities.from_json({**base.to_json(), **fields})


def write_bad_entry(comm, cache_dir, kind):
    """Rank 0 files a bad entry where this stack's entry is looked up; every rank waits."""
    import json
    import os
    import socket
    from pathlib import Path

    from mpi4py import MPI

    from cudampi.probe import capabilities as capmod

    if comm.rank == 0:
        lib = MPI.Get_library_version()
        key = capmod.stack_key(lib, os.environ)
        entry = {
            "key": key,
            "mpi_library": lib,
            "host": socket.gethostname(),
            "env": capmod.stack_env(os.environ),
        }
        if kind == "wrong-type":
            entry["device_p2p"] = "ok"
        else:  # claims device p2p for another library (and a GPU this host does not have)
            entry.update(
                mpi_library="MPICH Version: 5.0.2",
                device_p2p={"status": "ok", "detail": "", "gbps": 900.0},
                gpu="NVIDIA H200",
            )
        # filed under this host's name and under the bare key (older cudampi's place for it)
        names = [f"{key}@{socket.gethostname()}", key]
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        (Path(cache_dir) / "capabilities.json").write_text(json.dumps(dict.fromkeys(names, entry)))
    comm.Barrier()
    assert os.environ["CUDAMPI_CACHE_DIR"] == cache_dir


def rank_bad_cache_entry(comm, cache_dir, kind):
    """A cache entry with a wrong-typed field or of another stack: the Communicator and the torch
    backend ignore it, say so (a warning on rank 0 and in the path's reason) and work."""
    import warnings

    import numpy as np

    from cudampi.comm import Communicator

    write_bad_entry(comm, cache_dir, kind)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Communicator(comm) as c:
            assert c.capabilities is None and not c.device_support.p2p
            why = c.device_support.p2p_why
            assert "was ignored" in why and "cudampi doctor" in why, why
            assert ("'device_p2p' must be an object" if kind == "wrong-type" else "MPICH") in why
            got = c.allreduce(np.full(8, comm.rank + 1.0))
            assert got.tolist() == [comm.size * (comm.size + 1) / 2] * 8
    said = [str(w.message) for w in seen if "was ignored" in str(w.message)]
    assert len(said) == (1 if comm.rank == 0 else 0), said
    import torch
    import torch.distributed as dist

    import cudampi.torch  # noqa: F401

    dist.init_process_group("cudampi")
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [float(comm.size)] * 4
    dist.destroy_process_group()
    if comm.rank == 0:
        print(f"bad entry {kind} ignored", flush=True)


@pytest.mark.parametrize(
    "kind", ["wrong-type", pytest.param("other-library", marks=only_when_asked())]
)
def test_a_bad_cache_entry_is_ignored_and_said(tmp_path, kind):
    cache = str(tmp_path / "cache")
    env = {"CUDAMPI_CACHE_DIR": cache}
    proc = run_mpi(2, __file__, "rank_bad_cache_entry", cache, kind, env=env, timeout=180)
    assert f"bad entry {kind} ignored" in proc.stdout


# --- settings that change what a rank sends, agreed at creation ----------------------------


def rank_settings_differ(comm, name, a, b):
    """Rank 0 has ``CUDAMPI_<NAME>=a``, the others ``b``: making the Communicator raises a
    MismatchError on every rank naming the setting, before any call could run with ranks that
    chunk or check differently (before: wrong data, a raw MPI error, a double free or a hang)."""
    import os

    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.errors import MismatchError

    var = f"CUDAMPI_{name.upper()}"
    os.environ[var] = a if comm.rank == 0 else b
    try:
        c = Communicator(comm)
    except MismatchError as exc:
        assert name in str(exc) and var in str(exc), exc
        comm.Barrier()
        if comm.rank == 0:
            print(f"{name} mismatch refused on every rank", flush=True)
        return
    # what happened before: calls ran with the ranks' different settings
    for dtype in ("float16", "float32"):
        for n in (10_000, 20_000):
            x = np.full(n, comm.rank + 1, dtype=dtype)
            got = c.allreduce(x)
            wrong = int((got != comm.size * (comm.size + 1) // 2).sum())
            assert wrong == 0, f"{wrong} of {n} {dtype} elements wrong with {var} differing"
    c.allreduce(np.ones(300_000, dtype=np.float16), path="gpu-ring")
    raise AssertionError(f"{var} differs between ranks and nothing said so")


@pytest.mark.parametrize(
    ("n", "name", "a", "b"),
    [
        (2, "small_bytes", "1K", "256K"),
        (3, "small_bytes", "1K", "256K"),
        (2, "chunk_bytes", "64K", "4M"),
        (2, "algorithm", "ring", "direct"),
        (2, "debug", "1", "0"),
        (2, "path", "staged", "host"),
    ],
)
def test_settings_that_differ_between_ranks_are_refused_on_every_rank(n, name, a, b):
    proc = run_mpi(n, __file__, "rank_settings_differ", name, a, b, timeout=90)
    assert f"{name} mismatch refused on every rank" in proc.stdout


# --- outputs that must not be written -----------------------------------------------------


def rank_read_only_outputs(comm, tmp):
    """A broadcast into a read-only view of ``bytes`` must not change the ``bytes``; a read-only
    memory map as ``out`` must not segfault: every rank raises a CommError instead."""
    import os

    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.errors import CommError

    data = bytes(range(16)) * 4
    view = np.frombuffer(data, dtype=np.uint8)  # read-only: it shares the immutable bytes
    path = os.path.join(tmp, f"ro-{comm.rank}.bin")
    np.arange(64, dtype=np.uint8).tofile(path)
    ro = np.memmap(path, dtype=np.uint8, mode="r", shape=(64,))
    with Communicator(comm) as c:
        src = np.full(64, 200, dtype=np.uint8)
        _expect(c, lambda: c.broadcast(src if comm.rank == 0 else view), CommError, "read-only")
        assert data == bytes(range(16)) * 4, "the immutable bytes changed"
        _expect(c, lambda: c.allreduce(np.ones(64, np.uint8), out=ro), CommError, "read-only")
        _expect(c, lambda: c.allreduce(view, out=view), CommError, "read-only")  # in place
        assert data == bytes(range(16)) * 4, "the immutable bytes changed"
        _expect(c, lambda: c.allgather(np.ones(1, np.uint8), out=ro[: comm.size]), CommError)
        try:
            c.recv(view, source=(comm.rank + 1) % comm.size)
        except CommError as exc:
            assert "read-only" in str(exc), exc
        else:
            raise AssertionError("recv into a read-only array")
    if comm.rank == 0:
        print("read-only outputs refused", flush=True)


def test_read_only_outputs_are_refused_on_every_rank(tmp_path):
    proc = run_mpi(2, __file__, "rank_read_only_outputs", str(tmp_path), timeout=90)
    assert "read-only outputs refused" in proc.stdout


# --- Communicator.split with a bad color on one rank --------------------------------------


def rank_bad_split_color(comm, color):
    from cudampi.comm import Communicator
    from cudampi.errors import CommError

    bad = {"negative": -5, "float": 1.5, "text": "a"}[color]
    with Communicator(comm) as c:
        _expect(
            c,
            lambda: c.split(bad if comm.rank == comm.size - 1 else 0),
            CommError,
            "color",
        )
        sub = c.split(comm.rank % 2)
        assert sub is not None
        sub.close()
    if comm.rank == 0:
        print("bad color refused on every rank", flush=True)


@pytest.mark.parametrize("color", ["negative", "float", "text"])
def test_a_bad_split_color_on_one_rank_raises_on_every_rank(color):
    proc = run_mpi(3, __file__, "rank_bad_split_color", color, timeout=90)
    assert "bad color refused on every rank" in proc.stdout
