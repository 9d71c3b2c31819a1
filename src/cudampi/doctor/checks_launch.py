"""The doctor's launcher checks: who started this process, its GPU, the MPI / UCX / NCCL settings, the
network interfaces, /dev/shm and the capabilities cache. Pure."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from cudampi.doctor.report import LAUNCH, Check
from cudampi.names import OPEN_MPI
from cudampi.pmi import mpich
from cudampi.probe.gpu import gpu_for_local_rank, visible_devices
from cudampi.probe.interfaces import Interface, nccl_ifname_matches, nccl_ifname_missing
from cudampi.probe.mpi_library import MpiLibrary
from cudampi.probe.ompi import OmpiInfo
from cudampi.rankenv import LauncherInfo
from cudampi.shm import MPICH_PREFIXES, ShmState


def check_launcher(info: LauncherInfo) -> Check:
    if info.name == "none":
        return Check(
            "launcher",
            "ok",
            "not inside a launcher (the doctor starts its own probe ranks)",
            "",
            LAUNCH,
        )
    return Check(
        "launcher",
        "ok",
        f"{info.name}: rank {info.rank} of {info.size}, local rank {info.local_rank}"
        f" (from {', '.join(info.evidence)})",
        "",
        LAUNCH,
    )


def check_launcher_mpis(library: MpiLibrary, torchrun: mpich.Choice, torchrun_mpi: str) -> Check:
    """Which MPI the ranks of each kind of launcher load, and what that costs: MPI launchers
    (mpirun, srun, ``cudampi launch``) start the MPI mpi4py loads, which the probe proved;
    torchrun, Lightning's and accelerate's launchers start plain processes, which cudampi joins
    through its PMI-1 server (:mod:`cudampi.pmi`), with the MPI ``torchrun`` says
    (:func:`cudampi.pmi.mpich.choose`; ``torchrun_mpi`` is its vendor, or "" if unknown)."""
    ours = " ".join(x for x in (library.vendor, library.version) if x) or "the MPI mpi4py loads"
    detail = f"mpirun, srun, cudampi launch: {ours} (probed)"
    if torchrun.path is None and library.vendor == OPEN_MPI:
        return Check(
            "MPI per launcher",
            "ok",
            f"{detail}; torchrun and the like: none, {ours} cannot join processes they start "
            "(it speaks only PMIx), so backend 'cudampi' fails there",
            f"{mpich.INSTALL} (PyPI's mpich wheel, where only cudampi loads it)",
            LAUNCH,
        )
    theirs = torchrun_mpi or "the MPI of MPI4PY_LIBMPI"
    if torchrun.path is None or theirs == ours:
        return Check(
            "MPI per launcher", "ok", f"{detail}; torchrun and the like: the same", "", LAUNCH
        )
    return Check(
        "MPI per launcher",
        "ok",
        f"{detail}; torchrun and the like: {theirs} ({torchrun.why}), not probed: device "
        "arrays staged through host memory, across nodes too",
        "",
        LAUNCH,
    )


def check_gpu_mapping(info: LauncherInfo, env: Mapping[str, str], physical: int) -> Check:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    visible = visible_devices(env, physical)
    shown = "unset" if cvd is None else repr(cvd)
    if cvd is not None and not visible and physical:
        return Check(
            "local rank -> GPU",
            "fail",
            f"CUDA_VISIBLE_DEVICES={shown} hides every one of the {physical} GPU(s)",
            "unset CUDA_VISIBLE_DEVICES, or list valid indices/UUIDs",
            LAUNCH,
        )
    if physical == 0:
        return Check(
            "local rank -> GPU", "n/a", f"no GPU (CUDA_VISIBLE_DEVICES {shown})", "", LAUNCH
        )
    if info.local_rank is None:
        return Check(
            "local rank -> GPU",
            "ok",
            f"CUDA_VISIBLE_DEVICES {shown}: {len(visible)} visible; ranks bind to local_rank % {len(visible)}",
            "",
            LAUNCH,
        )
    gpu = gpu_for_local_rank(info.local_rank, visible)
    detail = f"local rank {info.local_rank} -> GPU {gpu} (CUDA_VISIBLE_DEVICES {shown}, {len(visible)} visible)"
    if info.local_size and info.local_size > len(visible):
        return Check(
            "local rank -> GPU",
            "warn",
            detail + f"; {info.local_size} local ranks share {len(visible)} GPU(s)",
            "start one rank per GPU (-n / --ntasks-per-node = GPUs per node)",
            LAUNCH,
        )
    return Check("local rank -> GPU", "ok", detail, "", LAUNCH)


def check_mpi_settings(
    env: Mapping[str, str], gpus_present: bool, ompi: OmpiInfo | None = None
) -> Check:
    """OMPI_MCA_* / UCX_* / NCCL_* settings that take CUDA away, as
    :func:`cudampi.env.settings.check_settings` (the one judge of them) finds them."""
    from cudampi.env.settings import check_settings as env_check_settings

    major = None
    if ompi is not None and ompi.version:
        try:
            major = int(ompi.version.split(".")[0])
        except ValueError:
            major = None
    found = env_check_settings(
        env,
        gpus=gpus_present,
        ompi_major=major,
        btl_components=ompi.btl if ompi is not None else None,
        built_with_cuda=ompi.built_with_cuda if ompi is not None else None,
    )
    # var, value, status, why, fix
    findings = [(f.name, f.value, f.status, f.detail, f.fix) for f in found]
    set_vars = sorted(k for k in env if k.startswith(("OMPI_MCA_", "UCX_", "NCCL_", "MPIR_CVAR_")))
    if not findings:
        shown = ", ".join(f"{k}={env[k]}" for k in set_vars) if set_vars else "none set"
        return Check(
            "MPI/UCX/NCCL settings", "ok", f"nothing that breaks CUDA ({shown})", "", LAUNCH
        )
    status = "fail" if any(f[2] == "fail" for f in findings) else "warn"
    detail = "; ".join(f"{var}={value!r} [{st}]: {why}" for var, value, st, why, _ in findings)
    fix = "; ".join(fx for *_, fx in findings if fx)
    return Check("MPI/UCX/NCCL settings", status, detail, fix, LAUNCH)


def check_interfaces(interfaces: Sequence[Interface], env: Mapping[str, str]) -> Check:
    usable = [i for i in interfaces if i.addresses and not i.loopback and i.up is not False]
    names = [i.name for i in interfaces]
    listing = ", ".join(f"{i.name} {i.addresses[0]}" for i in usable) or "none with an address"
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec:
        chosen = nccl_ifname_matches(spec, names)
        if not chosen:
            return Check(
                "network interfaces",
                "fail",
                f"NCCL_SOCKET_IFNAME={spec!r} matches none of {', '.join(names)}",
                f"export NCCL_SOCKET_IFNAME={usable[0].name if usable else 'eth0'}",
                LAUNCH,
            )
        return Check(
            "network interfaces",
            "ok",
            f"NCCL_SOCKET_IFNAME={spec!r} selects {', '.join(chosen)}; usable: {listing}",
            "",
            LAUNCH,
        )
    if not usable:
        return Check(
            "network interfaces",
            "warn",
            f"only loopback ({', '.join(names)}): single node only",
            "",
            LAUNCH,
        )
    return Check(
        "network interfaces",
        "ok",
        f"usable: {listing}; NCCL_SOCKET_IFNAME unset (for multi-node set it, e.g. "
        f"export NCCL_SOCKET_IFNAME={usable[0].name})",
        "",
        LAUNCH,
    )


def check_nccl_settings(env: Mapping[str, str], interfaces: Sequence[Interface]) -> Check:
    """The NCCL_* settings every rank will read (``cudampi launch`` forwards them to every
    host), and a NCCL_SOCKET_IFNAME entry that names an interface this host lacks."""
    found = sorted(k for k in env if k.startswith("NCCL_"))
    if not found:
        return Check("NCCL settings", "n/a", "no NCCL_* variable set: NCCL's defaults", "", LAUNCH)
    shown = ", ".join(f"{k}={env[k]}" for k in found)
    spec = env.get("NCCL_SOCKET_IFNAME")
    names = [i.name for i in interfaces]
    missing = nccl_ifname_missing(spec, names) if spec and names else []
    if not missing:
        return Check("NCCL settings", "ok", shown, "", LAUNCH)
    selected = nccl_ifname_matches(spec or "", names)
    usable = [i.name for i in interfaces if i.addresses and not i.loopback and i.up is not False]
    fix = (
        f"export NCCL_SOCKET_IFNAME={','.join(selected) if selected else (usable or ['eth0'])[0]}"
        " (or unset it where the hosts' interface names differ: cudampi launch picks the one "
        "that routes to rank 0 on every host)"
    )
    return Check(
        "NCCL settings",
        "warn" if selected else "fail",
        f"{shown}; NCCL_SOCKET_IFNAME names {', '.join(repr(m) for m in missing)}, which this "
        f"host lacks (it has {', '.join(names)})"
        + (f"; NCCL will use {', '.join(selected)}" if selected else "; NCCL finds no interface"),
        fix,
        LAUNCH,
    )


def check_cache(
    path: str | None, keys: Sequence[str], runtime_ran: bool, note: str, error: str = ""
) -> Check:
    if not runtime_ran:
        return Check("capabilities cache", "n/a", f"nothing probed: {note}", "", "cache")
    if error:
        return Check(
            "capabilities cache",
            "warn",
            f"not saved: {error}",
            "give a writable folder: --cache-dir DIR or CUDAMPI_CACHE_DIR=DIR; until then "
            "cudampi assumes nothing is CUDA-aware",
            "cache",
        )
    if path is None:
        return Check(
            "capabilities cache",
            "warn",
            "not saved: the host probes failed",
            "fix the failing runtime checks; until then cudampi assumes nothing is CUDA-aware",
            "cache",
        )
    return Check(
        "capabilities cache", "ok", f"saved to {path} under key {', '.join(keys)}", "", "cache"
    )


SHM_SMALL = 1 << 30
"""A /dev/shm below this is Docker's default kind (64 MiB): too small for the ranks of a node."""


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def check_shm(state: ShmState | None) -> Check:
    """``/dev/shm``: where the ranks of a node meet (MPI's shared-memory transports, NCCL, UCX,
    torch's DataLoader workers). Too small, a job dies with SIGBUS ("Bus error") once it fills;
    MPI segments that ended jobs left behind take its memory, and MPICH opens a stale segment
    whose name repeats as its own (cudampi.shm)."""
    if state is None:
        return Check("/dev/shm", "n/a", "no /dev/shm on this system", "", LAUNCH)
    details = [f"{_size(state.size)}, {_size(state.free)} free"]
    fixes = []
    if state.size < SHM_SMALL:
        details.append(
            "too small for the ranks of a node: MPI's shared-memory transports, NCCL, UCX and "
            "torch's DataLoader workers share it, and a job that fills it dies with SIGBUS "
            "('Bus error')"
        )
        fixes.append(
            "give the container more: docker run --shm-size=8g (or --ipc=host); on Kubernetes "
            "an emptyDir of medium Memory at /dev/shm (cudampi env k8s writes one)"
        )
    if state.stale:
        mpich = any(os.path.basename(p).startswith(MPICH_PREFIXES) for p in state.stale)
        n = len(state.stale)
        held = f"{n} stale MPI segment{'s' if n != 1 else ''}, {_size(state.stale_bytes)}"
        if not mpich and state.stale_bytes * 10 < state.size:
            # harmless: said in passing, on the check's one line (docs/doctor.md names the
            # command that removes them)
            details.append(held)
        else:
            why = (
                "MPICH opens a stale segment whose name comes round again as its own, and hangs "
                "or fails in MPI_Init"
                if mpich
                else "a tenth of /dev/shm or more"
            )
            details.append(
                f"{held}: shared memory of MPI jobs that are over (killed ranks and Open MPI "
                f"singletons leave it); {why}"
            )
            fixes.append("python -m cudampi.shm --remove (removes only those no process maps)")
    status = "warn" if fixes else "ok"
    return Check("/dev/shm", status, "; ".join(details), "; ".join(fixes), LAUNCH)
