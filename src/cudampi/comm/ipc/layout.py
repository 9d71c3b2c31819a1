"""What the host and the ipc kernels share: sizes, parameter slots, codes, and the kernel source.

kernels.cu defines no constants of its own: :func:`source` prepends the ``#define`` lines made
from this module, and the kernels ``static_assert`` the header and error-record layouts against
them, so a change here that the structs do not follow fails to compile (CI compiles the kernels).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from cudampi.names import CALLS

MAX_RANKS = 16
"""Ranks of one node that one ipc communicator can join (the size of the per-rank tables)."""
MAX_BLOCKS = 64
"""The most blocks a launch may have (every launch of a communicator has the same grid)."""
NTHREADS = 512
MIN_BLOCKS = 2
"""Blocks of NTHREADS every kernel keeps room for on one multiprocessor (``__launch_bounds__``:
at most 64 registers a thread). A launch's blocks wait on its peers' blocks, so all of them must
be resident at once: a communicator's grid takes one block a multiprocessor over its ranks on
the GPU, and the second place is the slack for another job's or communicator's kernels (under
MPS) that a kernel of more registers would take away (they then wait on each other until the
timeout)."""
SIG_WORDS = 4
MAX_REGS = 128
"""Buffers one rank can register with one communicator (registry.py): past that, it stages."""
PACK = 16
"""Bytes of the unit a thread owns in the data buffers."""

SLOT_BYTES = 64
POST_BYTES = 32
P2P_SLOTS = 4
"""Chunks a sender may post before its receiver takes them (per pair, direction and block)."""
P2P_MAX_OPS = 128
"""Sends and receives one point-to-point launch runs together (a larger group runs in parts)."""
HEADER_PEERS = 0
"""The peers table opens the header (kernels.cu ``struct Header``)."""
HEADER_REGS = 8 * MAX_RANKS + 64 + 2 * 8 * MAX_BLOCKS
"""Where the registration table starts (``u64 regs[MAX_RANKS][MAX_REGS]``)."""
HEADER_BYTES = (
    HEADER_REGS
    + 8 * MAX_RANKS * MAX_REGS
    + 2 * MAX_BLOCKS * MAX_RANKS * SLOT_BYTES
    + 3 * 8 * MAX_RANKS * MAX_BLOCKS
    + MAX_RANKS * MAX_BLOCKS * P2P_SLOTS * POST_BYTES
)
DATA_OFFSET = -(-HEADER_BYTES // 4096) * 4096
"""Where data buffer 0 starts in a workspace; buffer 1 follows at DATA_OFFSET + capacity."""
ERROR_HOST_ABORT = 0
"""The host's abort word opens the error record (kernels.cu ``struct ErrorRecord``)."""
ERROR_BYTES = 32 + 8 * SIG_WORDS * 2 + 16

# Parameter slots (kernels.cu: struct Params { i64 v[NPARAM]; }).
P_WS, P_ERR, P_RANK, P_IN, P_OUT = 0, 1, 2, 3, 4
P_TIMEOUT, P_CAP, P_DATA, P_MODE, P_ROOT, P_STAGE = 6, 7, 8, 9, 10, 11
P_SIG = 12
P_A, P_B, P_C, P_D, P_E = 16, 32, 48, 64, 80
P_STAGEOFF = 96
P_REGIN, P_INOFF, P_REGOUT, P_OUTOFF = 97, 98, 99, 100
P_COUNT, P_CHUNK = 5, 101
"""Two-shot allreduce: the call's elements, and the elements of one round (one data buffer)."""
NPARAM = 102
# p2p_kernel's own parameter block (kernels.cu: struct P2PParams): P_WS, P_ERR, P_RANK and
# P_TIMEOUT as above, then its number of ops, the chunk size, the inboxes' offset, and the ops
# (3 words each); under the 4 KiB every CUDA driver takes.
P2P_NOPS_AT, P2P_CHUNK_AT, P2P_INBOX_AT, P2P_OPS_AT = 3, 4, 5, 8
P2P_NPARAM = P2P_OPS_AT + 3 * P2P_MAX_OPS

# reduce_kernel modes
MODE_ONESHOT, MODE_TWOSHOT, MODE_SCATTER, MODE_ROOT = 0, 1, 2, 3
# exchange_kernel staging
XMODE_SHARED, XMODE_EACH = 0, 1

# ErrorRecord.code
ERR_OK, ERR_MISMATCH, ERR_TIMEOUT, ERR_ABORTED, ERR_HOST, ERR_RECV, ERR_SEND, ERR_MESSAGE = range(8)

# p2p ops' directions, and the signature call codes of send and receive (the call table's)
P2P_SEND, P2P_RECV = 1, 2
CALL_SEND, CALL_RECV = CALLS["send"].code, CALLS["recv"].code

KINDS = {
    "float16": "KF16",
    "bfloat16": "KBF16",
    "float32": "KF32",
    "float64": "KF64",
    "int8": "KI8",
    "int16": "KI16",
    "int32": "KI32",
    "int64": "KI64",
    "uint8": "KU8",
    "uint16": "KU16",
    "uint32": "KU32",
    "uint64": "KU64",
    "bool": "KU8",
    "complex64": "KC64",
    "complex128": "KC128",
}
"""The kernels' element kind for each dtype cudampi accepts (bool reduces as bytes, below)."""

_BOOL_OPS = {"sum": "bor", "max": "bor", "bor": "bor", "prod": "band", "min": "band"}


def kernel_op(op: str, dtype: str) -> str:
    """The op the kernel runs: bool's logical ops are bitwise ops on 0/1 bytes."""
    return _BOOL_OPS.get(op, op) if dtype == "bool" else op


def _defines() -> dict[str, int]:
    names = [
        "MAX_RANKS MAX_BLOCKS MAX_REGS NTHREADS MIN_BLOCKS SIG_WORDS HEADER_BYTES HEADER_REGS",
        "ERROR_BYTES",
        "P_REGIN P_INOFF P_REGOUT P_OUTOFF P_COUNT P_CHUNK",
        "NPARAM P_WS P_ERR P_RANK P_IN P_OUT P_TIMEOUT P_CAP P_DATA P_MODE",
        "P_ROOT P_STAGE P_SIG P_A P_B P_C P_D P_E P_STAGEOFF MODE_ONESHOT MODE_TWOSHOT",
        "MODE_SCATTER MODE_ROOT XMODE_SHARED XMODE_EACH ERR_MISMATCH ERR_TIMEOUT ERR_ABORTED",
        "ERR_HOST ERR_RECV ERR_SEND ERR_MESSAGE PACK P2P_SLOTS P2P_MAX_OPS P2P_NOPS_AT",
        "P2P_CHUNK_AT P2P_INBOX_AT P2P_OPS_AT P2P_NPARAM CALL_SEND CALL_RECV P2P_SEND P2P_RECV",
    ]
    g = globals()
    return {n: int(g[n]) for line in names for n in line.split()}


@cache
def source(text: str | None = None) -> str:
    """The complete kernel source: this module's constants, then kernels.cu (or ``text`` in its
    place: another version of it, as ``tools/kernel-sass-diff.py`` compiles)."""
    if text is None:
        text = resources.files("cudampi.comm.ipc").joinpath("kernels.cu").read_text()
    prelude = "".join(f"#define {k} {v}\n" for k, v in _defines().items())
    return prelude + text


def reduce_name(dtype: str, op: str, nranks: int) -> str:
    """The name expression of the reduce kernel for ``dtype``/``op`` on ``nranks`` ranks."""
    from cudampi.names import REDUCE_OPS

    return f"reduce_kernel<{KINDS[dtype]}, {REDUCE_OPS.index(kernel_op(op, dtype))}, {nranks}>"


def twoshot_name(dtype: str, op: str, nranks: int) -> str:
    """The name expression of the two-shot allreduce kernel for ``dtype``/``op`` on ``nranks``."""
    return reduce_name(dtype, op, nranks).replace("reduce_kernel<", "twoshot_kernel<", 1)


def exchange_name(nranks: int) -> str:
    return f"exchange_kernel<{nranks}>"


P2P_NAME = "p2p_kernel"


def p2p_chunk(capacity: int) -> int:
    """Bytes of one point-to-point chunk for data buffers of ``capacity`` bytes: 1/32 of one, in
    whole pages (1 MiB by default, so up to 4 MiB go before the receiver arrives)."""
    return max(4096, capacity // 32 // 4096 * 4096)


def p2p_eager(capacity: int) -> int:
    """The largest message that goes before its receive is posted (through the inbox's slots);
    a larger send waits for its receive, and may be read in place (registry.py)."""
    return P2P_SLOTS * p2p_chunk(capacity)


def p2p_bytes(capacity: int, nranks: int) -> int:
    """Bytes of a workspace's inboxes (one per sender, itself included)."""
    return nranks * P2P_SLOTS * p2p_chunk(capacity)


COMPILE_OPTIONS = ("-std=c++17",)


def compile_cubin(names: list[str], arch: str, text: str | None = None) -> bytes:
    """Compile ``names`` for ``arch`` (``sm_90``...) with NVRTC alone: no GPU, no driver needed
    (``text``: another kernels.cu, :func:`source`). Raises RuntimeError with NVRTC's log when
    the source does not compile."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(text), "kernels.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *COMPILE_OPTIONS])
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{nvrtc.getProgramLog(prog)}") from None
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def kernel_code(cubin: bytes) -> dict[str, bytes]:
    """The machine code of each kernel of a cubin (:func:`compile_cubin`): its mangled name ->
    the bytes of its ``.text.<name>`` section (pyelftools, a dev dependency: for the tests and
    tools/kernel-sass-diff.py)."""
    import io

    from elftools.elf.elffile import ELFFile

    return {
        s.name[len(".text.") :]: s.data()
        for s in ELFFile(io.BytesIO(cubin)).iter_sections()
        if s.name.startswith(".text.")
    }
