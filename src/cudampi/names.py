"""Names that cross packages, each written once: collective paths and reduce ops.

The ground floor (beside :mod:`cudampi.config` and :mod:`cudampi.errors`): it imports nothing,
and every package that speaks one of these names imports it from here instead of spelling its
own copy (docs/ARCHITECTURE.md, "one fact, one place").
"""

from __future__ import annotations

PATHS = ("auto", "ipc", "nccl", "gpu-ring", "staged", "native", "host")
"""The Communicator's collective paths (``path=``, CUDAMPI_PATH): ``auto`` picks per call from
what the probe proved and the array (:func:`cudampi.comm.paths.choose`); the others force one."""

FORCED_PATHS = tuple(p for p in PATHS if p != "auto")
"""The paths a caller can force (what ``cudampi bench --paths`` measures of the Communicator)."""

REDUCE_OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
"""The reductions a Communicator takes (``op=``), in this order everywhere an op is numbered (the
ranks' call signatures, the ipc kernels' op codes)."""

BITWISE_OPS = ("band", "bor", "bxor")
"""The reductions defined only on integers and bool."""
