"""torch.distributed reduction ops and split sizes, mapped onto :class:`cudampi.comm.Communicator`.

Pure functions: they take torch objects (``ReduceOp``, ``RedOpType``, tensors) but import nothing
at module level, so they are unit-tested without MPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.errors import CommError
from cudampi.names import BITWISE_OPS

TORCH_REDUCE_OPS: dict[str, str] = {
    "SUM": "sum",
    "PRODUCT": "prod",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
    "AVG": "avg",
    # PREMUL_SUM(f): every rank multiplies its input by f, then the inputs are summed.
    "PREMUL_SUM": "sum",
}
"""torch ``ReduceOp`` names -> the op names :class:`~cudampi.comm.Communicator` takes
(:data:`cudampi.names.REDUCE_OPS`)."""


@dataclass(frozen=True)
class ReduceSpec:
    """One torch reduction, as the Communicator runs it.

    ``premul`` is PREMUL_SUM's factor (a float or a 1-element tensor), applied to the input
    before a sum; ``None`` for every other op.
    """

    torch_name: str
    op: str
    premul: Any = None


def reduce_spec(op: Any) -> ReduceSpec:
    """Map a torch ``ReduceOp`` (an instance, a ``ReduceOp.RedOpType``, or a name) to a spec.

    ``opts.reduceOp`` in a c10d options object is a ``ReduceOp`` instance whose ``.op`` is the
    ``RedOpType``; ``dist.ReduceOp.SUM`` itself is a ``RedOpType``. PREMUL_SUM carries its factor
    in ``.factor`` (torch >= 2.5) or in ``__getstate__()`` (``(op, factor)``, older wheels).
    """
    red_type = getattr(op, "op", op)
    try:
        known = _SPECS.get(red_type)
    except TypeError:  # unhashable: not an op type
        known = None
    if known is not None:
        return known
    name = getattr(red_type, "name", None)
    if name is None and isinstance(red_type, str):
        name = red_type.upper()
    if not isinstance(name, str) or name.upper() not in TORCH_REDUCE_OPS:
        raise CommError(
            f"reduce op {op!r} is not one cudampi knows; it supports torch.distributed.ReduceOp."
            f"{', '.join(TORCH_REDUCE_OPS)}. Fix: pass one of those."
        )
    name = name.upper()
    factor = None
    if name == "PREMUL_SUM":
        factor = getattr(op, "factor", None)
        if factor is None and hasattr(op, "__getstate__"):
            state = op.__getstate__()
            if isinstance(state, tuple) and len(state) == 2:
                factor = state[1]
        if factor is None:
            raise CommError(
                f"ReduceOp.PREMUL_SUM {op!r} carries no factor. Fix: build it with "
                "torch.distributed._make_nccl_premul_sum(factor)."
            )
    spec = ReduceSpec(torch_name=name, op=TORCH_REDUCE_OPS[name], premul=factor)
    if factor is None:
        _SPECS[red_type] = spec  # each call looks it up again: a few are made once
    return spec


_SPECS: dict[Any, ReduceSpec] = {}
"""A torch ``RedOpType`` (or a name) -> its spec (PREMUL_SUM, whose factor varies, is never
kept)."""


def check_dtype(spec: ReduceSpec, dtype: Any) -> None:
    """Reject op/dtype pairs that have no meaning (bitwise ops on floating point)."""
    if spec.op in BITWISE_OPS and (
        getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False)
    ):
        raise CommError(
            f"ReduceOp.{spec.torch_name} on a {dtype} tensor: bitwise reductions need integer "
            "or bool tensors. Fix: reduce an integer tensor, or use SUM/MIN/MAX."
        )


def element_counts(
    split_sizes: Sequence[int], shape: Sequence[int], size: int, what: str
) -> list[int]:
    """Element counts per rank for ``all_to_all_single``'s first-dimension split sizes.

    Empty ``split_sizes`` means an equal split of the first dimension across ``size`` ranks.
    """
    rows = shape[0] if len(shape) else 1
    per_row = 1
    for d in shape[1:]:
        per_row *= int(d)
    if not split_sizes:
        if rows % size:
            raise CommError(
                f"all_to_all_single: the {what} tensor's first dimension {rows} does not split "
                f"evenly across {size} ranks. Fix: pass {what}_split_sizes."
            )
        return [rows // size * per_row] * size
    splits = [int(s) for s in split_sizes]
    if len(splits) != size or sum(splits) != rows or any(s < 0 for s in splits):
        raise CommError(
            f"all_to_all_single: {what}_split_sizes {splits!r} must be {size} non-negative sizes "
            f"summing to the first dimension {rows}. Fix the split sizes."
        )
    return [s * per_row for s in splits]
