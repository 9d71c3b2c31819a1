"""Registers the ``cudampi`` torch.distributed backend at ``import torch`` (an entry point).

torch (2.5 and newer) calls every ``torch.backends`` entry point at the end of ``import torch``
(its hook for out-of-tree extensions; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off). torch
has no entry-point group for process-group backends, so this hook imports ``cudampi.torch``, which
registers the backend: ``init_process_group("cudampi")`` then works without the import.

It lives outside ``cudampi.torch`` so that a failure there cannot break ``import torch``: it
becomes a warning, and ``import cudampi.torch`` raises the real error.
"""

from __future__ import annotations


def load() -> None:
    """The ``torch.backends`` entry point: import ``cudampi.torch``; never raise."""
    import importlib

    try:
        # During `import torch`; if cudampi.torch is itself importing torch, this returns the
        # partly made module, and its own import registers the backend when it finishes.
        importlib.import_module("cudampi.torch")
    except Exception as exc:  # never break `import torch` for everyone in the environment
        import warnings

        warnings.warn(
            f"cudampi could not register its torch.distributed backend at `import torch` "
            f"({type(exc).__name__}: {exc}). `import cudampi.torch` shows the full error; "
            "TORCH_DEVICE_BACKEND_AUTOLOAD=0 stops torch from loading extensions.",
            RuntimeWarning,
            stacklevel=2,
        )
