"""Names that cross packages, each written once: collective paths, reduce ops, launchers and
MPI flavours.

The ground floor (beside :mod:`cudampi.config` and :mod:`cudampi.errors`): it imports nothing,
and every package that speaks one of these names imports it from here instead of spelling its
own copy (docs/ARCHITECTURE.md, "one fact, one place").
"""

from __future__ import annotations

from dataclasses import dataclass

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

LAUNCHERS = ("torchrun", "openmpi", "mpich", "slurm", "lsf", "pmix", "env", "none")
"""Who started a process, in the order :func:`cudampi.rankenv.launched_by` looks for them:
torchrun (its workers also inherit an outer launcher's variables), Open MPI's mpirun/prterun,
MPICH's Hydra mpiexec (also Intel MPI, MVAPICH), a Slurm job step (srun), LSF's jsrun, another
PMIx launcher, plain RANK/WORLD_SIZE, or nobody (a single process)."""

MPI_LAUNCHERS = ("openmpi", "mpich", "slurm", "lsf", "pmix")
"""The launchers whose processes form one MPI job by themselves (MPI_Init finds the peers)."""

LAUNCHER_LABELS = {
    "torchrun": "torchrun",
    "openmpi": "Open MPI mpirun/prterun",
    "mpich": "MPICH/Hydra mpiexec",
    "slurm": "Slurm srun",
    "lsf": "LSF jsrun",
    "pbs": "PBS/OpenPBS",
    "pmix": "PMIx launcher",
    "env": "RANK/WORLD_SIZE",
    "none": "no launcher",
}
"""How messages name each launcher."""

MPI_FLAVOURS = ("openmpi", "mpich")
"""The MPI families cudampi tells apart: Open MPI (mpirun/prterun, ``--mca``, ``-x``) and MPICH's
(Hydra's mpiexec, ``-genv``; MPICH, Intel MPI, MVAPICH, Cray MPICH)."""

LAUNCH_FLAVOURS = (*MPI_FLAVOURS, "slurm", "lsf")
"""The launchers ``cudampi launch`` runs: an MPI family's own mpiexec, Slurm's srun or LSF's
jsrun."""

LAUNCH_FAMILIES = ("slurm", "lsf", "pbs", "openmpi", "mpich")
"""The launcher families, one module each in :mod:`cudampi.launch.launchers` (this is their
order: the batch systems first, so the allocation a process runs in is found before an MPI's
own launcher is taken)."""

JOB_SYSTEMS = ("slurm", "lsf", "pbs")
"""The batch systems whose allocations ``cudampi launch`` reads (:func:`cudampi.rankenv.job_env`
looks for them in this order)."""


@dataclass(frozen=True)
class RankVars:
    """The variables one launcher sets in the processes it starts (each a tuple: the first one
    set counts). Only :mod:`cudampi.rankenv` reads them."""

    rank: str
    size: tuple[str, ...]
    local_rank: tuple[str, ...] = ()
    local_size: tuple[str, ...] = ()
    node_rank: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    """Set (to anything) only where this launcher started the process."""
    needs_int: tuple[str, ...] = ()
    """The first of these that is set must be an integer for this launcher to count."""
    tasks_per_node: tuple[str, ...] = ()
    """Each node's task count in Slurm's form (``2(x3),1``): the local size at the node rank."""
    nodes: tuple[str, ...] = ()
    """The node list of the process's own job (step), in Slurm's compressed form."""
    job_key: tuple[str, ...] = ()
    """Values that name one job: its ranks agree on a port from them without talking."""
    daemon: bool = False
    """The launcher's own daemon (prted, hydra_pmi_proxy) is each rank's parent, so a rank may
    die with it (``PR_SET_PDEATHSIG``); not so under srun, whose slurmstepd forks tasks from
    threads that may end before them."""
    mpi_job: bool = False
    """Its processes always form one MPI job (rank 0's address can be sent over MPI); srun's
    need not (``srun --mpi=none``)."""


RANK_VARS = {
    "torchrun": RankVars(
        "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",), ("GROUP_RANK",),
        needs=("TORCHELASTIC_RUN_ID",),
    ),
    "openmpi": RankVars(
        "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",), job_key=("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"),
        daemon=True, mpi_job=True,
    ),
    "mpich": RankVars(
        "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",),
        job_key=("PMI_PORT", "HYDI_CONTROL_FD"), daemon=True, mpi_job=True,
    ),
    # a job step's tasks only: a batch script has SLURM_PROCID and SLURM_NTASKS but no step
    "slurm": RankVars(
        "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        ("SLURM_LOCALID",), (), ("SLURM_NODEID",), needs_int=("SLURM_STEP_ID", "SLURM_STEPID"),
        tasks_per_node=("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
        nodes=("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"), job_key=("SLURM_JOB_ID", "SLURM_STEP_ID"),
    ),
    "lsf": RankVars(
        "JSM_NAMESPACE_RANK", ("JSM_NAMESPACE_SIZE",), ("JSM_NAMESPACE_LOCAL_RANK",),
        ("JSM_NAMESPACE_LOCAL_SIZE",), needs=("LSB_JOBID",), job_key=("LSB_JOBID",), mpi_job=True,
    ),
    "pmix": RankVars("PMIX_RANK", ("OMPI_COMM_WORLD_SIZE",), mpi_job=True),
    "env": RankVars(
        "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",),
        ("GROUP_RANK", "NODE_RANK"), needs_int=("WORLD_SIZE",),
    ),
}  # fmt: skip
"""Each launcher's variables in the processes it starts (:data:`LAUNCHERS` but ``none``)."""


@dataclass(frozen=True)
class JobVars:
    """The variables a batch system sets inside one of its jobs (allocations): each a tuple,
    the first one set counts. Only :mod:`cudampi.rankenv` reads them; the launcher family of
    the system (:mod:`cudampi.launch.launchers`) turns them into hosts and tasks."""

    job_id: tuple[str, ...]
    """Set inside a job of this system, and only there."""
    nodes: tuple[str, ...] = ()
    """The job's node list (Slurm's compressed form)."""
    nodefile: tuple[str, ...] = ()
    """A file naming one host per line, once per slot (PBS_NODEFILE, LSB_DJOB_HOSTFILE)."""
    host_counts: tuple[str, ...] = ()
    """``host count host count ...`` (LSF's LSB_MCPU_HOSTS)."""
    tasks: tuple[str, ...] = ()
    """The job's task count."""
    node_count: tuple[str, ...] = ()
    """The job's node count."""


JOB_VARS = {
    "slurm": JobVars(
        ("SLURM_JOB_ID", "SLURM_JOBID"), nodes=("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
        tasks=("SLURM_NTASKS",), node_count=("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    ),
    "lsf": JobVars(
        ("LSB_JOBID",), nodefile=("LSB_DJOB_HOSTFILE",), host_counts=("LSB_MCPU_HOSTS",),
    ),
    "pbs": JobVars(("PBS_JOBID",), nodefile=("PBS_NODEFILE",), node_count=("PBS_NUM_NODES",)),
}  # fmt: skip
"""Each batch system's job variables (:data:`JOB_SYSTEMS`)."""

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
