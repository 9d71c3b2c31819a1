"""The one judge of the MPI / UCX / NCCL settings that break or slow a GPU job.

:func:`check_settings` is pure: give it an environment mapping and it returns the settings that
are wrong for GPU jobs (``fail``: known to crash, hang or silently fall back; ``warn``: slower,
a no-op, or a debugging switch left on), one small rule per variable (:data:`RULES`), each
finding a :class:`SettingFinding`. ``cudampi doctor`` and ``cudampi env check`` both call it; the
documented values themselves are :mod:`cudampi.env.recommended`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from cudampi.env.recommended import (
    NCCL_ENV_DOC,
    OMPI_RUNCUDA_FAQ,
    OMPI_TCP_DOC,
    UCX_FAQ,
    setting,
)
from cudampi.rankenv import job_node_count


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


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _infer_multi_node(env: Mapping[str, str]) -> bool | None:
    nodes = job_node_count(env)
    if nodes is not None:
        return nodes > 1
    if env.get("K_MPI_JOB_ROLE") or env.get("OMPI_MCA_orte_default_hostfile"):
        return True  # set by the Kubeflow MPI Operator for launcher and workers
    return None


_UCX_CUDA = ("cuda_copy", "cuda_ipc")


def _ucx_tls_finding(value: str) -> SettingFinding | None:
    items = _split(value)
    src = setting("UCX_TLS").source
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


@dataclass(frozen=True)
class _Facts:
    """What a rule may know beyond the environment (see :func:`check_settings`)."""

    gpus: bool
    multi_node: bool | None
    ompi_major: int | None
    btl_components: Collection[str] | None
    built_with_cuda: bool | None

    @property
    def breaks(self) -> str:
        """The status of a setting that takes CUDA away: fail where GPUs are, else warn."""
        return "fail" if self.gpus else "warn"


_Rule = Callable[[Mapping[str, str], _Facts], list[SettingFinding]]
_OFF = ("0", "n", "no", "false", "off", "disable", "disabled")
"""What the MPI libraries and UCX read as "off"."""


def _off(value: str) -> bool:
    return value.strip().lower() in _OFF


def _pml(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    pml = env.get("OMPI_MCA_pml", "").strip()
    source = setting("OMPI_MCA_pml").source
    if f.gpus and pml == "ob1":
        btl = env.get("OMPI_MCA_btl", "").strip()
        smcuda_on = "smcuda" in _split(btl) and not btl.startswith("^")
        return [
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
                source,
            )
        ]
    if f.gpus and pml in ("^ucx", "cm"):
        return [
            SettingFinding(
                "OMPI_MCA_pml",
                pml,
                "warn",
                f"pml {pml} keeps UCX (the CUDA-capable path of the PyPI and most cluster builds) "
                "out of point-to-point",
                "unset OMPI_MCA_pml or set it to ucx (mpirun --mca pml ucx)",
                source,
            )
        ]
    if pml == "ucx" and not f.gpus:
        return [
            SettingFinding(
                "OMPI_MCA_pml",
                pml,
                "warn",
                "pml ucx opens only when UCX finds one of pml_ucx_tls' transports (verbs, mlx5, "
                'cuda_ipc); on a host with none of them MPI_Init aborts with "No components were '
                'able to be opened in the pml framework" (seen here with the 5.0.11 wheel)',
                "unset OMPI_MCA_pml on hosts without GPUs or InfiniBand",
                source,
            )
        ]
    return []


def _btl(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    btl = env.get("OMPI_MCA_btl", "").strip()
    if not btl:
        return []
    btls = _split(btl.lstrip("^"))
    excludes = btl.startswith("^")
    source = setting("OMPI_MCA_btl").source
    out: list[SettingFinding] = []
    if (excludes and "self" in btls) or (not excludes and "self" not in btls):
        kept = (
            "^" + ",".join(b for b in btls if b != "self")
            if excludes
            else ",".join([*btls, "self"])
        )
        out.append(
            SettingFinding(
                "OMPI_MCA_btl",
                btl,
                "fail",
                "the self BTL is left out: a rank cannot send to itself, and MPI_Init aborts "
                '(seen here: "At least one pair of MPI processes are unable to reach each '
                'other ... forgetting to specify the self BTL")',
                f"export OMPI_MCA_btl={kept}",
                source,
            )
        )
    if not excludes:
        out += [c for name in btls if (c := _btl_component(btl, name, f)) is not None]
    pml = env.get("OMPI_MCA_pml", "").strip()
    if f.gpus and btls and not excludes and pml != "ucx" and "smcuda" not in btls:
        out.append(
            SettingFinding(
                "OMPI_MCA_btl",
                btl,
                "warn",
                "with these BTLs and no pml ucx, device buffers take ob1 through "
                f"{', '.join(btls)}: none of them handles device memory",
                "export OMPI_MCA_pml=ucx (then OMPI_MCA_btl can be unset)",
                setting("OMPI_MCA_pml").source,
            )
        )
    if not out and f.gpus and excludes and "smcuda" in btls:
        out.append(
            SettingFinding(
                "OMPI_MCA_btl",
                btl,
                "warn",
                "excludes smcuda, the CUDA-aware shared-memory path of CUDA builds of Open MPI",
                "drop smcuda from OMPI_MCA_btl's exclusion list",
                source,
            )
        )
    return out


def _btl_component(btl: str, name: str, f: _Facts) -> SettingFinding | None:
    """One BTL named in OMPI_MCA_btl, against the library's own list and its version."""
    if f.btl_components is not None and name not in f.btl_components and name != "self":
        why = (
            " (smcuda exists only in Open MPI builds with CUDA support; this library has none)"
            if name == "smcuda"
            else ""
        )
        return SettingFinding(
            "OMPI_MCA_btl",
            btl,
            "fail",
            f"names the BTL {name!r}, which this Open MPI does not have (it has "
            f"{', '.join(sorted(f.btl_components))}){why}: MPI_Init fails",
            f"remove {name} from OMPI_MCA_btl, or use OMPI_MCA_pml=ucx and unset OMPI_MCA_btl",
            setting("OMPI_MCA_btl").source,
        )
    if f.ompi_major is not None and f.ompi_major >= 5 and name == "openib":
        return SettingFinding(
            "OMPI_MCA_btl",
            btl,
            "fail",
            "openib was removed in Open MPI 5 (verbs support went to UCX)",
            "remove openib; use OMPI_MCA_pml=ucx for InfiniBand",
            "Open MPI developers' notes for v5.0: no verbs BTL in v5.0",
        )
    if f.ompi_major is not None and f.ompi_major >= 5 and name == "vader":
        return SettingFinding(
            "OMPI_MCA_btl",
            btl,
            "warn",
            "vader is the Open MPI 4 name of the shared-memory BTL; Open MPI 5 calls it sm",
            "write sm instead of vader",
            OMPI_TCP_DOC,
        )
    return None


def _opal_cuda_support(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    raw = env.get("OMPI_MCA_opal_cuda_support")
    if raw is None:
        return []
    value = raw.strip().lower()
    source = setting("OMPI_MCA_opal_cuda_support").source
    if value in ("1", "true", "yes", "on") and f.built_with_cuda is False:
        return [
            SettingFinding(
                "OMPI_MCA_opal_cuda_support",
                value,
                "fail",
                "asks for CUDA support from an Open MPI built without it (the PyPI wheel): MPI_Init "
                'aborts with "The user requested CUDA support ... but the library was not compiled '
                'with any support"',
                "unset OMPI_MCA_opal_cuda_support; for device buffers use pml ucx with a CUDA UCX",
                source,
            )
        ]
    if f.gpus and value in ("0", "false", "no", "off"):
        return [
            SettingFinding(
                "OMPI_MCA_opal_cuda_support",
                value,
                "warn",
                "switches off the CUDA support of a CUDA-built Open MPI (conda-forge's builds): "
                "device buffers are then treated as host memory",
                "export OMPI_MCA_opal_cuda_support=true",
                source,
            )
        ]
    return _cuda_support_off("OMPI_MCA_opal_cuda_support", raw, f)


def _mpi_cuda_support(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    raw = env.get("OMPI_MCA_mpi_cuda_support")
    return [] if raw is None else _cuda_support_off("OMPI_MCA_mpi_cuda_support", raw, f)


def _cuda_support_off(var: str, raw: str, f: _Facts) -> list[SettingFinding]:
    if not _off(raw):
        return []
    return [
        SettingFinding(
            var,
            raw,
            f.breaks,
            "switches off Open MPI's CUDA support at run time",
            f"unset {var}",
            OMPI_RUNCUDA_FAQ,
        )
    ]


def _oob_listen_mode(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    listen = env.get("OMPI_MCA_oob_tcp_listen_mode")
    source = setting("OMPI_MCA_oob_tcp_listen_mode").source
    if listen is not None and f.ompi_major is not None and f.ompi_major >= 5:
        return [
            SettingFinding(
                "OMPI_MCA_oob_tcp_listen_mode",
                listen,
                "warn",
                "an Open MPI 4 (ORTE) parameter: Open MPI 5's PRRTE runtime has no such parameter, "
                "so it does nothing here",
                "unset it on Open MPI 5",
                source,
            )
        ]
    if listen is not None and listen != "listen_thread":
        return [
            SettingFinding(
                "OMPI_MCA_oob_tcp_listen_mode",
                listen,
                "warn",
                f"{listen!r} is not listen_thread: mpirun accepts daemon connections one by one",
                "export OMPI_MCA_oob_tcp_listen_mode=listen_thread",
                source,
            )
        ]
    return []


def _ssh_agent(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    out = []
    for var in ("OMPI_MCA_plm_rsh_agent", "OMPI_MCA_plm_ssh_agent", "PRTE_MCA_plm_ssh_agent"):
        agent = env.get(var)
        if agent is not None and agent.strip().lower() in ("false", "0", "", "none"):
            out.append(
                SettingFinding(
                    var,
                    agent,
                    "fail" if f.multi_node else "warn",
                    "disables the ssh launcher: mpirun cannot start daemons on other nodes (this is "
                    "what conda-build's activation script exports; it does not belong in a job)",
                    f"unset {var}, or export OMPI_MCA_plm_rsh_agent=ssh",
                    setting("OMPI_MCA_plm_rsh_agent").source,
                )
            )
    return out


def _nccl_socket_ifname(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    ifname = env.get("NCCL_SOCKET_IFNAME")
    items = _split(ifname) if ifname is not None else []
    if not items or items[0].startswith("^"):
        return []
    if not all(n == "lo" or n.startswith("docker") for n in (i.lstrip("=") for i in items)):
        return []
    assert ifname is not None
    return [
        SettingFinding(
            "NCCL_SOCKET_IFNAME",
            ifname,
            "fail" if f.multi_node else "warn",
            "selects only loopback/Docker-bridge interfaces: NCCL's bootstrap cannot reach ranks "
            "on other nodes" + ("" if f.multi_node else " (fine on one node; fails on two)"),
            "export NCCL_SOCKET_IFNAME=^lo,docker (or the name of the cluster network, e.g. =eth0)",
            setting("NCCL_SOCKET_IFNAME").source,
        )
    ]


def _ucx_tls(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    tls = env.get("UCX_TLS")
    if tls is None or not tls.strip():
        return []
    if f.gpus:
        finding = _ucx_tls_finding(tls)
        if finding is not None:
            return [finding]
    items = _split(tls)
    if tls.strip().startswith("^"):
        excluded = [t.lstrip("^") for t in items]
        gone = [t for t in excluded if t.startswith("cuda") or t == "gdr_copy"]
        if not gone:
            return []
        why = f"excludes the device-memory transport(s) {', '.join(gone)}"
        fix = f"unset UCX_TLS, or drop {', '.join(gone)} from its exclusion list"
    elif not any(t in ("all", "cuda") or t.startswith("cuda") for t in items):
        why = (
            "names no CUDA transport, so UCX cannot move device buffers (they segfault or fail "
            "to register)"
        )
        fix = f"unset UCX_TLS, or add cuda_copy,cuda_ipc: export UCX_TLS={tls},cuda_copy,cuda_ipc"
    else:
        return []
    return [SettingFinding("UCX_TLS", tls, f.breaks, why, fix, setting("UCX_TLS").source)]


def _ucx_gpudirect(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    raw = env.get("UCX_IB_GPU_DIRECT_RDMA")
    if raw is None or not _off(raw):
        return []
    return [
        SettingFinding(
            "UCX_IB_GPU_DIRECT_RDMA",
            raw,
            "warn",
            "disables GPUDirect RDMA: inter-node device traffic is staged through host memory",
            "unset UCX_IB_GPU_DIRECT_RDMA",
            UCX_FAQ,
        )
    ]


def _nccl_disabled(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    out = []
    for var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"):
        value = env.get(var, "").strip()
        if value == "1":
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
        elif value in ("true", "yes"):
            out.append(
                SettingFinding(
                    var,
                    env[var],
                    "warn",
                    f"turns off a NCCL transport ({var[5:-8].lower()}): slower, sometimes much "
                    "slower",
                    f"unset {var} unless it works around a known hardware problem",
                    NCCL_ENV_DOC,
                )
            )
    return out


def _mpich_gpu(env: Mapping[str, str], f: _Facts) -> list[SettingFinding]:
    out: list[SettingFinding] = []
    if not f.gpus:
        return out
    for var in ("MPIR_CVAR_ENABLE_GPU", "MPICH_GPU_SUPPORT_ENABLED"):
        raw = env.get(var)
        if raw is None or not _off(raw):
            continue
        out.append(
            SettingFinding(
                var,
                raw,
                "warn",
                "switches off MPICH's GPU support: device buffers are not recognised",
                f"unset {var} (or =1) with a GPU-enabled MPICH",
                f"MPICH README.envvar: {var}",
            )
        )
    return out


RULES: tuple[_Rule, ...] = (
    _pml,
    _btl,
    _opal_cuda_support,
    _mpi_cuda_support,
    _oob_listen_mode,
    _ssh_agent,
    _nccl_socket_ifname,
    _ucx_tls,
    _ucx_gpudirect,
    _nccl_disabled,
    _mpich_gpu,
)
"""One small rule per variable (or per family of variables that mean one thing)."""


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

    The one judge of these variables (``cudampi doctor`` and ``cudampi env check`` both ask it).
    Pure: reads only its arguments. ``multi_node`` None infers it from Slurm / MPI Operator
    variables (unknown: a multi-node-only problem is a warning). ``ompi_major`` (4, 5) and
    ``btl_components`` (the BTLs ``ompi_info`` lists) and ``built_with_cuda``
    (``mpi_built_with_cuda_support``) enable the checks that depend on the library.
    """
    facts = _Facts(
        gpus,
        _infer_multi_node(env) if multi_node is None else multi_node,
        ompi_major,
        btl_components,
        built_with_cuda,
    )
    return [finding for rule in RULES for finding in rule(env, facts)]


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
