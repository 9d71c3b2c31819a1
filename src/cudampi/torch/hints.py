"""The fix for torch errors that a cudampi user meets, printed after their traceback.

Two come from habit and are raised by torch itself, so cudampi cannot reword them:

- ``init_process_group("mpi")``: stock wheels have no MPI backend ("Distributed package doesn't
  have MPI built in ... build PyTorch from source"); cudampi's backend is named ``cudampi``;
- ``init_process_group("cudampi")`` where the backend was not registered ("Unknown backend type
  cudampi"): ``import cudampi.torch`` registers it (and does so at ``import torch`` where cudampi
  is installed, through torch's ``torch.backends`` entry points, unless
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).

:func:`hint_for` (pure) names the fix for such a message; :func:`install_excepthook` prints it
after the traceback of an uncaught exception, chained after the hook already in place, and keeps
it on the exception as a note (``cudampi launch``'s rank bootstrap calls the hook and puts the
note in the job's summary).
"""

from __future__ import annotations

import re
import sys
import threading
from typing import Any

_MPI_BUILTIN = re.compile(r"doesn't have MPI built in", re.IGNORECASE)
_UNKNOWN_CUDAMPI = re.compile(
    r"(Unknown (c10d )?backend type|Invalid backend)\W*cudampi", re.IGNORECASE
)


def hint_for(message: str) -> str:
    """The fix for a torch error ``message`` a cudampi user may meet, or ``""``."""
    if _MPI_BUILTIN.search(message):
        return (
            "cudampi: stock torch wheels have no 'mpi' backend (torch's ProcessGroupMPI needs "
            "a build from source). cudampi's MPI backend is named 'cudampi': "
            "`import cudampi.torch` then `dist.init_process_group('cudampi')`, under the same "
            "launchers (mpirun, mpiexec, srun, `cudampi launch`)."
        )
    if _UNKNOWN_CUDAMPI.search(message):
        return (
            "cudampi: the 'cudampi' backend is not registered in this process. Fix: "
            "`import cudampi.torch` before init_process_group (an installed cudampi also "
            "registers it at `import torch`, unless TORCH_DEVICE_BACKEND_AUTOLOAD=0 or cudampi "
            "is only on PYTHONPATH, not pip-installed)."
        )
    return ""


def add_note(exc: Any, note: str) -> None:
    """Keep ``note`` on ``exc`` (PEP 678's ``__notes__``, also on 3.10) after the hook printed
    it: a wrapper that reports the error after calling the hook (``cudampi launch``'s rank
    bootstrap, in the job's summary) reads it there."""
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        try:
            exc.__notes__ = notes = []
        except (AttributeError, TypeError):
            return
    if isinstance(notes, list) and note not in notes:
        notes.append(note)


_LOCK = threading.Lock()
_INSTALLED: list[bool] = []


def install_excepthook() -> None:
    """After an uncaught exception's traceback, print :func:`hint_for` its message (idempotent)."""
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED.append(True)
        previous = sys.excepthook

        def hint_hook(exc_type: Any, exc: Any, tb: Any) -> None:
            previous(exc_type, exc, tb)
            hint = hint_for(f"{exc_type.__name__}: {exc}")
            if hint:
                err = sys.stderr or sys.__stderr__
                if err is not None:
                    err.write(hint + "\n")
                    err.flush()
                add_note(exc, hint)

        sys.excepthook = hint_hook


__all__ = ["hint_for", "install_excepthook"]
