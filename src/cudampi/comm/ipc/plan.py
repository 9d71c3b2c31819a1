"""Planning the ipc kernels' launches: pure functions from one call to kernel parameter blocks.

Every rank plans from what every rank knows (counts, sizes, the workspace capacity), so every
rank makes the same number of launches with the same slicing; the kernels compare the
signature words each rank posts and stop on any difference. Nothing here touches a GPU: the
unit tests run these plans through a NumPy model of the kernels' data movement
(tests/unit/ipc_model.py).

Reductions (``reduce_kernel``): a launch covers at most one data buffer of elements, cut in
``nranks`` pack-aligned slices; slice q is (element offset in x, elements, element offset in the
data buffers, element offset in out). A two-shot allreduce is one launch that the kernel cuts
the same way, in rounds of one data buffer (:func:`reduction`). Data movement
(``exchange_kernel``): a launch moves, for each pair of ranks, at most a window of the pair's
bytes; ``rounds`` launches move everything.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cached_property

import numpy

from cudampi.comm.algorithms import offsets
from cudampi.comm.ipc import layout as L
from cudampi.names import CALLS

REJECTED = 15
"""The signature code of a launch that says its rank refused its own arguments (reject()); no
call of :data:`cudampi.names.CALLS` has it."""
CALL_NAMES = {c.code: name for name, c in CALLS.items()}
"""Signature code -> call name (codes are the call table's)."""
assert REJECTED not in CALL_NAMES


def call_code(call: str) -> int:
    """A launch's signature code: its call's, or :data:`REJECTED`."""
    return REJECTED if call == "rejected" else CALLS[call].code


PARAM_DTYPE = numpy.dtype([("v", numpy.int64, (L.NPARAM,))])
"""The kernels' ``struct Params`` as a NumPy structured dtype (a CuPy RawKernel call takes it
by value; the engine hands the driver a pointer to the same bytes, :attr:`Launch.argv`)."""


@dataclass(frozen=True)
class Geometry:
    """What every launch of one communicator shares."""

    rank: int
    nranks: int
    capacity: int
    """Bytes of one data buffer (a multiple of 4096)."""
    timeout_ns: int
    oneshot_bytes: int
    """Allreduce messages up to this size run one-shot, larger ones two-shot."""
    workspace: int = 0
    """This rank's workspace address (0 in pure tests)."""
    error: int = 0
    """The host-mapped error record's address."""


@dataclass(frozen=True)
class Launch:
    kernel: str
    """``reduce``, ``twoshot``, ``exchange`` or ``p2p``."""
    params: numpy.ndarray

    @cached_property
    def argv(self) -> numpy.ndarray:
        """cuLaunchKernel's ``kernelParams``: one pointer, to the parameter block (which this
        launch keeps alive; the driver copies it at each launch)."""
        assert self.params.flags.c_contiguous and self.params.dtype == numpy.int64
        return numpy.array([self.params.ctypes.data], numpy.uint64)

    @cached_property
    def argv_ptr(self) -> int:
        return int(self.argv.ctypes.data)


def _base(geo: Geometry, x: int, out: int) -> numpy.ndarray:
    p = numpy.zeros(L.NPARAM, numpy.int64)
    p[L.P_WS], p[L.P_ERR], p[L.P_RANK] = geo.workspace, geo.error, geo.rank
    p[L.P_IN], p[L.P_OUT] = x, out
    p[L.P_TIMEOUT], p[L.P_CAP], p[L.P_DATA] = geo.timeout_ns, geo.capacity, L.DATA_OFFSET
    for arr in (L.P_B, L.P_D):
        p[arr : arr + L.MAX_RANKS] = -1
    return p


def signature(
    call: str,
    dtype_code: int,
    op_code: int,
    root: int,
    count: int,
    counts: tuple[int, ...],
    index: int,
    launches: int,
) -> list[int]:
    """The signature words of one launch (each a uint64)."""
    w0 = (call_code(call) << 56) | (op_code << 48) | (dtype_code << 40) | ((root + 1) & 0xFFFF)
    w1 = count & 0xFFFFFFFFFFFFFFFF
    w2 = (index << 32) | launches
    w3 = zlib.crc32(repr(counts).encode()) if counts else 0
    return [w0, w1, w2, w3]


def describe(words: list[int]) -> str:
    """A signature as a person reads it (for error messages)."""
    from cudampi.comm.arrays import DTYPES
    from cudampi.names import REDUCE_OPS

    w0, w1, w2, w3 = (int(w) for w in words)
    call = CALL_NAMES.get(w0 >> 56, f"call#{w0 >> 56}")
    op, dt, root = (w0 >> 48) & 0xFF, (w0 >> 40) & 0xFF, (w0 & 0xFFFF) - 1
    if w0 >> 56 in (L.CALL_SEND, L.CALL_RECV):
        tag = w2 - (1 << 64) if w2 >= 1 << 63 else w2
        peer = f"{'to' if call == 'send' else 'from'} rank {root}"
        return f"{call} {peer}, {w1} bytes, tag {tag if tag >= 0 else 'any'}"
    parts = [call]
    if 0 < dt <= len(DTYPES):
        parts.append(DTYPES[dt - 1])
    if op:
        parts.append(REDUCE_OPS[op - 1])
    count = w1 - (1 << 64) if w1 >= 1 << 63 else w1
    parts.append(f"{count} elements" if count >= 0 else "per-rank counts")
    if root >= 0:
        parts.append(f"root {root}")
    if w3:
        parts.append(f"counts#{w3:08x}")
    parts.append(f"launch {w2 >> 32} of {w2 & 0xFFFFFFFF}")
    return ", ".join(parts)


def _set_sig(p: numpy.ndarray, words: list[int]) -> None:
    p[L.P_SIG : L.P_SIG + L.SIG_WORDS] = numpy.array(words, numpy.uint64).view(numpy.int64)


def _pack_elems(itemsize: int) -> int:
    if itemsize <= 0 or L.PACK % itemsize:
        raise ValueError(f"itemsize {itemsize} does not divide the {L.PACK}-byte pack")
    return L.PACK // itemsize


def _slices(n: int, nranks: int, pe: int) -> list[tuple[int, int]]:
    """``n`` elements in ``nranks`` slices whose starts are multiples of ``pe`` elements (empty
    trailing slices start at ``n`` rounded up to a pack)."""
    top = -(-n // pe) * pe
    per = -(-top // pe // nranks) * pe
    out = []
    for q in range(nranks):
        lo = min(q * per, top)
        out.append((lo, max(lo, min(n, (q + 1) * per))))
    return out


# ------------------------------------------------------------------------------ reductions


def oneshot_auto(nranks: int, one_gpu: bool) -> int:
    """The allreduce size up to which one-shot is used when not set (``ipc_oneshot_bytes``).

    Where the ranks share the GPU, every byte moves through its memory either way: one-shot (one
    barrier, every rank reading every rank's copy) wins while the second barrier of two-shot
    costs more than the extra traffic, up to a size that shrinks with the ranks: 8 MiB / ranks
    (measured with ``tools/gpu-session.sh ipctune``, two-shot on registered buffers; the figures
    are in docs/ipc.md).
    With a GPU each, one-shot pulls (ranks - 1) x the message over the links where two-shot
    moves about twice it, so it is kept to small messages, 512 KiB as vLLM's and TensorRT-LLM's
    custom allreduce keep it, until a machine with several GPUs measures it here.
    """
    if one_gpu:
        return (8 << 20) // max(nranks, 1)
    return 512 << 10


def two_shot(geo: Geometry, count: int, itemsize: int) -> bool:
    """Does an allreduce of ``count`` elements run two-shot (and so may use registered
    buffers)?"""
    return count * itemsize > geo.oneshot_bytes


def reduction(
    geo: Geometry,
    call: str,
    count: int,
    itemsize: int,
    x: int,
    out: int,
    sig: tuple[int, int],
    *,
    root: int = -1,
    registered: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> list[Launch]:
    """allreduce (``call='allreduce'``) or reduce to ``root`` of ``count`` elements.

    ``sig`` is (dtype code, op code) for the signature. ``registered``: (1 + registry entry of
    x, x's byte offset in it, the same for out), used by two-shot launches only (registry.py).

    A two-shot allreduce is one launch of any size (the kernel cuts it in rounds of one data
    buffer unless every rank registered both buffers); the others take a launch per data
    buffer of elements."""
    pe = _pack_elems(itemsize)
    chunk = (geo.capacity // L.PACK) * pe
    if call == "allreduce" and two_shot(geo, count, itemsize):
        p = _base(geo, x, out)
        p[L.P_MODE], p[L.P_ROOT], p[L.P_COUNT], p[L.P_CHUNK] = L.MODE_TWOSHOT, -1, count, chunk
        p[L.P_REGIN], p[L.P_INOFF], p[L.P_REGOUT], p[L.P_OUTOFF] = registered
        _set_sig(p, signature(call, *sig, root, count, (), 0, 1))
        return [Launch("twoshot", p)]
    mode = L.MODE_ROOT if call == "reduce" else L.MODE_ONESHOT
    starts = list(range(0, count, chunk)) or [0]
    launches = []
    for i, c0 in enumerate(starts):
        n = min(chunk, count - c0)
        p = _base(geo, x, out)
        p[L.P_MODE], p[L.P_ROOT] = mode, root
        for q, (lo, hi) in enumerate(_slices(n, geo.nranks, pe)):
            p[L.P_A + q], p[L.P_B + q], p[L.P_C + q], p[L.P_D + q] = c0 + lo, hi - lo, lo, c0 + lo
        _set_sig(p, signature(call, *sig, root, count, (), i, len(starts)))
        launches.append(Launch("reduce", p))
    return launches


def reduce_scatter(
    geo: Geometry,
    counts: list[int],
    itemsize: int,
    x: int,
    out: int,
    sig: tuple[int, int],
) -> list[Launch]:
    """Rank q gets the reduction of block q (``counts[q]`` elements of every rank's x)."""
    n = geo.nranks
    pe = _pack_elems(itemsize)
    window = (geo.capacity // n // L.PACK) * pe
    offs = offsets(counts)
    rounds = max(1, -(-max(counts, default=0) // window))
    launches = []
    for j in range(rounds):
        p = _base(geo, x, out)
        p[L.P_MODE] = L.MODE_SCATTER
        for q in range(n):
            lo = min(counts[q], j * window)
            hi = min(counts[q], (j + 1) * window)
            p[L.P_A + q], p[L.P_B + q], p[L.P_C + q] = offs[q] + lo, hi - lo, q * window
            p[L.P_D + q] = lo if q == geo.rank else 0
        _set_sig(p, signature("reduce_scatter", *sig, -1, sum(counts), tuple(counts), j, rounds))
        launches.append(Launch("reduce", p))
    return launches


# ------------------------------------------------------------------------------ data movement


def reject(geo: Geometry) -> list[Launch]:
    """One launch that moves nothing and posts the ``rejected`` signature, so the other ranks'
    kernels of the same call stop with a mismatch instead of waiting for this rank."""
    p = _base(geo, 0, 0)
    p[L.P_MODE] = L.XMODE_SHARED
    _set_sig(p, signature("rejected", 0, 0, -1, 0, (), 0, 1))
    return [Launch("exchange", p)]


def gather_like(
    geo: Geometry,
    call: str,
    counts: list[int],
    itemsize: int,
    x: int,
    out: int,
    dtype_code: int,
    *,
    root: int = -1,
) -> list[Launch]:
    """allgather(v) (``root=-1``), gather(v) to ``root``, or broadcast from ``root``
    (``call='broadcast'``; ``counts`` has the root's count for every rank and out is x).

    Every sender's bytes are staged once (shared by all receivers); a round moves up to one
    data buffer of every sender's bytes."""
    n, me = geo.nranks, geo.rank
    window = (geo.capacity // L.PACK) * L.PACK
    nbytes = [c * itemsize for c in counts]
    displ = offsets(nbytes)
    if call == "broadcast":
        displ = [0] * n
    uneven = len(set(counts)) > 1  # the counts go into the signature (gather(v), allgatherv)
    rounds = max(1, -(-max(nbytes, default=0) // window))
    launches = []
    for j in range(rounds):
        p = _base(geo, x, out)
        p[L.P_MODE] = L.XMODE_SHARED

        win = [max(0, min(b, (j + 1) * window) - j * window) for b in nbytes]

        sends = call != "broadcast" or me == root
        if sends:
            p[L.P_STAGEOFF], p[L.P_STAGE] = j * window, win[me]
        for d in range(n):
            to_d = sends and (d != root if call == "broadcast" else root < 0 or d == root)
            p[L.P_A + d], p[L.P_B + d] = 0, (win[me] if to_d else -1)
            from_d = (call == "broadcast" and me != root and d == root) or (
                call != "broadcast" and (root < 0 or me == root)
            )
            if from_d:
                p[L.P_C + d], p[L.P_D + d] = displ[d] + j * window, win[d]
        tup = tuple(counts) if uneven else ()
        total = sum(counts) if uneven else counts[0]
        _set_sig(p, signature(call, dtype_code, 0, root, total, tup, j, rounds))
        launches.append(Launch("exchange", p))
    return launches


def all_to_all(
    geo: Geometry,
    call: str,
    send_counts: list[int],
    recv_counts: list[int],
    itemsize: int,
    x: int,
    out: int,
    dtype_code: int,
    *,
    max_pair: int,
    root: int = -1,
) -> list[Launch]:
    """alltoall(v) (``call='alltoall'``) or scatter(v) from ``root`` (``call='scatter'``: only the
    root's send counts matter). ``max_pair``: the largest count any rank sends any rank (every
    rank must pass the same value). Each destination has its own window of the data buffer."""
    n = geo.nranks
    window = (geo.capacity // n // L.PACK) * L.PACK
    sb = [c * itemsize for c in send_counts]
    rb = [c * itemsize for c in recv_counts]
    sd, rd = offsets(sb), offsets(rb)
    rounds = max(1, -(-(max_pair * itemsize) // window))
    sends = call == "alltoall" or geo.rank == root
    launches = []
    for j in range(rounds):
        p = _base(geo, x, out)
        p[L.P_MODE] = L.XMODE_EACH
        for d in range(n):
            lo, hi = min(sb[d], j * window), min(sb[d], (j + 1) * window)
            if sends:
                p[L.P_A + d], p[L.P_B + d], p[L.P_E + d] = d * window, hi - lo, sd[d] + lo
            if call == "alltoall" or d == root:
                lo, hi = min(rb[d], j * window), min(rb[d], (j + 1) * window)
                p[L.P_C + d], p[L.P_D + d] = rd[d] + lo, hi - lo
        fixed = call == "alltoall" and len(set(send_counts)) == 1
        count = send_counts[0] * n if fixed else -1
        _set_sig(p, signature(call, dtype_code, 0, root, count, (), j, rounds))
        launches.append(Launch("exchange", p))
    return launches


# ------------------------------------------------------------------------------ point-to-point


@dataclass(frozen=True)
class Message:
    """One send or receive of a point-to-point group."""

    send: bool
    peer: int
    ptr: int
    nbytes: int
    tag: int
    """A receive's tag < 0 takes any tag."""
    reg: int = 0
    """A send read in place by its receiver: 1 + the registry entry of ``ptr``'s allocation
    (which the receiver has mapped), and ``offset``, ``ptr``'s byte offset in it."""
    offset: int = 0

    def __post_init__(self) -> None:
        # checked where the message is posted, not at the later launch of its group
        if not -(1 << 31) <= self.tag < 1 << 31:
            raise ValueError(f"tag {self.tag} does not fit in 32 bits")


def p2p(geo: Geometry, group: list[Message]) -> list[Launch]:
    """The launches of a group of sends and receives (``p2p_kernel``), at most
    :data:`~cudampi.comm.ipc.layout.P2P_MAX_OPS` messages each, in the order given: the kernel
    keeps the order of one peer and direction and moves the others as their peers allow. A send
    with ``reg`` (larger than :func:`~cudampi.comm.ipc.layout.p2p_eager`) is read in place."""
    launches, eager = [], L.p2p_eager(geo.capacity)
    for at in range(0, len(group), L.P2P_MAX_OPS):
        part = group[at : at + L.P2P_MAX_OPS]
        p = numpy.zeros(L.P2P_NPARAM, numpy.int64)
        p[L.P_WS], p[L.P_ERR], p[L.P_RANK] = geo.workspace, geo.error, geo.rank
        p[L.P_TIMEOUT] = geo.timeout_ns
        p[L.P2P_NOPS_AT], p[L.P2P_CHUNK_AT] = len(part), L.p2p_chunk(geo.capacity)
        p[L.P2P_INBOX_AT] = L.DATA_OFFSET + 2 * geo.capacity
        words = p[L.P2P_OPS_AT :].view(numpy.uint64)
        for i, m in enumerate(part):
            if not 0 <= m.peer < geo.nranks:
                raise ValueError(f"peer {m.peer} is not a rank of {geo.nranks}")
            if m.reg and not (m.send and m.nbytes > eager and 0 < m.reg <= L.MAX_REGS):
                # the receiver's blocks take part in a message read in place as in one of more
                # than a chunk; a smaller one must go (eagerly) through the inbox
                raise ValueError(f"{m} cannot be read in place (a send of more than {eager} B)")
            way = L.P2P_SEND if m.send else L.P2P_RECV
            words[3 * i] = m.peer | way << 8 | m.reg << 16 | (m.tag & 0xFFFFFFFF) << 32
            p[L.P2P_OPS_AT + 3 * i + 1] = m.offset if m.reg else m.ptr
            p[L.P2P_OPS_AT + 3 * i + 2] = m.nbytes
        launches.append(Launch("p2p", p))
    return launches
