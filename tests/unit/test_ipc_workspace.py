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
