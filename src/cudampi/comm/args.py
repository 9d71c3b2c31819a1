"""Local checks of one call's arguments, and the block layouts they imply (pure).

The Communicator runs these on every rank before the cross-rank check
(:mod:`~cudampi.comm.validate`), so a bad argument on one rank raises on every rank instead of
leaving the others waiting.
"""

from __future__ import annotations

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


def check_color(color: Any, key: Any) -> None:
    """``split``'s color is MPI.UNDEFINED or a non-negative int; its key an int."""
    from mpi4py import MPI

    ok = isinstance(color, int) and not isinstance(color, bool)
    if not ok or (color < 0 and color != MPI.UNDEFINED):
        raise CommError(
            f"split: color={color!r} is neither a non-negative integer nor MPI.UNDEFINED "
            "(a rank that passes MPI.UNDEFINED gets None)"
        )
    if not isinstance(key, int) or isinstance(key, bool):
        raise CommError(f"split: key={key!r} is not an integer")


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
