"""Names that cross packages, each written once: the calls, collective paths, reduce ops,
launchers and MPI flavours.

The ground floor (beside :mod:`cudampi.config` and :mod:`cudampi.errors`): it imports nothing,
and every package that speaks one of these names imports it from here instead of spelling its
own copy (docs/ARCHITECTURE.md, "one fact, one place").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """One call a Communicator makes: every list of calls in cudampi is read from :data:`CALLS`
    (the cross-rank check's codes, the ipc kernels' signatures, path choice, torch's and the
    benchmarks' names), so a new collective is one row here plus the engines that run it."""

    name: str
    code: int
    """Its number in call signatures (the cross-rank check, the ipc kernels' signature words);
    one byte, unique, never reused for another call."""
    reduces: bool = False
    """It takes a reduce op and combines the ranks' data."""
    vector: bool = False
    """Ranks may pass different numbers of elements (per-rank counts), so a rank cannot tell
    from its own buffer what its peers pass."""
    rooted: bool = False
    """One rank (``root``) is the only source or the only destination."""
    p2p: bool = False
    """A message between two ranks (user point-to-point), not a collective."""
    data: bool = True
    """It moves array data (barrier and split move none)."""
    form: str = "elementwise"
    """How its output follows from its input (:mod:`cudampi.comm.calls` prepares each form):
    ``elementwise`` (the input's shape: allreduce, reduce, broadcast in place), ``gathering``
    (every rank's input, stacked or concatenated), ``scattering`` (a block of the root's
    input), ``block_reduction`` (a block of the reduction), ``exchange`` (blocks to and from
    every rank), ``sync`` (no data), ``message`` (point-to-point)."""
    engine: str = ""
    """The engine method that runs it (:mod:`cudampi.comm.engines.base`; "" for none)."""
    bus: str = "1"
    """How many bytes cross each rank's links per byte of the call's size in an optimal
    algorithm, for ``n`` ranks: ``2(n-1)/n``, ``(n-1)/n`` or ``1`` (nccl-tests' bus-bandwidth
    factor)."""
    blocked: bool = False
    """Its sized buffer holds one block per rank (reduce_scatter's input, allgather's output,
    alltoall's): benchmarks round a rank's block as nccl-tests does."""


CALLS: dict[str, Call] = {
    c.name: c
    for c in (
        Call("allreduce", 1, reduces=True, engine="allreduce", bus="2(n-1)/n"),
        Call("reduce", 2, reduces=True, rooted=True, engine="reduce"),
        Call("broadcast", 3, rooted=True, engine="broadcast"),
        Call("allgather", 4, form="gathering", engine="allgatherv", bus="(n-1)/n", blocked=True),
        Call("allgatherv", 5, vector=True, form="gathering", engine="allgatherv", bus="(n-1)/n"),
        Call("gather", 6, rooted=True, form="gathering", engine="gatherv"),
        Call("scatter", 7, rooted=True, form="scattering", engine="scatterv"),
        Call(
            "reduce_scatter",
            8,
            reduces=True,
            form="block_reduction",
            engine="reduce_scatterv",
            bus="(n-1)/n",
            blocked=True,
        ),
        Call(
            "alltoall",
            9,
            vector=True,
            form="exchange",
            engine="alltoallv",
            bus="(n-1)/n",
            blocked=True,
        ),
        Call("barrier", 10, data=False, form="sync"),
        Call("split", 11, data=False, form="sync"),
        Call("send", 16, p2p=True, form="message", engine="send"),
        Call("recv", 17, p2p=True, form="message", engine="recv"),
        Call("sendrecv", 18, p2p=True, form="message", engine="sendrecv"),
        Call("isend", 19, p2p=True, form="message", engine="isend"),
        Call("irecv", 20, p2p=True, form="message", engine="irecv"),
    )
}
"""Every call, by name. Collectives first, in the order the benchmarks and docs list them."""

COLLECTIVES = tuple(c.name for c in CALLS.values() if not c.p2p)
"""The collective calls' names."""

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
