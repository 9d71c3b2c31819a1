"""Choosing a collective's path per call: from what the probe proved, the array and its size.

Order of precedence: the call's ``path=`` > the Communicator's ``path=`` > CUDAMPI_PATH > auto.
A device buffer reaches an MPI call only where the probe (or an explicit ``cuda_aware=yes`` /
``native_collectives=yes``) says that call works with device memory: on the reference H200 stack
MPI's own device Allreduce segfaults even where device point-to-point is fine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cudampi.config import Config
from cudampi.errors import ConfigError, DeviceError
from cudampi.names import PATHS
from cudampi.probe.capabilities import Capabilities, ProbeOutcome

REDUCING = ("allreduce", "reduce", "reduce_scatter")
P2P = ("send", "recv", "isend", "irecv", "sendrecv")


class PathChoice(str):
    """A path name (a ``str``) that also carries ``reason`` and the ``engine`` that runs it.

    engine: ``mpi`` (MPI's own collective on the buffers), ``alg`` (cudampi's algorithms with
    direct transport), ``staged`` (through host buffers; ``inner`` says what runs on the host),
    ``ipc`` (GPU kernels over CUDA IPC, :mod:`cudampi.comm.engines.ipc`).
    """

    reason: str
    engine: str
    inner: str
    label: str
    """What the ranks must agree on: the path plus, where it differs, what actually runs (set
    once: every call reads it)."""

    def __new__(cls, path: str, reason: str, engine: str, inner: str = "") -> PathChoice:
        obj = super().__new__(cls, path)
        obj.reason = reason
        obj.engine = engine
        obj.inner = inner
        obj.label = f"{path}-alg" if engine == "alg" and path in ("host", "native") else str(path)
        return obj


@dataclass(frozen=True)
class DeviceSupport:
    """What MPI may be given device memory for, and why we believe it."""

    p2p: bool
    p2p_why: str
    collectives: bool
    collectives_why: str
    ipc: bool = False
    """May ``auto`` run device collectives on the ipc engine (see :func:`ipc_support`)?"""
    ipc_why: str = "the ipc engine was not probed (run `cudampi doctor`)"
    staged_below: int = 0
    """``auto`` stages device collectives under this many bytes instead of gpu-ring (see
    :func:`staged_below`); 0: never."""
    unprobed: str = ""
    """Why auto decides without the probe's word on this stack ("" once it was probed): no
    entry in the capabilities cache, or one that predates the ipc engine's probe."""
    nccl: bool = False
    """May ``auto`` run device collectives on the nccl engine (see :func:`nccl_span`)?"""
    nccl_why: str = "the nccl engine was not probed (run `cudampi doctor` on a GPU per rank)"
    nccl_span: tuple[int, int] = (0, 0)
    """The message sizes [lo, hi) in bytes where auto takes nccl (``NO_LIMIT``: no end)."""


NO_LIMIT = 1 << 62
"""The open end of a size span."""

NCCL_AUTO_CALLS = ("allreduce", "reduce", "broadcast", "reduce_scatter")
"""The collectives auto may give the nccl engine: every rank passes the same number of bytes,
so a per-size choice is the same on every rank (uneven gathers and all-to-alls are not)."""

NCCL_AUTO_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""NCCL reduces these with every op cudampi takes for them (integers' bitwise ops, int16 and
complex products it lacks): auto gives it nothing it would refuse."""


def nccl_span(
    ipc_latency_us: float | None,
    ipc_gbps: float | None,
    nccl_latency_us: float | None,
    nccl_gbps: float | None,
) -> tuple[int, int]:
    """The sizes [lo, hi) in bytes where ``auto`` takes the nccl engine over ipc, from what the
    doctor measured of each on this host (a 4 KiB allreduce's latency and an allreduce's
    bandwidth at the probe's size): each engine taken as ``t(n) = latency + n / bandwidth``,
    nccl where its ``t`` is lower. No nccl figures: never (0, 0); no ipc figures (ipc not
    proven): every size."""
    if not nccl_latency_us or not nccl_gbps:
        return (0, 0)
    if not ipc_latency_us or not ipc_gbps:
        return (0, NO_LIMIT)
    dl = nccl_latency_us - ipc_latency_us  # us
    slope = 1e-3 / nccl_gbps - 1e-3 / ipc_gbps  # us per byte: nccl's minus ipc's
    if slope == 0:
        return (0, NO_LIMIT) if dl < 0 else (0, 0)
    cross = -dl / slope  # bytes where both take as long
    if slope < 0:  # nccl moves bytes faster: it wins above the crossing
        return (max(0, math.ceil(cross)), NO_LIMIT) if cross < NO_LIMIT else (0, 0)
    return (0, min(NO_LIMIT, math.ceil(cross))) if cross > 0 else (0, 0)


def nccl_support(
    caps: Capabilities | None, ipc: bool, missing: str | None
) -> tuple[bool, str, tuple[int, int]]:
    """Whether auto may take the nccl engine on this host, why, and for which sizes: the probe
    proved it (2 ranks, a GPU each) and NCCL imports (``missing`` is None)."""
    if missing is not None:
        return False, f"the nccl engine is unavailable: {missing}", (0, 0)
    probed = caps.device_nccl if caps is not None else None
    if probed is None or probed.status == "skipped":
        detail = f" ({probed.detail})" if probed is not None and probed.detail else ""
        return False, f"the nccl engine was not probed here{detail}", (0, 0)
    if not probed.ok:
        return False, f"the probe found the nccl engine {probed.status}: {probed.detail}", (0, 0)
    assert caps is not None
    if not caps.nccl_latency_us or not probed.gbps:
        return False, "the nccl probe passed but measured no latency or bandwidth", (0, 0)
    span = nccl_span(
        caps.ipc_latency_us if ipc else None,
        caps.device_ipc.gbps if ipc else None,
        caps.nccl_latency_us,
        probed.gbps,
    )
    if span == (0, 0):
        return False, "the probe found ipc faster than nccl at every size", span
    lo, hi = span
    if not ipc:
        return True, "the probe proved the nccl engine correct (auto does not take ipc here)", span
    if span == (0, NO_LIMIT):
        sizes = "at every size"
    elif hi == NO_LIMIT:
        sizes = f"from {lo} bytes up"
    elif lo == 0:
        sizes = f"below {hi} bytes"
    else:
        sizes = f"from {lo} to {hi} bytes"
    return True, f"the probe proved the nccl engine correct and faster than ipc {sizes}", span


SHARED_GPU_STAGED_BELOW = 4 << 20
"""Ranks time-slicing one GPU (no MPS daemon): below this size staged beat gpu-ring at every
size measured on the H200, 2-4.5x up to 256 KiB and 1.4x at 2 MiB, and gpu-ring won from
16 MiB (docs/benchmarks.md, "the ipc engine, second round", MPS off)."""


def staged_below(shared_gpu: bool | None, mps: bool) -> int:
    """The size under which ``auto`` stages device collectives rather than run gpu-ring: where
    the ranks share a GPU without MPS, each device-to-device MPI message waits for the other
    context's time slice, and a copy to host and back costs less up to a few MiB."""
    return SHARED_GPU_STAGED_BELOW if shared_gpu and not mps else 0


def ipc_support(
    probed: ProbeOutcome | None,
    shared_gpu: bool | None,
    mps: bool,
    missing: str | None,
    *,
    latency_us: float | None = None,
    probed_mps: bool | None = None,
) -> tuple[bool, str]:
    """Whether ``auto`` takes the ipc engine, and why: the probe ran it correctly
    (``probed``), CuPy is there (``missing`` is None), and the ranks do not share a GPU without
    the MPS daemon. On the H200 with two ranks on one GPU, ipc was the fastest cudampi path at
    every size with MPS and the slowest at every size without it (docs/benchmarks.md), so the
    rule is per setting, not per size."""
    if missing is not None:
        return False, f"the ipc engine is unavailable: {missing}"
    if probed is None or probed.status == "skipped":
        return False, "the ipc engine was not probed (run `cudampi doctor`)"
    if not probed.ok:
        return False, f"the probe found the ipc engine {probed.status}: {probed.detail}"
    if shared_gpu and not mps:
        return False, (
            "the ranks share a GPU and the MPS daemon is not running: their contexts time-slice "
            "the GPU and ipc's kernels wait a time slice for each other (slower than gpu-ring "
            "there); start nvidia-cuda-mps-control -d, or use one GPU per rank"
        )
    speed = f", {latency_us:.0f} us at 4 KiB" if latency_us else ""
    if speed and probed_mps is not None and probed_mps != mps:
        speed += f" when probed with MPS {'on' if probed_mps else 'off'}"
    where = "ranks sharing a GPU under MPS" if shared_gpu else "one GPU per rank"
    return True, f"the probe proved the ipc engine correct ({where}{speed})"


def device_support(config: Config, caps: Capabilities | None, note: str = "") -> DeviceSupport:
    """What MPI may be given device memory for: the config's yes/no, else what the probe entry
    ``caps`` proved (see :func:`cudampi.probe.capabilities.lookup`; ``note`` says why there is
    none), and whether auto takes the ipc engine here. With :func:`mpi_support`, the one reader
    of the probe's verdicts: nothing else decides on them."""
    from cudampi.comm.engines.ipc import available
    from cudampi.probe.gpu import mps_active

    shared, mps = (caps.ipc_shared_gpu if caps is not None else None), mps_active()
    missing = available()
    ipc, ipc_why = ipc_support(
        caps.device_ipc if caps is not None else None,
        shared,
        mps,
        missing,
        latency_us=caps.ipc_latency_us if caps is not None else None,
        probed_mps=caps.ipc_mps if caps is not None else None,
    )
    nccl, nccl_why, span = nccl_support(caps, ipc, _nccl_missing(caps))
    unprobed = ""
    if caps is None:
        unprobed = "there is no valid probe result for this MPI stack on this host"
    elif missing is None and caps.device_ipc.status == "skipped":
        unprobed = "the cached probe result has no result for the ipc engine"
    return dataclasses.replace(
        mpi_support(config, caps, note),
        ipc=ipc,
        ipc_why=ipc_why,
        staged_below=staged_below(shared, mps),
        unprobed=unprobed,
        nccl=nccl,
        nccl_why=nccl_why,
        nccl_span=span,
    )


def _nccl_missing(caps: Capabilities | None) -> str | None:
    """Why NCCL cannot be imported here, asked only where the probe proved the nccl engine
    (CuPy warns aloud on importing its NCCL module where there is no libnccl)."""
    if caps is None or not caps.device_nccl.ok:
        return None
    from cudampi.comm.engines.nccl import available

    return available()


def unprobed_note(
    choice: PathChoice, requested: str, on_device: bool, support: DeviceSupport
) -> str:
    """What to tell the user, once, when auto runs a device collective on a path it chose
    without the probe's word ("" when there is nothing to tell): on a fresh machine auto can
    take neither the ipc engine nor gpu-ring, and DDP on CUDA tensors loses much of its speed
    (ResNet-50, 2 ranks on one H200: 0.82x of local instead of 0.93x, docs/benchmarks.md)."""
    if not on_device or requested != "auto" or not support.unprobed or choice.engine == "ipc":
        return ""
    return (
        f"device collectives take path {str(choice)!r} here because {support.unprobed}: auto "
        "chooses the ipc engine (GPU kernels, ranks of one node) or gpu-ring only where "
        "`cudampi doctor` proved them on this stack. Run `cudampi doctor` once on each host, "
        "with the job's settings (it caches what it proves), or set CUDAMPI_PATH"
    )


def mpi_support(config: Config, caps: Capabilities | None, note: str = "") -> DeviceSupport:
    """:func:`device_support` without the ipc engine (pure: what MPI itself may be given device
    memory for; the doctor's verdict on a stack)."""
    missing = note or "no probe result for this MPI stack (run `cudampi doctor`)"
    p2p = _verdict(
        config.cuda_aware,
        "cuda_aware=",
        "CUDAMPI_CUDA_AWARE",
        " says MPI p2p takes device memory",
        caps.device_p2p if caps is not None else None,
        "device point-to-point",
        missing,
    )
    coll = _verdict(
        config.native_collectives,
        "native_collectives=",
        "CUDAMPI_NATIVE_COLLECTIVES",
        "",
        caps.device_allreduce if caps is not None else None,
        "MPI's device Allreduce",
        missing,
    )
    return DeviceSupport(*p2p, *coll)


def _verdict(
    setting: str,
    name: str,
    var: str,
    says: str,
    probed: ProbeOutcome | None,
    what: str,
    missing: str,
) -> tuple[bool, str]:
    """One yes/no/auto setting against what the probe found, and why."""
    if setting == "yes":
        return True, f"{name}yes ({var}){says}"
    if setting == "no":
        return False, f"{name}no ({var})"
    if probed is None:
        return False, missing
    if probed.ok:
        return True, f"the probe proved {what} correct"
    return False, f"the probe found {what} {probed.status}"


def check_path(path: str | None, where: str) -> str | None:
    if path is None:
        return None
    if path not in PATHS:
        raise ConfigError(f"{where}={path!r} is not a path; use one of {', '.join(PATHS)}")
    return path


def choose(
    call: str,
    requested: str,
    on_device: bool,
    dtype: str,
    nbytes: int,
    support: DeviceSupport,
    *,
    mpi_reduces: bool,
) -> PathChoice:
    """The path for one call. ``mpi_reduces``: MPI has a datatype and op for this reduction."""
    no_mpi = call in REDUCING and not mpi_reduces
    if call in P2P:
        return _choose_p2p(requested, on_device, support)
    if requested in ("nccl", "ipc"):
        return _choose_kernels(call, requested, on_device, dtype, nbytes, support, mpi_reduces)
    if not on_device:
        return _choose_host(requested, dtype, no_mpi)
    return _choose_device(call, requested, dtype, nbytes, support, no_mpi)


def _choose_kernels(
    call: str,
    requested: str,
    on_device: bool,
    dtype: str,
    nbytes: int,
    support: DeviceSupport,
    mpi_reduces: bool,
) -> PathChoice:
    """``nccl`` or ``ipc`` asked for: their kernels on device arrays, the host path otherwise."""
    if not on_device:
        host = choose(call, "host", False, dtype, nbytes, support, mpi_reduces=mpi_reduces)
        return PathChoice(
            str(host),
            f"requested {requested}, which moves device arrays; {host.reason}",
            host.engine,
        )
    if requested == "nccl":
        return PathChoice(
            "nccl", "requested: NCCL on the caller's stream, bootstrapped over MPI", "nccl"
        )
    # across nodes ipc joins each node's ranks; the nodes talk through ``inner``
    return PathChoice(
        "ipc",
        "requested: GPU kernels over CUDA IPC on the caller's stream",
        "ipc",
        "alg" if support.p2p else "staged",
    )


def _choose_host(requested: str, dtype: str, no_mpi: bool) -> PathChoice:
    """A collective on host arrays."""
    if requested in ("auto", "host", "native"):
        name = "host" if requested == "auto" else requested
        if no_mpi:
            return PathChoice(
                name,
                f"host memory; MPI has no {dtype} reduction, so cudampi's algorithm reduces it",
                "alg",
            )
        return PathChoice(name, "host memory: MPI's own collective", "mpi")
    if requested == "gpu-ring":
        return PathChoice("gpu-ring", "requested; host memory runs the same algorithm", "alg")
    return PathChoice(
        "staged",
        "requested; host memory staged through host buffers",
        "staged",
        "alg" if no_mpi else "mpi",
    )


def _choose_device(
    call: str, requested: str, dtype: str, nbytes: int, support: DeviceSupport, no_mpi: bool
) -> PathChoice:
    """A collective on device arrays: what was asked for where the probe allows it (else a
    :class:`DeviceError` that says why and what to do), or auto's choice."""
    if requested == "host":
        raise DeviceError(
            f"{call}: path='host' takes host arrays, got a device array. Use path='staged' (or "
            "auto) for device arrays, or pass a host array."
        )
    if requested == "gpu-ring" and not support.p2p:
        raise DeviceError(
            f"{call}: path='gpu-ring' needs CUDA-aware MPI point-to-point, which is not proven "
            f"here ({support.p2p_why}). Run `cudampi doctor`, set CUDAMPI_CUDA_AWARE=yes if you "
            "know better, or use path='staged'."
        )
    if requested == "native" and not support.collectives:
        raise DeviceError(
            f"{call}: path='native' hands device buffers to MPI's own collectives, which is not "
            f"proven here ({support.collectives_why}); on stacks that fail this probe it "
            "segfaults. Use path='gpu-ring' or 'staged', or set CUDAMPI_NATIVE_COLLECTIVES=yes."
        )
    if requested == "auto":
        lo, hi = support.nccl_span
        if (
            support.nccl
            and call in NCCL_AUTO_CALLS
            and dtype in NCCL_AUTO_DTYPES
            and lo <= nbytes < hi
        ):
            return PathChoice("nccl", f"device memory, {support.nccl_why}", "nccl")
        if support.ipc:
            return PathChoice(
                "ipc",
                f"device memory, {support.ipc_why}: GPU kernels over CUDA IPC",
                "ipc",
                "alg" if support.p2p else "staged",
            )
        if support.p2p and nbytes < support.staged_below:
            return PathChoice(
                "staged",
                f"device memory under {support.staged_below >> 20} MiB on ranks time-slicing "
                "one GPU (no MPS daemon): staged through pinned host buffers beats gpu-ring "
                "there (measured)",
                "staged",
                "alg" if no_mpi else "mpi",
            )
        if support.p2p:
            return PathChoice(
                "gpu-ring",
                f"device memory, {support.p2p_why}: GPU reduction over device p2p "
                f"({'ring' if nbytes > 0 else 'no data'})",
                "alg",
            )
        if support.collectives and not no_mpi:
            return PathChoice("native", f"device memory, {support.collectives_why}", "mpi")
        return PathChoice(
            "staged",
            f"device memory, {support.p2p_why}: staged through pinned host buffers",
            "staged",
            "alg" if no_mpi else "mpi",
        )
    if requested == "gpu-ring":
        return PathChoice("gpu-ring", f"requested; {support.p2p_why}", "alg")
    if requested == "native":
        if no_mpi:
            if support.p2p:
                return PathChoice(
                    "native",
                    f"requested; MPI has no {dtype} reduction, so cudampi's algorithm "
                    "runs over device p2p",
                    "alg",
                )
            return PathChoice(
                "staged",
                f"requested native, but MPI has no {dtype} reduction and device p2p is "
                f"not proven ({support.p2p_why}): staged",
                "staged",
                "alg",
            )
        return PathChoice("native", f"requested; {support.collectives_why}", "mpi")
    return PathChoice(
        "staged",
        "requested: staged through pinned host buffers",
        "staged",
        "alg" if no_mpi else "mpi",
    )


def _choose_p2p(requested: str, on_device: bool, support: DeviceSupport) -> PathChoice:
    """A send or receive. auto keeps MPI: its messages match any other MPI message (host or
    device buffer, any source, any tag order), which one rank cannot know its peer needs."""
    if requested == "ipc" and on_device:
        return PathChoice(
            "ipc",
            "requested: a GPU kernel over CUDA IPC on the caller's stream (messages between "
            "two ranks match in order; the peer must use path='ipc' too)",
            "ipc",
            "alg" if support.p2p else "staged",
        )
    if requested in ("ipc", "nccl"):  # nccl moves collectives only: messages go through MPI
        requested = "auto"
    if not on_device:
        if requested == "staged":
            return PathChoice(
                "staged", "requested; host memory staged through host buffers", "staged"
            )
        return PathChoice("host", "host memory: MPI point-to-point on the array", "mpi")
    if requested == "host":
        raise DeviceError(
            "path='host' takes host arrays, got a device array. Use path='staged' or auto."
        )
    if requested in ("auto", "gpu-ring", "native") and support.p2p:
        return PathChoice("gpu-ring", f"device memory, {support.p2p_why}: direct device p2p", "mpi")
    if requested in ("gpu-ring", "native"):
        raise DeviceError(
            f"path={requested!r} needs CUDA-aware MPI point-to-point, which is not proven here "
            f"({support.p2p_why}). Run `cudampi doctor` or use path='staged'."
        )
    return PathChoice(
        "staged", f"device memory, {support.p2p_why}: staged through pinned host buffers", "staged"
    )
