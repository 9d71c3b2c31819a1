"""The package's exception classes.

Every error says what was seen, what it means and the fix; runtime failures name host and rank.
"""

from __future__ import annotations


class CudampiError(Exception):
    """Base class of every error cudampi raises on purpose."""


class ConfigError(CudampiError, ValueError):
    """A flag, a CUDAMPI_* variable or a keyword argument has a value cudampi cannot use."""


class ProbeError(CudampiError):
    """An external tool or a child-process probe could not be run or its output not parsed."""


class CommError(CudampiError):
    """A communication call failed or was given input it cannot move."""


class MismatchError(CommError):
    """Ranks disagree on shape, dtype, count, op or root for one collective call."""


class CommTimeoutError(CommError):
    """Ranks did not arrive at a call within its deadline, or left the job while others wait
    for them; the communicator cannot be used again (see :mod:`cudampi.comm.deadline`)."""


class DeviceError(CommError):
    """An array is on a device this call cannot use (wrong GPU, no GPU, no CUDA-aware MPI)."""


class LaunchError(CudampiError):
    """A job could not be launched, or a rank of it failed."""


class BenchError(CudampiError):
    """A benchmark produced wrong data or missed a required bandwidth."""


class EnvGenError(CudampiError):
    """An environment description cannot be turned into files."""
