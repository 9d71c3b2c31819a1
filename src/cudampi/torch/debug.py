"""``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for cudampi groups: every collective's fingerprint across ranks.

For gloo and nccl, torch wraps the backend in a ``ProcessGroupWrapper`` under DETAIL that checks
each collective's op, tensor shapes, dtypes and devices across ranks before it runs. torch
returns a Python process group (cudampi's) before it would wrap it, so the cudampi group does the
same check itself: each rank describes the call (:func:`fingerprint`, pure), the fingerprints are
allgathered on a communicator of their own, and where they differ every rank raises a
:class:`~cudampi.errors.MismatchError` that names each rank's call (:func:`mismatch_message`).

Only what must agree is compared, so cudampi's uneven forms stay legal: all_gather compares the
outputs (inputs may differ in size), reduce_scatter the inputs, all_to_all only dtypes.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.errors import MismatchError
from cudampi.torch.methods import METHODS, Method, opts_of


@dataclass(frozen=True)
class Fingerprint:
    """One rank's view of one collective call: what every rank of the group must agree on."""

    seq: int
    op: str
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    reduce_op: str = ""
    root: int = -1

    def shown(self) -> str:
        parts = [f"#{self.seq} {self.op}"]
        if self.shapes:
            parts.append(f"shapes={[list(s) for s in self.shapes]}")
        if self.dtypes:
            parts.append(f"dtypes={list(self.dtypes)}")
        if self.devices:
            parts.append(f"devices={list(self.devices)}")
        if self.reduce_op:
            parts.append(f"op={self.reduce_op}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        return " ".join(parts)


def _tensors(arg: Any) -> list[Any]:
    """The tensors in ``arg`` (a tensor, or lists of them, nested), in order."""
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return [arg] if hasattr(arg, "shape") and hasattr(arg, "dtype") else []


def _dtype(t: Any) -> str:
    name = str(t.dtype).replace("torch.", "")
    layout = str(getattr(t, "layout", "")).replace("torch.", "")
    return name if layout in ("", "strided") else f"{name} ({layout})"


def _reduce_op(opts: Any) -> str:
    op = getattr(opts, "reduceOp", None)
    if op is None:
        return ""
    red = getattr(op, "op", op)
    return str(getattr(red, "name", red))


def fingerprint(seq: int, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Fingerprint:
    """What ``method(*args)`` of a cudampi group must share with the other ranks' call."""
    m = METHODS.get(method) or Method(method, method)
    name, shaped, opts_at = m.torch_name, m.shaped, m.opts_at
    opts = opts_of(method, tuple(args), kwargs)
    tensors = _tensors([a for i, a in enumerate(args) if i != opts_at])
    shapes = tuple(tuple(int(d) for d in t.shape) for i in shaped for t in _tensors(args[i]))
    root = getattr(opts, "rootRank", -1)
    return Fingerprint(
        seq=seq,
        op=name,
        shapes=shapes,
        # As sets: a rooted op's root holds more tensors than the other ranks.
        dtypes=tuple(sorted({_dtype(t) for t in tensors})),
        devices=tuple(sorted({str(t.device.type) for t in tensors})),
        reduce_op=_reduce_op(opts),
        root=int(root) if isinstance(root, int) else -1,
    )


def mismatch_message(
    ranks: Sequence[int], prints: Sequence[Fingerprint], hosts: Sequence[str]
) -> str:
    """Why the fingerprints (one per group rank) disagree, naming each rank's call, or ``""``."""
    first = prints[0]
    odd = [i for i, p in enumerate(prints) if p != first]
    if not odd:
        return ""
    other = prints[odd[0]]
    fields = [
        label
        for label, a, b in (
            ("collective", first.op, other.op),
            ("tensor shapes", first.shapes, other.shapes),
            ("dtypes", first.dtypes, other.dtypes),
            ("device types", first.devices, other.devices),
            ("reduce op", first.reduce_op, other.reduce_op),
            ("root", first.root, other.root),
            ("sequence number", first.seq, other.seq),
        )
        if a != b
    ]
    groups: dict[Fingerprint, list[int]] = {}
    for i, p in enumerate(prints):
        groups.setdefault(p, []).append(i)
    calls = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(str(ranks[i]) for i in rs)} "
        f"(on {', '.join(sorted({hosts[i] for i in rs}))}): {p.shown()}"
        for p, rs in groups.items()
    )
    return (
        f"TORCH_DISTRIBUTED_DEBUG=DETAIL: ranks of the cudampi group {list(ranks)} called "
        f"different collectives ({calls}). They differ in: {', '.join(fields)}. Every rank must "
        "make the same collective calls, in the same order, with tensors of the same shapes and "
        "dtypes; nothing was sent."
    )


class DetailChecker:
    """Checks each collective of one group across its ranks before it runs (collective).

    Runs on a duplicate of the group's communicator, so the check never mixes with the data.
    """

    def __init__(self, mpi_comm: Any, ranks: Sequence[int]) -> None:
        self._comm = mpi_comm.Dup()
        self._ranks = list(ranks)
        self._seq = 0
        self._host = socket.gethostname()

    def check(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        self._seq += 1
        mine = fingerprint(self._seq, method, args, kwargs)
        entries = self._comm.allgather((mine, self._host))
        problem = mismatch_message(self._ranks, [e[0] for e in entries], [e[1] for e in entries])
        if problem:
            raise MismatchError(problem)

    def close(self) -> None:
        try:
            from mpi4py import MPI

            if not MPI.Is_finalized():
                self._comm.Free()
        except Exception:  # freeing at teardown must not mask the real error
            pass


def detail_enabled() -> bool:
    """Is torch's debug level DETAIL (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)?"""
    import os

    import torch.distributed as dist

    try:
        return bool(dist.get_debug_level() == dist.DebugLevel.DETAIL)
    except (AttributeError, RuntimeError):
        return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


__all__ = ["DetailChecker", "Fingerprint", "detail_enabled", "fingerprint", "mismatch_message"]
