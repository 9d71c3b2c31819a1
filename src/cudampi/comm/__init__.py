"""Collectives and point-to-point on GPU and host arrays over MPI, on the fastest path that works.

``from cudampi.comm import Communicator, Handle`` starts no MPI and no CUDA.
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
