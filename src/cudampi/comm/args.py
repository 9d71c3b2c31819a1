"""Local checks of one call's arguments, and the block layouts they imply (pure).

The Communicator runs these on every rank before the cross-rank check
(:mod:`~cudampi.comm.validate`), so a bad argument on one rank raises on every rank instead of
leaving the others waiting.
"""

from __future__ import annotations

import operator
from typing import Any

from cudampi.comm.arrays import DTYPES, Buf
from cudampi.errors import CommError, DeviceError, MismatchError


def prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_array(b: Buf, what: str) -> None:
    """A dtype the collectives move, in contiguous memory."""
    if b.dtype not in DTYPES:
        raise CommError(
            f"{what}: dtype {b.dtype!r} is not supported; use one of {', '.join(DTYPES)}"
        )
    if not b.contiguous:
        raise CommError(
            f"{what}: the {b.describe()} is not contiguous; MPI moves contiguous memory. "
            "Pass x.contiguous() (torch) or numpy/cupy.ascontiguousarray(x)."
        )


def check_writable(b: Buf, what: str) -> None:
    """An array the call writes must be writable: MPI writes through the address whatever the
    array says (a read-only NumPy view of ``bytes`` would change the immutable ``bytes``; a
    read-only memory map segfaults)."""
    if not b.writable:
        raise CommError(
            f"{what}: the {b.describe()} is read-only, and this call writes into it. "
            + b.impl.read_only_fix
        )


INT_MAX = 2**31 - 1
"""The largest value of a C int: MPI's ranks, tags, colors and keys are C ints."""


def integer(value: Any) -> int | None:
    """``value`` as an int where it is an integer (Python's or NumPy's, not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_color(color: Any, key: Any) -> tuple[int, int]:
    """``split``'s color (MPI.UNDEFINED or an integer in 0..2**31-1) and key (a C int), as
    Python ints (NumPy integers are accepted)."""
    from mpi4py import MPI

    c, k = integer(color), integer(key)
    if c is None or not (0 <= c <= INT_MAX or c == MPI.UNDEFINED):
        raise CommError(
            f"split: color={color!r} is neither an integer in 0..{INT_MAX} nor MPI.UNDEFINED "
            "(a rank that passes MPI.UNDEFINED gets None)"
        )
    if k is None or not -INT_MAX - 1 <= k <= INT_MAX:
        raise CommError(f"split: key={key!r} is not an integer in {-INT_MAX - 1}..{INT_MAX}")
    return c, k


def peer_error(call: str, peer: Any, size: int, *, receives: bool) -> CommError | None:
    """The error where ``peer`` is not a rank a message ``call`` may name, else None."""
    from mpi4py import MPI

    p = integer(peer)
    if p is not None and (
        0 <= p < size or p == MPI.PROC_NULL or (receives and p == MPI.ANY_SOURCE)
    ):
        return None
    name, other = ("source", " or MPI.ANY_SOURCE") if receives else ("dest", "")
    return CommError(
        f"{call}: {name}={peer!r} is not a rank of this communicator (0..{size - 1}{other})"
    )


def message_error(
    exc: BaseException, call: str, peer: Any, tag: Any, comm: Any, closed: bool, nbytes: int
) -> BaseException:
    """What a message ``call`` (send, recv, isend, irecv, sendrecv) to or from ``peer`` with
    ``tag`` on ``comm`` raises where it failed with ``exc``: MPI names only the class of the
    error (MPI_ERR_RANK, MPI_ERR_TAG, MPI_ERR_TRUNCATE, MPI_ERR_COMM), mpi4py a value it could
    not convert; the :class:`CommError` names the call and the value. Checked here, after the
    failure, so a message that succeeds pays nothing for it. ``nbytes``: a receive's buffer."""
    from mpi4py import MPI

    if closed:
        return CommError(f"{call}: this Communicator was closed")
    receives = "recv" in call
    bad = peer_error(call, peer, comm.Get_size(), receives=receives)
    if bad is not None:
        return bad
    t, ub = integer(tag), int(comm.Get_attr(MPI.TAG_UB))
    if t is None or not (0 <= t <= ub or (receives and t == MPI.ANY_TAG)):
        other = " or MPI.ANY_TAG" if receives else ""
        return CommError(f"{call}: tag={tag!r} is not a tag (an integer in 0..{ub}{other})")
    if isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE:
        return truncated(call, peer, tag, nbytes)
    return exc


def truncated(call: str, peer: Any, tag: Any, nbytes: int) -> CommError:
    """A receive's message was larger than its buffer (``nbytes``; -1: not known here)."""
    size = f" ({nbytes} bytes)" if nbytes >= 0 else ""
    return CommError(
        f"{call} from rank {peer} (tag {tag}): the message is larger than the receive "
        f"buffer{size}; receive into an array as large as what the sender sends"
    )


def check_out(x: Buf, ob: Buf, shape: tuple[int, ...], what: str) -> None:
    """``ob`` can take this call's output of ``shape`` for the input ``x``."""
    check_writable(ob, what)
    if ob.lib != x.lib or ob.device != x.device:
        raise DeviceError(
            f"{what}: a {ob.describe()}, but the input is a {x.describe()}; out must be the "
            "same kind of array on the same device"
        )
    if ob.dtype != x.dtype:
        raise CommError(f"{what}: dtype {ob.dtype!r} differs from the input's {x.dtype!r}")
    if ob.count != prod(shape):
        raise CommError(
            f"{what}: shape {ob.shape} holds {ob.count} elements; this call writes "
            f"{prod(shape)} (shape {shape})"
        )


def check_root(root: Any, size: int) -> None:
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < size:
        raise CommError(f"root={root!r} is not a rank of this communicator (0..{size - 1})")


def check_counts(counts: Any, size: int, what: str) -> list[int]:
    try:
        cs = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise CommError(f"{what}={counts!r} is not a list of integers") from None
    if len(cs) != size or any(c < 0 for c in cs):
        raise CommError(f"{what}={cs!r}: need {size} non-negative counts, one per rank")
    return cs


def gather_layout(x: Buf, counts: Any, size: int, rank: int) -> tuple[list[int], tuple[int, ...]]:
    """(all)gather(v): the element count from each rank, and the output's shape."""
    if counts is None:
        return [x.count] * size, (size, *x.shape)
    cs = check_counts(counts, size, "counts")
    if cs[rank] != x.count:
        raise CommError(
            f"allgatherv: counts[{rank}]={cs[rank]} but this rank's x has "
            f"{x.count} elements; counts[i] must be rank i's element count"
        )
    return cs, (sum(cs),)


def reduce_scatter_layout(
    x: Buf, counts: Any, size: int, rank: int
) -> tuple[list[int], tuple[int, ...]]:
    """reduce_scatter: the element count of each rank's block, and this rank's output shape."""
    if counts is None:
        if not x.shape or x.shape[0] % size:
            raise CommError(
                f"reduce_scatter: x has shape {x.shape}; its first axis must be a "
                f"multiple of the number of ranks ({size}), or pass counts="
            )
        shape: tuple[int, ...] = (x.shape[0] // size, *x.shape[1:])
        return [prod(shape)] * size, shape
    cs = check_counts(counts, size, "counts")
    if sum(cs) != x.count:
        raise CommError(f"reduce_scatter: counts sum to {sum(cs)} but x has {x.count} elements")
    return cs, (cs[rank],)


def alltoall_counts(
    x: Buf, send_counts: Any, recv_counts: Any, size: int
) -> tuple[list[int], list[int] | None]:
    """alltoall: the send counts, and the receive counts where known before the exchange."""
    if send_counts is None:
        if recv_counts is not None:
            raise CommError("alltoall: recv_counts needs send_counts too")
        if not x.shape or x.shape[0] % size:
            raise CommError(
                f"alltoall: x has shape {x.shape}; its first axis must be a multiple of "
                f"the number of ranks ({size}), or pass send_counts="
            )
        sc = [x.count // size] * size
        return sc, list(sc)
    sc = check_counts(send_counts, size, "send_counts")
    if sum(sc) != x.count:
        raise CommError(f"alltoall: send_counts sum to {sum(sc)} but x has {x.count} elements")
    rc = None if recv_counts is None else check_counts(recv_counts, size, "recv_counts")
    return sc, rc


def recv_counts_error(
    rank: int, expected: list[int] | None, got: list[int]
) -> MismatchError | None:
    """The error where this rank's ``recv_counts`` differ from what the ranks send it."""
    if expected is None or got == expected:
        return None
    bad = [i for i in range(len(got)) if got[i] != expected[i]]
    return MismatchError(
        f"alltoall: rank {rank} expects recv_counts {expected}, but rank "
        f"{bad[0]} sends it {got[bad[0]]} elements (send_counts[{rank}] "
        f"there); recv_counts[j] must equal rank j's send_counts[{rank}]"
    )
