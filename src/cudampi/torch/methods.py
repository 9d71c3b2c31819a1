"""The c10d methods of a cudampi process group, in one table, and their options decoded once.

torch calls a Python process group's methods by c10d's names (which changed between torch 2.4
and 2.13: ``_allgather_base`` became ``all_gather_single``, ``_reduce_scatter_base``
``reduce_scatter_single``, ``alltoall_base`` ``all_to_all_single``; the group keeps both as
aliases). :data:`METHODS` says, for each, the Communicator call behind it (a name of
:data:`cudampi.names.CALLS`), torch's public name, which arguments' shapes every rank must share
(``TORCH_DISTRIBUTED_DEBUG=DETAIL``) and where its options argument is; :func:`decode` turns a
c10d options object into the :class:`Opts` every method reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cudampi.names import CALLS
from cudampi.torch.convert import ReduceSpec, reduce_spec


@dataclass(frozen=True)
class Method:
    """One c10d method of the process group."""

    call: str
    """The Communicator call that runs it (:data:`cudampi.names.CALLS`)."""
    torch_name: str
    """What torch.distributed calls it (``dist.all_reduce`` -> ``all_reduce``)."""
    shaped: tuple[int, ...] = ()
    """The argument positions whose tensors' shapes every rank must share."""
    opts_at: int = -1
    """The position of the c10d options argument (-1: none)."""


METHODS: dict[str, Method] = {
    "allreduce": Method("allreduce", "all_reduce", (0,), 1),
    "allreduce_coalesced": Method("allreduce", "all_reduce_coalesced", (0,), 1),
    "broadcast": Method("broadcast", "broadcast", (0,), 1),
    "reduce": Method("reduce", "reduce", (0,), 1),
    "allgather": Method("allgather", "all_gather", (0,), 2),
    "allgather_coalesced": Method("allgather", "all_gather_coalesced", (0,), 2),
    "all_gather_single": Method("allgather", "all_gather_into_tensor", (0, 1), 2),
    "all_gather_single_coalesced": Method(
        "allgather", "all_gather_into_tensor_coalesced", (0, 1), 2
    ),
    "reduce_scatter": Method("reduce_scatter", "reduce_scatter", (1,), 2),
    "reduce_scatter_single": Method("reduce_scatter", "reduce_scatter_tensor", (0, 1), 2),
    "reduce_scatter_single_coalesced": Method(
        "reduce_scatter", "reduce_scatter_tensor_coalesced", (0, 1), 2
    ),
    "all_to_all_single": Method("alltoall", "all_to_all_single", (), 4),
    "alltoall": Method("alltoall", "all_to_all", (), 2),
    "gather": Method("gather", "gather", (1,), 2),
    "scatter": Method("scatter", "scatter", (0,), 2),
    "barrier": Method("barrier", "barrier", (), 0),
}
"""Every collective method of the group by its c10d name (aliases excluded)."""
assert all(m.call in CALLS for m in METHODS.values())


@dataclass(frozen=True)
class Opts:
    """A c10d options object (``AllreduceOptions``, ``BroadcastOptions``...), decoded once."""

    spec: ReduceSpec
    """The reduction (SUM where the options have none)."""
    root: int
    """The root rank (0 where the options have none)."""
    waited: bool = False
    """The caller waits for the call's Work at once (``asyncOp`` False: torch 2.7 and later set
    it from ``async_op``, as ``dist.all_reduce(t)`` does; False where the options do not say),
    so running it on the group's thread could overlap nothing."""


_FIELDS: dict[type, tuple[bool, bool, bool]] = {}
"""An options class -> whether it has ``reduceOp``, ``rootRank``, ``asyncOp`` (asked once per
class: a missing attribute of a pybind object raises, which costs more than the rest of the
decoding)."""
_KEPT: dict[tuple[Any, int, bool], Opts] = {}
"""(reduce op type or None, root, waited) -> its Opts (PREMUL_SUM, whose factor varies, never
kept)."""


def decode(opts: Any) -> Opts:
    """``opts`` (None, or any c10d options object) as an :class:`Opts`."""
    if opts is None:
        red, root, waited = None, 0, False
    else:
        fields = _FIELDS.get(type(opts))
        if fields is None:
            fields = _FIELDS[type(opts)] = (
                hasattr(opts, "reduceOp"),
                hasattr(opts, "rootRank"),
                hasattr(opts, "asyncOp"),
            )
        red = opts.reduceOp if fields[0] else None
        root = int(opts.rootRank) if fields[1] else 0
        waited = fields[2] and not opts.asyncOp
    key = (getattr(red, "op", red), root, waited)
    kept = _KEPT.get(key)
    if kept is not None:
        return kept
    if red is None:
        import torch.distributed as dist

        red = dist.ReduceOp.SUM
    made = Opts(reduce_spec(red), root, waited)
    if made.spec.premul is None:
        _KEPT[key] = made
    return made


def opts_of(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The raw c10d options object of a call of ``method`` (None where it has none)."""
    at = METHODS[method].opts_at if method in METHODS else -1
    return kwargs.get("opts", args[at] if 0 <= at < len(args) else None)


__all__ = ["METHODS", "Method", "Opts", "decode", "opts_of"]
