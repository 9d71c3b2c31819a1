"""Collectives and point-to-point on GPU and host arrays over MPI, on the fastest path that works.

``from cudampi.comm import Communicator, Handle`` starts no MPI and no CUDA.

Layout: ``communicator`` (the public class: adapts the arrays with ``arrays``, checks them with
``args`` and across ranks with ``validate``, picks a path with ``paths``, runs calls in order
with ``handle``) hands flat arrays to one of ``engines/`` (``mpi``, ``alg``, ``staged``: one
module each, one method set, contract in ``engines/base.py``). Below them: ``arrays`` (one module
per array library: adapting, element-wise work, pinned host buffers and device<->host copies),
``algorithms`` (collectives from point-to-point) and ``transport`` (moving bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Communicator", "Handle", "PathChoice"]

if TYPE_CHECKING:
    from cudampi.comm.communicator import Communicator
    from cudampi.comm.handle import Handle
    from cudampi.comm.paths import PathChoice

_LAZY = {
    "Communicator": "cudampi.comm.communicator",
    "Handle": "cudampi.comm.handle",
    "PathChoice": "cudampi.comm.paths",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cudampi.comm' has no attribute {name!r}")
