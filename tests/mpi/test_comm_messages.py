"""Repeated point-to-point messages on the same arrays (cudampi.comm.repeat's short path): the
data is read and written afresh every message, and everything the full path checks or decides
is checked and decided again as soon as it could have changed."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi


def rank_repeated_messages(comm, lib):
    import gc

    import numpy as np
    from mpi4py import MPI

    from cudampi.comm import Communicator
    from cudampi.config import Config
    from cudampi.errors import CommError, CommTimeoutError

    r, peer = comm.rank, 1 - comm.rank

    from tests.mpi.test_comm_collectives import checks

    def make(n, value, dtype="float32"):
        return checks(lib).from_numpy(np.full(n, value, dtype=dtype), dtype)

    def values(a):
        return checks(lib).to_numpy(a)  # a view: fill() writes through it

    def fill(a, value):
        values(a)[...] = value

    def expect(a, value, where):
        got = values(a)
        assert (got == value).all(), f"rank {r} {where}: {got[:4]} ..., want {value}"

    def exchange(x, y, tag, *, path=None):
        """Blocking send/recv both ways (rank 0 sends first)."""
        if r == 0:
            c.send(x, peer, tag, path=path)
            c.recv(y, peer, tag)
        else:
            c.recv(y, peer, tag)
            c.send(x, peer, tag, path=path)

    # 64-byte chunks: a staged sender's 1 KiB message is a chunk sequence
    config = Config.load({"chunk_bytes": "64", "timeout": "2"}, env={})
    x, y = make(64, 0), make(64, -1)  # (the first imports the library: seconds on a busy host)
    with Communicator(comm, config=config) as c:
        # both ranks start the clock together: the 2 s deadline is for the calls, not for a
        # rank still importing torch (that failed CI once)
        comm.Barrier()
        # the same buffers, new contents every message, every kind of call
        for i in range(4):
            fill(x, 100 * r + i)
            exchange(x, y, 1)
            expect(y, 100 * peer + i, f"send/recv #{i}")
            fill(x, 100 * r + 10 + i)
            h = c.irecv(y, peer, 2)
            c.isend(x, peer, 2).wait()
            assert h.wait() is y
            expect(y, 100 * peer + 10 + i, f"isend/irecv #{i}")
            fill(x, 100 * r + 20 + i)
            assert c.sendrecv(x, peer, y, peer, 3) is y
            expect(y, 100 * peer + 20 + i, f"sendrecv #{i}")
            fill(x, 100 * r + 30 + i)  # from any rank
            if r == 0:
                c.send(x, peer, 4)
                c.recv(y, MPI.ANY_SOURCE, 4)
            else:
                c.recv(y, MPI.ANY_SOURCE, 4)
                c.send(x, peer, 4)
            expect(y, 100 * peer + 30 + i, f"recv from any source #{i}")
        assert len(c._messages) == 2, "one entry for x sent, one for y received"
        del h  # (it holds y, its result)

        # each buffer replaced by a new one of the same shape (the old one freed: CPython may
        # give the new one its id)
        for i in range(3):
            x, y = make(64, 100 * r + 50 + i), make(64, -1)
            exchange(x, y, 1)
            expect(y, 100 * peer + 50 + i, f"new buffers #{i}")
        gc.collect()
        assert len(c._messages) == 2, "a freed buffer's entry stays"

        # a staged sender's chunk sequence into a buffer received into before
        big, got = make(256, 0), make(256, -1)
        for i in range(3):
            fill(big, 100 * r + 60 + i)
            exchange(big, got, 5, path="staged")
            expect(got, 100 * peer + 60 + i, f"chunked send/recv #{i}")
            fill(big, 100 * r + 70 + i)
            h = c.irecv(got, peer, 6)
            c.isend(big, peer, 6, path="staged").wait()
            h.wait()
            expect(got, 100 * peer + 70 + i, f"chunked isend/irecv #{i}")
            fill(big, 100 * r + 80 + i)
            c.sendrecv(big, peer, got, peer, 7, path="staged")
            expect(got, 100 * peer + 80 + i, f"chunked sendrecv #{i}")

        # what the full path refuses, under the same array object, is refused again
        def refused(call, *words):
            try:
                call()
            except CommError as exc:
                assert all(w in str(exc) for w in words), (words, exc)
            else:
                raise AssertionError(f"rank {r}: took it (want an error with {words})")

        if lib == "numpy":
            y.flags.writeable = False  # received into above: remembered writable
            refused(lambda: c.recv(y, peer, 8), "read-only")
            refused(lambda: c.irecv(y, peer, 8), "read-only")
            refused(lambda: c.sendrecv(x, peer, y, peer, 8), "out:", "read-only")
            y.flags.writeable = True
            exchange(x, y, 8)
            expect(y, 100 * peer + 52, "writable again")
            x.dtype = np.dtype("U1")  # same object, same bytes, a dtype MPI does not move
            refused(lambda: c.send(x, peer, 8), "dtype", "not supported")
            x.dtype = np.dtype("float32")
        else:
            y.as_strided_((32,), (2,))  # same object and data pointer, not contiguous now
            refused(lambda: c.recv(y, peer, 8), "not contiguous")
            y.as_strided_((64,), (1,))
        exchange(x, y, 9)
        expect(y, 100 * peer + 52, "after the refusals")

        # a rank that does not exist: the full path's error, then the same again
        z = make(4, 1)
        errors = []
        for _ in range(2):
            try:
                c.send(z, comm.size + 3, 1)
            except Exception as exc:
                errors.append((type(exc), str(exc)))
        assert len(errors) == 2 and errors[0] == errors[1], errors

        # the deadline ends a repeated wait on a peer that never sends, naming the message
        comm.Barrier()
        if r == 0:
            for call, what in (
                (lambda: c.recv(y, peer, 90), "recv from rank 1 (tag 90)"),
                (lambda: c.irecv(y, peer, 91).wait(), "irecv from rank 1 (tag 91)"),
            ):
                try:
                    call()
                except CommTimeoutError as exc:
                    assert what in str(exc) and "within 2 s" in str(exc), exc
                    assert "CUDAMPI_TIMEOUT" in str(exc), exc
                else:
                    raise AssertionError(f"{what}: no timeout")
        comm.Barrier()
    if r == 0:
        print(f"repeated messages ok ({lib})", flush=True)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_repeated_messages_move_fresh_data_and_keep_every_check(lib):
    proc = run_mpi(2, __file__, "rank_repeated_messages", lib, timeout=120)
    assert f"repeated messages ok ({lib})" in proc.stdout


def rank_messages_reach_the_chosen_engine(comm):
    """A repeated message goes to the engine the full path chose for it (path='ipc' to the
    ipc engine: here a stand-in that records), with the array's own memory, as the first did;
    a stream-ordered engine's messages skip the caller-stream wait as before."""
    import numpy as np

    from cudampi.comm import Communicator, PathChoice
    from cudampi.comm.engines import KINDS, Engine
    from cudampi.comm.handle import completed

    seen = []

    class Recorder(Engine):
        name = "recorder"
        stream_ordered = True

        def send(self, f, dest, tag):
            seen.append(("send", self, f, dest, tag))

        def recv(self, f, source, tag):
            seen.append(("recv", self, f, source, tag))

        def isend(self, f, dest, tag):
            seen.append(("isend", self, f, dest, tag))
            return completed("isend")

        def irecv(self, f, source, tag):
            seen.append(("irecv", self, f, source, tag))
            return completed("irecv")

        def sendrecv(self, xf, dest, of, source, tag):
            seen.append(("sendrecv", self, xf, dest, tag))

    KINDS["recorder"] = Recorder
    try:
        c = Communicator(comm)
        real_choose, full = c._choose, [0]

        def choose(call, b, path, nbytes=None):
            full[0] += 1
            if path == "ipc":
                return PathChoice("ipc", "test", "recorder")
            return real_choose(call, b, path, nbytes)

        c._choose = choose
        x, y = np.arange(8.0), np.zeros(8)
        for i in range(3):
            c.send(x, 5, 10 + i, path="ipc")
            c.recv(y, 6, 20 + i, path="ipc")
            assert c.isend(x, 5, 30 + i, path="ipc").wait() is None
            assert c.irecv(y, 6, 40 + i, path="ipc").wait() is y
            c.sendrecv(x, 5, y, 6, 50 + i, path="ipc")
        assert full[0] == 2, f"the path was chosen {full[0]} times (once per buffer and kind)"
        assert len(seen) == 15
        engines = {id(e) for _, e, _, _, _ in seen}
        assert len(engines) == 1, "one ipc engine for every message"
        for call, _, f, peer, tag in seen:
            want = x if call in ("send", "isend", "sendrecv") else y
            assert f.shape == (8,) and np.shares_memory(f, want), (call, tag)
            assert peer == (5 if want is x else 6) and tag % 10 in (0, 1, 2), (call, tag)
        # the default path is a different choice, and its own entry
        c.send(np.zeros(1), comm.rank, 99)
        c.recv(np.zeros(1), comm.rank, 99)
        assert len(seen) == 15 and full[0] == 4
        c.close()
    finally:
        del KINDS["recorder"]
    print("messages reach the chosen engine", flush=True)


def test_repeated_messages_reach_the_engine_the_full_path_chose():
    proc = run_mpi(1, __file__, "rank_messages_reach_the_chosen_engine", timeout=60)
    assert "messages reach the chosen engine" in proc.stdout


def rank_message_misuse(comm):
    """What MPI reports as a bare error class (MPI_ERR_RANK, MPI_ERR_TAG, MPI_ERR_TRUNCATE,
    MPI_ERR_COMM) or mpi4py as a conversion error is a CommError that names the call and the
    value; split takes NumPy integers and refuses colors past a C int by name."""
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.errors import CommError

    r, peer = comm.rank, 1 - comm.rank
    said = []

    def refused(what, call, *words):
        try:
            call()
        except CommError as exc:
            ok = all(w in str(exc) for w in words)
            said.append(f"{what}: {'ok' if ok else 'WRONG'}: {exc}")
        except Exception as exc:
            said.append(f"{what}: WRONG: {type(exc).__name__}: {exc}")
        else:
            said.append(f"{what}: WRONG: no error")

    c = Communicator(comm)
    x = np.ones(8)
    refused("dest=-1", lambda: c.send(x, -1), "send: dest=-1 is not a rank", "(0..1)")
    refused("dest=size", lambda: c.send(x, 2), "send: dest=2 is not a rank")
    refused("isend dest", lambda: c.isend(x, 7), "isend: dest=7")
    refused("source", lambda: c.recv(x, 5), "recv: source=5", "MPI.ANY_SOURCE")
    refused("tag=-5", lambda: c.send(x, peer, tag=-5), "send: tag=-5 is not a tag")
    refused("irecv tag", lambda: c.irecv(x, peer, tag=2**40), f"irecv: tag={2**40}")
    refused("sendrecv dest", lambda: c.sendrecv(x, 9, x.copy(), peer), "sendrecv: dest=9")
    refused("split(2**40)", lambda: c.split(2**40), f"split: color={2**40}", "0..2147483647")
    refused("split key", lambda: c.split(0, key=2**40), "split: key=")
    sub = c.split(np.int64(1), key=np.int32(r))
    assert sub is not None and sub.size == 2, "split takes NumPy integers"
    sub.close()
    comm.Barrier()
    if r == 0:  # a receive smaller than the message, blocking and not
        refused("recv smaller", lambda: c.recv(np.empty(4), 1, 3), "recv from rank 1 (tag 3)",
                "larger than the receive buffer (32 bytes)")  # fmt: skip
        h = c.irecv(np.empty(2), 1, 4)
        refused("irecv smaller", h.wait, "irecv from rank 1 (tag 4)", "larger than the receive")
    else:
        c.send(np.ones(8), 0, 3)
        c.send(np.ones(8), 0, 4)
    comm.Barrier()
    c.close()
    refused("send after close", lambda: c.send(x, peer), "send: this Communicator was closed")
    refused("recv after close", lambda: c.recv(x, peer), "recv: this Communicator was closed")
    wrong = [s for s in said if ": ok: " not in s]
    assert not wrong, f"rank {r}:\n" + "\n".join(wrong)
    print(f"rank {r}: {len(said)} misuses refused by name", flush=True)


def test_message_misuse_names_the_call_and_the_value():
    proc = run_mpi(2, __file__, "rank_message_misuse", timeout=120)
    assert "rank 0: 13 misuses refused by name" in proc.stdout, proc.stdout
