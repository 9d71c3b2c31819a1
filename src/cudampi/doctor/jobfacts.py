"""The job doctor's facts (pure): one node's doctor run as one column of the nodes x facts table
(:func:`node_summary`), and what differs between the nodes, each difference with its
consequence and fix (:func:`differences`, :func:`difference_findings`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cudampi.doctor.links import Finding

if TYPE_CHECKING:
    from cudampi.doctor.gather import Facts
    from cudampi.doctor.report import Check

FACTS = (
    "MPI library",
    "mpirun on PATH",
    "host p2p",
    "UCX",
    "GPUs",
    "driver",
    "CUDA",
    "torch",
    "NCCL",
    "GPUDirect RDMA",
    "CUDA-aware MPI",
    "ipc engine",
    "/dev/shm",
)
"""The table's rows, in order; a node's settings (``env NAME``) follow them."""

SETTING_PREFIXES = ("CUDAMPI_", "UCX_", "NCCL_", "OMPI_MCA_", "MPIR_CVAR_", "PRTE_MCA_", "MPI4PY_")
"""The variables of a node's environment that the table compares: settings of cudampi, UCX,
NCCL, Open MPI, MPICH and mpi4py."""

PER_NODE = frozenset({"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"})
"""Set on each node for itself (the rank bootstrap picks the interface that routes to rank 0):
they may differ without harm."""


def settings_of(env: Mapping[str, str]) -> dict[str, str]:
    """The compared settings of ``env``: cudampi's own (its ``Config`` fields, not the messages
    ``cudampi launch`` passes to its ranks), UCX's, NCCL's, Open MPI's, MPICH's, mpi4py's."""
    from cudampi.config import Config
    from cudampi.probe.runtime import LAUNCHER_ENV_PREFIXES

    ours = {Config.env_name(n) for n in Config.fields()}
    return {
        k: v
        for k, v in sorted(env.items())
        if k.startswith(SETTING_PREFIXES)
        and not k.startswith(LAUNCHER_ENV_PREFIXES)
        and (not k.startswith("CUDAMPI_") or k in ours)
        and k not in PER_NODE
    }


def _status(checks: Mapping[str, Check], name: str) -> str:
    c = checks.get(name)
    return c.status if c is not None else "n/a"


def node_summary(f: Facts, checks: Sequence[Check]) -> dict[str, Any]:
    """One node's column: ``rows`` (fact -> what the table shows) and ``keys`` (fact -> what is
    compared: the shown text without figures that vary from run to run), its settings, and what
    the link test needs from it (the device backend, whether device p2p was proven)."""
    by = {c.name: c for c in checks}
    lib = f.library
    rows: dict[str, str] = {}
    keys: dict[str, str] = {}

    def put(name: str, shown: str, key: str | None = None) -> None:
        rows[name] = shown
        keys[name] = shown if key is None else key

    put("MPI library", f"{lib.vendor} {lib.version}" if lib.ok else f"none ({lib.error})")
    vendor, version = f.path_launcher[1], f.path_launcher[2]
    put("mpirun on PATH", f"{vendor} {version}" if vendor else "none")
    runs = f.runtime.runs if f.runtime is not None else {}
    host = runs.get("host_p2p")
    if host is None:
        put("host p2p", "not run", "not run")
    elif host.outcome.ok:
        put("host p2p", f"ok {host.outcome.gbps or 0:.2f} GB/s", "ok")
    else:
        put("host p2p", f"{host.outcome.status}: {host.outcome.detail}"[:60])
    put("UCX", _ucx(f))
    gpus = f.gpu_system.gpus
    if gpus:
        models = sorted({g.name for g in gpus})
        put("GPUs", f"{len(gpus)} x {', '.join(models)}")
    else:
        n = f.python_gpu.gpu_count
        put("GPUs", f"{n} (torch/CuPy)" if n else "none")
    put("driver", f.gpu_system.nvml.driver or "-")
    py = f.python_gpu
    put("CUDA", py.torch_cuda or (_cuda_runtime(py.cupy_runtime) if py.cupy_runtime else "-"))
    put("torch", py.torch_version or "-")
    put("NCCL", py.nccl_version or "-")
    gd = by.get("GPUDirect RDMA")
    peer = "nvidia_peermem" if f.gpu_system.peermem_loaded else "no nvidia_peermem"
    put("GPUDirect RDMA", f"{_status(by, 'GPUDirect RDMA')}: {peer}" if gd else "-")
    put("CUDA-aware MPI", _verdict(by.get("CUDA-aware MPI")), _status(by, "CUDA-aware MPI"))
    ipc = runs.get("device_ipc")
    if ipc is not None and ipc.outcome.ok:
        put("ipc engine", f"ok {ipc.outcome.gbps or 0:.0f} GB/s", "ok")
    else:
        put("ipc engine", _status(by, "ipc engine"))
    shm = f.shm
    if shm is not None:
        put(
            "/dev/shm",
            f"{_gib(shm.size)}, {_gib(shm.free)} free",
            f"{_gib(shm.size)} {_status(by, '/dev/shm')}",
        )
    else:
        put("/dev/shm", "none")
    p2p = runs.get("device_p2p")
    return {
        "rows": rows,
        "keys": keys,
        "settings": settings_of(f.settings_env),
        "device_backend": py.device_backend,
        "device_p2p": bool(p2p is not None and p2p.outcome.ok),
        "gpus": len(gpus) or py.gpu_count,
    }


def _ucx(f: Facts) -> str:
    if not f.ucx:
        return "none"
    u = f.ucx[0]
    ver = u.version.version if u.version and u.version.version else None
    cuda = ",".join(u.transports.cuda) if u.transports is not None else ""
    return (f"{ver} ({u.source})" if ver else u.source) + (f" {cuda}" if cuda else "")


def _cuda_runtime(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _verdict(check: Check | None) -> str:
    if check is None:
        return "-"
    if check.status == "ok":
        return "yes" if "collectives work" in check.detail else "p2p only"
    return check.status if check.status == "n/a" else "not proven"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}G" if n >= (1 << 30) else f"{n >> 20}M"


@dataclass(frozen=True)
class Difference:
    """One fact that is not the same on every node."""

    fact: str
    values: dict[str, str]
    """node -> what the table shows for it ("-" where unset)."""
    odd: tuple[str, ...]
    """The nodes apart from the most common value (all but one group when none is)."""
    common: str | None
    """The most common value, when one value is held by more nodes than any other."""

    def to_json(self) -> dict[str, Any]:
        return {
            "fact": self.fact,
            "values": self.values,
            "odd": list(self.odd),
            "common": self.common,
        }


def table(nodes: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The table's rows (facts, then every setting set on some node) and node -> row -> cell."""
    settings = sorted({k for s in nodes.values() for k in s.get("settings", {})})
    names = [*FACTS, *(f"env {k}" for k in settings)]
    cells = {}
    for node, s in nodes.items():
        row = {k: str(v) for k, v in s.get("rows", {}).items()}
        for k in settings:
            row[f"env {k}"] = s.get("settings", {}).get(k, "-")
        cells[node] = row
    return names, cells


def differences(nodes: Mapping[str, Mapping[str, Any]]) -> list[Difference]:
    """The facts whose compared value is not the same on every node of ``nodes`` (node ->
    :func:`node_summary`), in table order."""
    rows, cells = table(nodes)
    out = []
    for fact in rows:
        keys = {
            n: str(s.get("keys", {}).get(fact, cells[n].get(fact, "-"))) for n, s in nodes.items()
        }
        if fact.startswith("env "):
            keys = {n: cells[n][fact] for n in nodes}
        if len(set(keys.values())) < 2:
            continue
        groups: dict[str, list[str]] = {}
        for n, k in keys.items():
            groups.setdefault(k, []).append(n)
        sizes = sorted((len(g) for g in groups.values()), reverse=True)
        common = max(groups, key=lambda k: len(groups[k])) if sizes[0] > sizes[1] else None
        odd = tuple(n for n in nodes if common is None or keys[n] != common)
        values = {n: cells[n].get(fact, "-") for n in nodes}
        shown = values[groups[common][0]] if common is not None else None
        out.append(Difference(fact, values, odd, shown))
    return out


def difference_findings(diffs: Sequence[Difference]) -> list[Finding]:
    """Each difference once, with what it does to a job across the nodes and the fix."""
    return [_finding(d) for d in diffs]


def _finding(d: Difference) -> Finding:
    odd = ", ".join(d.odd)
    has = "; ".join(f"{n}: {d.values[n]}" for n in d.odd)
    what = f"{d.fact} differs: {has}" + (f" (the others: {d.common})" if d.common else "")
    subject = d.odd[0] if len(d.odd) == 1 else odd
    consequence, fix, severity = _meaning(d, odd)
    return Finding(subject, what, consequence, fix, severity)


_SAME = "install the same on every node (one image, one environment)"


def _meaning(d: Difference, odd: str) -> tuple[str, str, str]:
    """(consequence, fix, severity) of one difference."""
    f = d.fact
    if f.startswith("env "):
        return _setting(f[4:], odd)
    table_: dict[str, tuple[str, str, str]] = {
        "MPI library": (
            f"ranks on {odd} load another MPI than the others: they cannot join one MPI job "
            "(MPI_Init fails, or each rank starts a world of its own)",
            f"make {odd} load the same MPI: check what its environment sets (MPI4PY_LIBMPI, "
            "LD_LIBRARY_PATH, the modules its shell startup loads) and the MPI installed there; "
            f"`cudampi doctor` on {odd} names the library mpi4py loads",
            "fail",
        ),
        "mpirun on PATH": (
            f"a job started from a shell on {odd} (a batch script, a plain mpirun) takes another "
            "launcher, which cannot start the others' MPI",
            "put the same MPI's bin folder first on PATH on every node (its shell startup or "
            "module)",
            "warn",
        ),
        "host p2p": (
            f"MPI does not work between two ranks on {odd} itself",
            f"run `cudampi doctor` on {odd} for the reason",
            "fail",
        ),
        "UCX": (
            f"UCX on {odd} is another build: its transports (device memory among them) differ "
            "from the other nodes'",
            _SAME,
            "warn",
        ),
        "GPUs": (
            "the nodes have different GPUs: ranks per node (--gpus-per-node) and memory per "
            "rank must fit the smallest, and the slowest GPU sets the pace",
            "use nodes of one kind for the job, or size it for the smallest",
            "warn",
        ),
        "driver": (
            f"another NVIDIA driver on {odd}: the CUDA versions it runs and its fixes differ",
            "install the same driver on every node",
            "warn",
        ),
        "CUDA": (
            f"another CUDA on {odd}: torch, CuPy and NCCL builds must match across ranks",
            _SAME,
            "warn",
        ),
        "torch": (
            "torch.distributed needs the same torch on every rank (its collectives' wire format "
            "and checks change between versions)",
            _SAME,
            "fail",
        ),
        "NCCL": (
            "NCCL needs the same version on every rank: mixed versions fail or hang in "
            "ncclCommInitRank",
            _SAME,
            "fail",
        ),
        "GPUDirect RDMA": (
            f"device traffic between nodes is staged through host memory on {odd}",
            f"sudo modprobe nvidia_peermem on {odd} (part of the NVIDIA driver)",
            "warn",
        ),
        "CUDA-aware MPI": (
            "the nodes' MPI stacks prove different things about device memory: a cudampi "
            "Communicator across them stops at its creation ('the ranks disagree on device "
            "p2p'), on every rank",
            f"make {odd}'s stack the same as the others' (see its other rows), then run "
            "`cudampi doctor --hosts ...` again so every node caches the same proof",
            "fail",
        ),
        "ipc engine": (
            f"cudampi's ipc engine (GPU kernels inside a node) works differently on {odd}",
            f"run `cudampi doctor` on {odd} for its ipc engine row",
            "warn",
        ),
        "/dev/shm": (
            f"/dev/shm on {odd} is another size or in another state: MPI's, NCCL's and UCX's "
            "shared memory there runs out sooner (a rank dies with SIGBUS)",
            f"give /dev/shm on {odd} the others' size (docker --shm-size, --ipc=host, a "
            "memory emptyDir); python -m cudampi.shm --remove for stale segments",
            "warn",
        ),
    }
    return table_.get(f, (f"{f} differs on {odd}", _SAME, "warn"))


def _setting(name: str, odd: str) -> tuple[str, str, str]:
    from cudampi.config import ENV_PREFIX, Config

    fix = (
        f"set {name} the same on every node: remove it from {odd}'s shell startup, module or "
        f"container environment, or pass it to every rank (cudampi launch -x {name}=VALUE)"
    )
    if name.startswith(ENV_PREFIX):
        field_ = Config.fields().get(name[len(ENV_PREFIX) :].lower())
        if field_ is not None and field_.metadata.get("agreed"):
            return (
                f"every cudampi Communicator across these nodes stops at its creation, on every "
                f"rank: the ranks must agree on {name} ({field_.metadata.get('doc', '')})",
                fix,
                "fail",
            )
        doc = field_.metadata.get("doc", "") if field_ is not None else ""
        return (f"cudampi behaves differently on {odd} ({doc})", fix, "warn")
    kinds = {
        "UCX_": f"UCX on {odd} runs with other settings: its ranks may find no transport in "
        "common with the others' (the job fails to connect) or take a slower one",
        "NCCL_": f"NCCL on {odd} runs with other settings: NCCL needs the same algorithm and "
        "protocol settings on every rank, or it hangs or fails",
        "OMPI_MCA_": f"Open MPI on {odd} picks other components: ranks may not connect (no "
        "common transport) or take a slower path",
        "PRTE_MCA_": f"Open MPI's daemons on {odd} run with other settings",
        "MPIR_CVAR_": f"MPICH on {odd} runs with other settings",
        "MPI4PY_": f"mpi4py on {odd} is set up differently (MPI4PY_LIBMPI picks another MPI "
        "library)",
    }
    for prefix, words in kinds.items():
        if name.startswith(prefix):
            return (words, fix, "warn")
    return (f"{name} differs on {odd}", fix, "warn")
