"""The ipc workspace's host side without a GPU: how posted sends and receives are grouped and
launched, and what its errors say (the kernels write the error record; these tests write it)."""

from __future__ import annotations

import numpy
import pytest

from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
from cudampi.comm.ipc.workspace import ERROR_DTYPE, Workspace, _Group
from cudampi.errors import CommError, MismatchError


def workspace(rank: int = 0, size: int = 2) -> tuple[Workspace, list[tuple[str, int, int]]]:
    """A Workspace with its CUDA parts left out: launches are recorded as (kernel, stream,
    number of ops or launches)."""
    ws = object.__new__(Workspace)
    ws.rank, ws.size, ws.capacity, ws.timeout = rank, size, 32 << 20, 5.0
    ws.ptr = ws.err_ptr = 0
    ws.calls = ws.launches = 0
    ws._error, ws._closed, ws._group = None, False, _Group()
    ws.err = numpy.zeros(1, ERROR_DTYPE)[0]
    launched: list[tuple[str, int, int]] = []

    def record(launches: list[plan.Launch], kernels: dict[str, str], stream: int) -> None:
        for lc in launches:
            many = int(lc.params[L.P2P_NOPS_AT]) if lc.kernel == "p2p" else len(launches)
            launched.append((kernels[lc.kernel], stream, many))

    ws._launch = record  # type: ignore[method-assign]
    return ws, launched


def message(send: bool, peer: int = 1, tag: int = 0) -> plan.Message:
    return plan.Message(send, peer, 1 << 40, 64, tag)


def test_posted_messages_launch_as_one_group_at_the_first_flush() -> None:
    ws, launched = workspace()
    ws.post(message(False), 7)
    ws.post(message(True), 7)
    assert launched == []  # held back: a receive and a send that wait on each other go together
    ws.flush()
    ws.flush()  # nothing left
    assert launched == [(L.P2P_NAME, 7, 2)]
    assert ws.launches == 0  # collective launch counts stay the same on every rank
    ws.post(message(True), 7)
    ws.launch(plan.reject(ws.geometry(0)), {"exchange": "x"}, 7)  # a collective: after them
    assert launched[1:] == [(L.P2P_NAME, 7, 1), ("x", 7, 1)] and ws.launches == 1


def test_a_message_on_another_stream_launches_the_group_before_it() -> None:
    ws, launched = workspace()
    ws.post(message(True), 7)
    ws.post(message(False), 9)
    assert launched == [(L.P2P_NAME, 7, 1)]
    ws.flush()
    assert launched[1:] == [(L.P2P_NAME, 9, 1)]


def test_repeated_groups_are_planned_once_and_bad_peers_refused() -> None:
    ws, _ = workspace()
    for _ in range(3):
        ws.post(message(False, tag=4), 7)
        ws.post(message(True, tag=4), 7)
        ws.flush()
    assert len(ws._group.plans) == 1
    with pytest.raises(CommError, match="rank 2 is not a rank"):
        ws.post(message(True, peer=2), 7)
    assert ws._group.messages == []


def _record(ws: Workspace, code: int, peer: int, mine: list[int], theirs: list[int]) -> None:
    e = ws.err
    e["code"], e["peer"], e["ready"] = code, peer, 1
    e["mine"], e["theirs"] = mine, theirs


def test_a_message_that_differs_from_its_receive_is_a_mismatch_naming_both() -> None:
    ws, _ = workspace(rank=1)
    mine = [(L.CALL_RECV << 56) | 1, 200, 2, 0]
    theirs = [(L.CALL_SEND << 56) | 2, 100, 1, 0]
    _record(ws, L.ERR_MESSAGE, 0, mine, theirs)
    with pytest.raises(MismatchError) as got:
        ws.check()
    text = str(got.value)
    assert "rank 0 sent [send to rank 1, 100 bytes, tag 1]" in text
    assert "receives [recv from rank 0, 200 bytes, tag 2]" in text
    assert "match in the order they are sent" in text
    with pytest.raises(MismatchError):  # the communicator keeps refusing
        ws.post(message(True), 7)


def test_a_send_nobody_receives_says_what_to_do_about_it() -> None:
    ws, _ = workspace()
    _record(ws, L.ERR_TIMEOUT, 1, [(L.CALL_SEND << 56) | 2, 8 << 20, 0, 0], [0, 0, 0, 0])
    with pytest.raises(CommError) as got:
        ws.check()
    text = str(got.value)
    assert "rank 1 did not make the matching receive within 5 s" in text
    assert f"more than {4 << 20} bytes waits for its receive" in text and "sendrecv" in text
    ws, _ = workspace()
    _record(ws, L.ERR_TIMEOUT, 1, [(1 << 56) | 0, 1000, 1, 0], [0, 0, 0, 0])  # an allreduce
    with pytest.raises(CommError, match="did not arrive within 5 s"):
        ws.check()


class _Ops:
    """The two facts the engine's point-to-point posting asks of an array (uint8 here)."""

    @staticmethod
    def itemsize(a: numpy.ndarray) -> int:
        return 1

    @staticmethod
    def ptr(a: numpy.ndarray) -> int:
        return int(a.ctypes.data)


def test_large_sends_go_in_place_once_their_receiver_mapped_the_buffer() -> None:
    from cudampi.comm.engines.ipc import IpcEngine
    from tests.unit.test_ipc_registry import Node

    node = Node(2)
    big = numpy.zeros((5 << 20) + 64, numpy.uint8)
    base = int(big.ctypes.data)
    node.alloc(base, big.nbytes, 1)
    ws, _ = workspace()
    ws.registry = node.regs[0]
    capturing = [False]
    ws.capturing = lambda stream: capturing[0]  # type: ignore[method-assign]
    eng = object.__new__(IpcEngine)
    eng.ws, eng.ops, eng._fixed_stream, eng._register = ws, _Ops(), 7, True
    eng.inplace_sends, eng._eager = 0, L.p2p_eager(ws.capacity)

    def post(a: numpy.ndarray, peer: int = 1, send: bool = True) -> plan.Message:
        eng._post(a, send, peer, 0)
        m = ws._group.messages[-1]
        ws._group.messages.clear()
        return m

    x = big[16:]
    assert post(x).reg == 0 and int(node.segs[0]["count"]) == 1  # published at the first send
    assert post(big[: eng._eager]).reg == 0  # the eager size goes through the inbox, always
    node.regs[1].step(0)  # rank 1 maps it at its next large message
    m = post(x)
    assert (m.reg, m.offset, m.ptr) == (1, 16, base + 16) and eng.inplace_sends == 1
    assert post(x, peer=0).reg == 0  # to itself: through its own inbox
    eng._register = False  # CUDAMPI_IPC_REGISTER=0
    assert post(x).reg == 0
    eng._register = True
    capturing[0] = True  # inside a graph capture: used where mapped, never published
    other = numpy.zeros(6 << 20, numpy.uint8)
    node.alloc(int(other.ctypes.data), other.nbytes, 2)
    assert post(x).reg == 1 and post(other).reg == 0 and int(node.segs[0]["count"]) == 1
    capturing[0] = False
    # a large receive maps what its peers published since (the sender reads nothing of it)
    node.regs[1].lookup_peer(int(other.ctypes.data), 0)
    assert post(other, send=False).reg == 0
    assert node.tables[0][(1, 0)] == int(other.ctypes.data) + (1 << 44)
