"""Whether, where and how the nccl engine runs: NCCL's reductions per dtype and op, where every
rank of a communicator has a GPU of its own, and the sizes where the probe measured it faster
than ipc (auto's span). Pure where it can be, so the doctor and the tests read it without NCCL.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.comm.choice import NO_LIMIT, Ranks, Verdict
from cudampi.names import Call
from cudampi.probe.capabilities import Capabilities

AVG_SINCE = 21000
"""``ncclGetVersion`` code of NCCL 2.10.0, the first with ``ncclAvg``."""

_INT = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
}
_FLOAT = {
    "float16": "NCCL_FLOAT16",
    "bfloat16": "NCCL_BFLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}
_COMPLEX = {"complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64"}
_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN", "max": "NCCL_MAX"}
_BOOL_OPS = {
    "sum": "NCCL_MAX",
    "max": "NCCL_MAX",
    "bor": "NCCL_MAX",
    "prod": "NCCL_MIN",
    "min": "NCCL_MIN",
    "band": "NCCL_MIN",
}
_ELSEWHERE = "Use path 'ipc' or 'gpu-ring' for it."


@dataclass(frozen=True)
class Reduction:
    """How one (dtype, op) reduction runs in NCCL."""

    dtype: str
    """The ``cupy.cuda.nccl`` datatype constant (``NCCL_FLOAT32``...)."""
    op: str
    """The ``cupy.cuda.nccl`` op constant (``NCCL_SUM``...)."""
    factor: int = 1
    """NCCL elements per element (complex: 2 reals)."""
    divide: bool = False
    """Finish ``avg`` by dividing the sum on the caller's stream."""


def nccl_reduction(dtype: str, op: str, version: int) -> Reduction | str:
    """How NCCL ``version`` (``ncclGetVersion``'s code) reduces ``dtype`` with ``op``, or why it
    cannot (a sentence naming the value and what to use instead). ``op`` is valid for ``dtype``
    (the Communicator checked it)."""
    has_avg = version >= AVG_SINCE
    if dtype in _FLOAT or dtype in _COMPLEX:
        nd = _FLOAT.get(dtype) or _COMPLEX[dtype]
        factor = 2 if dtype in _COMPLEX else 1
        if op == "avg":
            if has_avg:
                return Reduction(nd, "NCCL_AVG", factor)
            return Reduction(nd, "NCCL_SUM", factor, divide=True)
        if dtype in _COMPLEX and op != "sum":
            return f"NCCL reduces {dtype} as pairs of reals: sum and avg, not {op!r}. {_ELSEWHERE}"
        return Reduction(nd, _OPS[op], factor)
    if dtype == "bool":
        if op not in _BOOL_OPS:
            return f"NCCL has no logical xor ({op!r} on bool). {_ELSEWHERE}"
        return Reduction("NCCL_UINT8", _BOOL_OPS[op])
    if dtype in _INT:
        if op in ("band", "bor", "bxor"):
            return f"NCCL has no bitwise reductions ({op!r} on {dtype}). {_ELSEWHERE}"
        if op == "avg":
            if dtype in ("uint32", "uint64"):
                return f"avg of {dtype} (the sum floor-divided) is not done here. {_ELSEWHERE}"
            return Reduction(_INT[dtype], "NCCL_SUM", divide=True)
        return Reduction(_INT[dtype], _OPS[op])
    return f"NCCL has no {dtype} datatype to reduce in. {_ELSEWHERE}"


# ------------------------------------------------------------------ where auto takes it

NCCL_AUTO_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""NCCL reduces these with every op cudampi takes for them (integers' bitwise ops, int16 and
complex products it lacks): auto gives it nothing it would refuse."""


def auto_takes(call: Call) -> bool:
    """The calls auto may give the nccl engine: reductions and broadcast, where every rank
    passes the same number of bytes (a per-size choice is then the same on every rank) and the
    probe's latency and bandwidth (measured on allreduce) say what they cost."""
    return not call.vector and not call.p2p and (call.reduces or call.name == "broadcast")


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


def nccl_missing(caps: Capabilities | None) -> str | None:
    """Why NCCL cannot be imported here, asked only where the probe proved the nccl engine
    (CuPy warns aloud on importing its NCCL module where there is no libnccl)."""
    if caps is None or not caps.device_nccl.ok:
        return None
    return available()


def for_these_ranks(ranks: Ranks, v: Verdict) -> Verdict:
    """``v`` kept only where every rank of the communicator can use the nccl engine: one node
    (the doctor measured it against ipc there), a GPU of its own on every rank. Collective over
    ``ranks.coll`` on one node (``one_node`` is the same on every rank)."""
    if not ranks.one_node:
        if not v.ok:
            return v
        across = "across nodes auto keeps ipc inside each node (nccl was measured on one node only)"
        return Verdict(False, across, (0, 0))
    why = ranks_can_use(ranks.coll, v.ok)
    if why is None or not v.ok:
        return v
    return Verdict(False, why, (0, 0))


# ------------------------------------------------------------------ where it can run


@dataclass(frozen=True)
class RankGpu:
    """One rank's GPU, as the ranks tell each other (:func:`local_gpu`)."""

    host: str
    gpu: str | None
    """The GPU's PCI bus id (unique on its host; MIG instances of one GPU share it); None: no
    GPU."""


def nccl_usable(
    ranks_gpus: Sequence[RankGpu],
    importable: str | Sequence[str | None] | None,
    measured: str | None = None,
) -> str | None:
    """None where the nccl engine can run a communicator of these ranks, else why not.

    ``ranks_gpus``: every rank's GPU, in rank order. ``importable``: why NCCL cannot be imported
    (:func:`available`), one value for every rank or one per rank; None: it can. ``measured``:
    why the probe did not prove NCCL here (:func:`measured_why`); None: it did, or the caller
    does not ask for it (an explicit request). Every rank needs a GPU of its own: NCCL refuses
    two ranks on one GPU ("Duplicate GPU detected"), and those ranks keep ``ipc``.
    """
    if importable is None or isinstance(importable, str):
        whys = [importable] * len(ranks_gpus)
    else:
        whys = list(importable)
    for rank, why in enumerate(whys):
        if why is not None:
            return f"NCCL is not importable on rank {rank}: {why}"
    no_gpu = [r for r, g in enumerate(ranks_gpus) if g.gpu is None]
    if no_gpu:
        return f"rank(s) {ranks_text(no_gpu)} have no GPU; NCCL moves device memory only"
    owners: dict[tuple[str, str], list[int]] = {}
    for rank, g in enumerate(ranks_gpus):
        assert g.gpu is not None
        owners.setdefault((g.host, g.gpu), []).append(rank)
    shared = [(key, ranks) for key, ranks in owners.items() if len(ranks) > 1]
    if shared:
        (host, gpu), ranks = shared[0]
        return (
            f"ranks {ranks_text(ranks)} share the GPU at PCI {gpu} on {host}"
            + (f" ({len(shared)} GPUs are shared)" if len(shared) > 1 else "")
            + "; NCCL needs one GPU per rank (ranks that share a GPU keep 'ipc')"
        )
    if measured is not None:
        return f"NCCL was not measured here: {measured}"
    return None


def ranks_can_use(coll: Any, proven: bool) -> str | None:
    """Collective over ``coll`` (ranks of one node): None where auto may give this
    communicator's device collectives to the nccl engine, else why not. ``proven``: this rank's
    probe result proves NCCL (every rank must say so); then each rank's current CUDA device is
    what NCCL would run on (set it before making the communicator, as torch asks)."""
    me: tuple[bool, str | None, RankGpu | None] = (proven, None, None)
    if proven:
        why = available()
        gpu = None
        if why is None:
            try:
                gpu = local_gpu(current_device())
            except Exception as exc:  # no usable device on this rank: say so, on every rank
                why = f"no CUDA device to query ({type(exc).__name__}: {exc})"
        me = (True, why, gpu)
    seen = coll.allgather(me) if coll.size > 1 else [me]
    if not all(p for p, _, _ in seen):
        return "not every rank's probe result proves the nccl engine"
    return nccl_usable([g or RankGpu("", None) for _, _, g in seen], [w for _, w, _ in seen])


def measured_why(outcome: Any) -> str | None:
    """Why a probe outcome (a :class:`~cudampi.probe.capabilities.ProbeOutcome` or None) does not
    prove NCCL here; None where it does."""
    if outcome is None:
        return "no NCCL probe result for this stack (run `cudampi doctor`)"
    if not outcome.ok:
        detail = f": {outcome.detail}" if outcome.detail else ""
        return f"the probe found NCCL {outcome.status}{detail}"
    return None


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def available() -> str | None:
    """None where NCCL can be imported here (CuPy's binding and a libnccl it loads), else why."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); pip install 'cudampi[cu12]' or 'cudampi[cu13]'"
    if not getattr(nccl, "available", False):
        return (
            "CuPy finds no NCCL library; pip install nvidia-nccl-cu12 or nvidia-nccl-cu13 (the "
            "wheel torch's CUDA builds use)"
        )
    return None


def current_device() -> int:
    """The CUDA runtime's current device of this thread (what torch.cuda.set_device and CuPy's
    Device.use set)."""
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def local_gpu(device: int | None) -> RankGpu:
    """This rank's :class:`RankGpu` for CUDA ``device`` (None: no GPU)."""
    host = socket.gethostname()
    if device is None:
        return RankGpu(host, None)
    import cupy

    return RankGpu(host, str(cupy.cuda.runtime.deviceGetPCIBusId(device)))
