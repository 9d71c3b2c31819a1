"""The launcher environment of this process: which launcher started it, its local rank and GPU,
settings that silently take CUDA away from MPI/UCX, and the network interfaces NCCL can use.

Everything here is a pure function of an environment mapping and tool output, except
:func:`query_interfaces` (reads /sys/class/net, runs ``ip -o addr``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cudampi.rankenv import LauncherInfo, launched_by

detect_launcher = launched_by
"""The doctor's name for :func:`cudampi.rankenv.launched_by`, until the doctor imports it from
there (issue 17, once issue 16's changes to the doctor land)."""


def visible_devices(env: Mapping[str, str], physical: int) -> list[str]:
    """The GPU identifiers this process may use: CUDA_VISIBLE_DEVICES (indices, UUIDs, MIG ids)
    up to the first invalid entry, as CUDA does; all ``physical`` GPUs when it is unset."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(physical)]
    out: list[str] = []
    for item in (s.strip() for s in raw.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit() and (int(item) < 0 or (physical and int(item) >= physical)):
            break  # CUDA stops at the first invalid ordinal
        out.append(item)
    return out


def gpu_for_local_rank(local_rank: int, visible: Sequence[str]) -> str | None:
    """The device a rank binds to under cudampi's rule: ``local_rank % n_visible``."""
    if not visible:
        return None
    return visible[local_rank % len(visible)]


@dataclass(frozen=True)
class SettingIssue:
    """One environment variable that breaks (fail) or weakens (warn) device communication."""

    var: str
    value: str
    severity: str
    """``fail`` or ``warn``."""
    why: str
    fix: str


def _truthy_off(value: str) -> bool:
    return value.strip().lower() in ("0", "n", "no", "false", "off", "disable", "disabled")


def check_cuda_settings(env: Mapping[str, str], gpus_present: bool) -> list[SettingIssue]:
    """OMPI_MCA_* / UCX_* / MPIR_CVAR_* / NCCL_* values that take CUDA away (pure).

    A setting that removes CUDA is ``fail`` when GPUs are present and ``warn`` without GPUs.
    """
    issues: list[SettingIssue] = []
    breaks = "fail" if gpus_present else "warn"
    tls = env.get("UCX_TLS")
    if tls is not None and tls.strip():
        items = [t.strip() for t in tls.split(",") if t.strip()]
        if tls.strip().startswith("^"):
            excluded = [t.lstrip("^") for t in items]
            bad = [t for t in excluded if t.startswith("cuda") or t == "gdr_copy"]
            if bad:
                issues.append(
                    SettingIssue(
                        "UCX_TLS",
                        tls,
                        breaks,
                        f"excludes the device-memory transport(s) {', '.join(bad)}",
                        f"unset UCX_TLS, or drop {', '.join(bad)} from its exclusion list",
                    )
                )
        elif not any(t in ("all", "cuda") or t.startswith("cuda") for t in items):
            issues.append(
                SettingIssue(
                    "UCX_TLS",
                    tls,
                    breaks,
                    "names no CUDA transport, so UCX cannot move device buffers "
                    "(they segfault or fail to register)",
                    f"unset UCX_TLS, or add cuda_copy,cuda_ipc: export UCX_TLS={tls},cuda_copy,cuda_ipc",
                )
            )
    pml = env.get("OMPI_MCA_pml")
    if pml is not None and gpus_present and pml.strip() in ("ob1", "^ucx", "cm"):
        issues.append(
            SettingIssue(
                "OMPI_MCA_pml",
                pml,
                "warn",
                f"pml {pml} keeps UCX (the CUDA-capable path of the PyPI and most cluster builds) "
                "out of point-to-point",
                "unset OMPI_MCA_pml or set it to ucx (mpirun --mca pml ucx)",
            )
        )
    for var in ("OMPI_MCA_opal_cuda_support", "OMPI_MCA_mpi_cuda_support"):
        if var in env and _truthy_off(env[var]):
            issues.append(
                SettingIssue(
                    var,
                    env[var],
                    breaks,
                    "switches off Open MPI's CUDA support at run time",
                    f"unset {var}",
                )
            )
    btl = env.get("OMPI_MCA_btl")
    if btl and gpus_present and "^" in btl and "smcuda" in btl:
        issues.append(
            SettingIssue(
                "OMPI_MCA_btl",
                btl,
                "warn",
                "excludes smcuda, the CUDA-aware shared-memory path of CUDA builds of Open MPI",
                "drop smcuda from OMPI_MCA_btl's exclusion list",
            )
        )
    for var in ("UCX_IB_GPU_DIRECT_RDMA",):
        if var in env and _truthy_off(env[var]):
            issues.append(
                SettingIssue(
                    var,
                    env[var],
                    "warn",
                    "disables GPUDirect RDMA: inter-node device traffic is staged through host memory",
                    f"unset {var}",
                )
            )
    for var in ("MPIR_CVAR_ENABLE_GPU", "MPICH_GPU_SUPPORT_ENABLED"):
        if var in env and _truthy_off(env[var]) and gpus_present:
            issues.append(
                SettingIssue(
                    var,
                    env[var],
                    "warn",
                    "switches off MPICH's GPU support",
                    f"unset {var} or set it to 1",
                )
            )
    for var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"):
        if env.get(var, "").strip() in ("1", "true", "yes"):
            issues.append(
                SettingIssue(
                    var,
                    env[var],
                    "warn",
                    f"turns off a NCCL transport ({var[5:-8].lower()}): slower, sometimes much slower",
                    f"unset {var} unless it works around a known hardware problem",
                )
            )
    return issues


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...] = ()
    up: bool | None = None

    @property
    def loopback(self) -> bool:
        return self.name == "lo" or any(a.startswith(("127.", "::1")) for a in self.addresses)


def parse_ip_o_addr(text: str) -> list[Interface]:
    """``ip -o addr`` lines ``4: eth0    inet 192.0.2.2/24 brd ...`` grouped per interface."""
    order: list[str] = []
    addrs: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\d+:\s+(\S+?)(?:@\S+)?\s+inet6?\s+(\S+)", line)
        if m:
            name, addr = m.group(1), m.group(2)
            if name not in addrs:
                order.append(name)
                addrs[name] = []
            addrs[name].append(addr)
    return [Interface(n, tuple(addrs[n])) for n in order]


def _ifname_spec(spec: str) -> tuple[bool, bool, list[str]]:
    """NCCL_SOCKET_IFNAME's documented syntax: (exclude ``^``, exact ``=``, the names)."""
    spec = spec.strip()
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    return exclude, exact, [s.strip() for s in spec.split(",") if s.strip()]


def nccl_ifname_matches(spec: str, names: Sequence[str]) -> list[str]:
    """Which interfaces NCCL_SOCKET_IFNAME selects: comma-separated prefixes, ``=`` for exact
    names, a leading ``^`` to exclude (NCCL's documented syntax)."""
    exclude, exact, items = _ifname_spec(spec)

    def hit(name: str) -> bool:
        return any(name == it if exact else name.startswith(it) for it in items)

    return [n for n in names if hit(n) != exclude]


def nccl_ifname_missing(spec: str, names: Sequence[str]) -> list[str]:
    """The entries of NCCL_SOCKET_IFNAME that name no interface among ``names`` (prefixes match
    by prefix, ``=`` names exactly); an exclusion list (``^``) names nothing NCCL needs."""
    exclude, exact, items = _ifname_spec(spec)
    if exclude:
        return []
    return [it for it in items if not any(n == it if exact else n.startswith(it) for n in names)]


@dataclass(frozen=True)
class LauncherEnv:
    """Everything :mod:`cudampi.doctor` needs about the launch environment."""

    launcher: LauncherInfo
    cuda_visible_devices: str | None
    interfaces: tuple[Interface, ...] = ()
    settings: dict[str, str] = field(default_factory=dict)
    """Every OMPI_MCA_*, UCX_*, NCCL_*, MPIR_CVAR_*, PRTE_MCA_* variable set."""


SETTING_PREFIXES = ("OMPI_MCA_", "UCX_", "NCCL_", "MPIR_CVAR_", "PRTE_MCA_", "MPICH_", "FI_")


def query_interfaces() -> list[Interface]:
    """Network interfaces with addresses (``ip -o addr``) and state (/sys/class/net)."""
    found: list[Interface] = []
    ip = shutil.which("ip")
    if ip:
        try:
            proc = subprocess.run([ip, "-o", "addr"], capture_output=True, text=True, timeout=10)
            found = parse_ip_o_addr(proc.stdout) if proc.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired):
            found = []
    sys_net = Path("/sys/class/net")
    states: dict[str, bool | None] = {}
    try:
        for p in sorted(sys_net.iterdir()):
            try:
                state = (p / "operstate").read_text().strip()
            except OSError:
                state = "unknown"
            states[p.name] = {"up": True, "down": False}.get(state)
    except OSError:
        pass
    names = [i.name for i in found]
    out = [Interface(i.name, i.addresses, states.get(i.name)) for i in found]
    out += [Interface(n, (), s) for n, s in states.items() if n not in names]
    return out


def query_launcher_env(env: Mapping[str, str] | None = None) -> LauncherEnv:
    env = os.environ if env is None else env
    return LauncherEnv(
        launched_by(env),
        env.get("CUDA_VISIBLE_DEVICES"),
        tuple(query_interfaces()),
        {k: v for k, v in sorted(env.items()) if k.startswith(SETTING_PREFIXES)},
    )
