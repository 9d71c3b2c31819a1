"""The engines that run a communicator's calls, one module each, all with one method set.

``mpi`` (MPI's own collectives), ``alg`` (cudampi's algorithms over direct point-to-point),
``staged`` (through host buffers around an inner ``mpi`` or ``alg`` engine), ``ipc`` (whole
collectives as GPU kernels over CUDA IPC, on the caller's stream) and ``nccl`` (NVIDIA's NCCL
bootstrapped over MPI, on the caller's stream, where every rank has a GPU of its own; the
choice: :func:`~cudampi.comm.engines.nccl.nccl_usable`); the contract is in
:mod:`~cudampi.comm.engines.base`. :data:`KINDS` maps :attr:`PathChoice.engine
<cudampi.comm.paths.PathChoice>` to the class, and :func:`engines_for` gives a communicator its
own set. Importing this package starts no MPI and no CUDA.
"""

from __future__ import annotations

from cudampi.comm.engines.alg import AlgEngine
from cudampi.comm.engines.base import Engine, Engines, Setting
from cudampi.comm.engines.ipc import IpcEngine
from cudampi.comm.engines.mpi import MpiEngine
from cudampi.comm.engines.nccl import NcclEngine
from cudampi.comm.engines.staged import StagedEngine

KINDS: dict[str, type[Engine]] = {
    e.name: e for e in (MpiEngine, AlgEngine, StagedEngine, IpcEngine, NcclEngine)
}


def engines_for(setting: Setting) -> Engines:
    """A fresh set of engines for one communicator."""
    return Engines(setting, KINDS)


__all__ = ["KINDS", "Engine", "Engines", "Setting", "engines_for"]
