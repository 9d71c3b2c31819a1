"""Names that cross packages, each written once: collective paths, reduce ops, launchers and
MPI flavours.

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

LAUNCHERS = ("torchrun", "openmpi", "mpich", "slurm", "pmix", "env", "none")
"""Who started a process, in the order :func:`cudampi.rankenv.launched_by` looks for them:
torchrun (its workers also inherit an outer launcher's variables), Open MPI's mpirun/prterun,
MPICH's Hydra mpiexec (also Intel MPI, MVAPICH), a Slurm job step (srun), another PMIx launcher,
plain RANK/WORLD_SIZE, or nobody (a single process)."""

MPI_LAUNCHERS = ("openmpi", "mpich", "slurm", "pmix")
"""The launchers whose processes form one MPI job by themselves (MPI_Init finds the peers)."""

LAUNCHER_LABELS = {
    "torchrun": "torchrun",
    "openmpi": "Open MPI mpirun/prterun",
    "mpich": "MPICH/Hydra mpiexec",
    "slurm": "Slurm srun",
    "pmix": "PMIx launcher",
    "env": "RANK/WORLD_SIZE",
    "none": "no launcher",
}
"""How messages name each launcher."""

MPI_FLAVOURS = ("openmpi", "mpich")
"""The MPI families cudampi tells apart: Open MPI (mpirun/prterun, ``--mca``, ``-x``) and MPICH's
(Hydra's mpiexec, ``-genv``; MPICH, Intel MPI, MVAPICH, Cray MPICH)."""

LAUNCH_FLAVOURS = (*MPI_FLAVOURS, "slurm")
"""The launchers ``cudampi launch`` runs: an MPI family's own, or Slurm's srun."""

OPEN_MPI, MPICH, INTEL_MPI, MVAPICH, CRAY_MPICH = (
    "Open MPI",
    "MPICH",
    "Intel MPI",
    "MVAPICH",
    "Cray MPICH",
)
"""The MPI implementations by the names their version strings give."""

FLAVOUR_OF = {
    OPEN_MPI: "openmpi",
    MPICH: "mpich",
    INTEL_MPI: "mpich",
    MVAPICH: "mpich",
    CRAY_MPICH: "mpich",
}
"""Each implementation's family (:data:`MPI_FLAVOURS`)."""
