"""The engines that run a communicator's calls, one module each, all with one method set.

``nccl`` (NVIDIA's NCCL bootstrapped over MPI, on the caller's stream, where every rank has a
GPU of its own), ``ipc`` (whole collectives as GPU kernels over CUDA IPC, on the caller's
stream), ``staged`` (through host buffers around an inner ``mpi`` or ``alg`` engine), ``alg``
(cudampi's algorithms over direct point-to-point) and ``mpi`` (MPI's own collectives); the
contract is in :mod:`~cudampi.comm.engines.base`. This registry is the one list of them:
:data:`KINDS` maps :attr:`PathChoice.engine <cudampi.comm.choice.PathChoice>` to the class, in
auto's order (the first engine whose route takes a call runs it), and :func:`engines_for` gives
a communicator its own set. A new engine is one module plus its line here. Importing this
package starts no MPI and no CUDA.
"""

from __future__ import annotations

from cudampi.comm.engines.alg import AlgEngine
from cudampi.comm.engines.base import Engine, Engines, Setting
from cudampi.comm.engines.ipc import IpcEngine
from cudampi.comm.engines.mpi import MpiEngine
from cudampi.comm.engines.nccl import NcclEngine
from cudampi.comm.engines.staged import StagedEngine

KINDS: dict[str, type[Engine]] = {
    e.name: e for e in (NcclEngine, IpcEngine, StagedEngine, AlgEngine, MpiEngine)
}
"""Every engine by name, in auto's order: NCCL and the ipc kernels where the probe proved them,
staging where the ranks time-slice one GPU, cudampi's algorithms over device p2p, MPI's own
collectives; the ``last_resort`` engine (staged) where none took the call."""


def engines_for(setting: Setting) -> Engines:
    """A fresh set of engines for one communicator."""
    return Engines(setting, KINDS)


__all__ = ["KINDS", "Engine", "Engines", "Setting", "engines_for"]
