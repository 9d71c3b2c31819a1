"""cudampi: CUDA-aware MPI for GPU training with PyTorch.

Importing cudampi starts no MPI and no CUDA: every heavy import happens inside the function that
needs it. The public API is re-exported here lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cudampi._version import __version__
from cudampi.errors import (
    CommError,
    ConfigError,
    CudampiError,
    DeviceError,
    LaunchError,
    MismatchError,
    ProbeError,
)

__all__ = [
    "CommError",
    "Communicator",
    "Config",
    "ConfigError",
    "CudampiError",
    "DeviceError",
    "LaunchError",
    "MismatchError",
    "ProbeError",
    "__version__",
    "init",
]

if TYPE_CHECKING:
    from cudampi.comm import Communicator
    from cudampi.config import Config
    from cudampi.start import init

_LAZY = {
    "Communicator": ("cudampi.comm", "Communicator"),
    "Config": ("cudampi.config", "Config"),
    "init": ("cudampi.start", "init"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'cudampi' has no attribute {name!r}")
