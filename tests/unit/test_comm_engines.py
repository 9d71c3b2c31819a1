"""The engine contract: every registered engine has the whole method set, every path names a
registered engine, and the engines never import the Communicator (pure, no MPI)."""

from __future__ import annotations

import itertools
import subprocess
import sys

from cudampi.comm.engines import KINDS, Engine
from cudampi.comm.engines.mpi import can_reduce
from cudampi.comm.paths import DeviceSupport, choose
from cudampi.config import PATHS
from cudampi.errors import DeviceError
from cudampi.names import CALLS as TABLE

METHODS = (
    "allreduce",
    "reduce",
    "broadcast",
    "allgatherv",
    "gatherv",
    "scatterv",
    "reduce_scatterv",
    "alltoallv",
    "send",
    "recv",
    "isend",
    "irecv",
)
CALLS = tuple(name for name, c in TABLE.items() if c.data)


def test_every_engine_has_the_whole_method_set():
    assert {"mpi", "alg", "staged"} <= set(KINDS)
    for name, kind in KINDS.items():
        assert kind.name == name
        if name in ("mpi", "alg", "staged"):
            assert kind.stream_ordered is False, name
        missing = [m for m in METHODS if getattr(kind, m) is getattr(Engine, m)]
        assert not missing, (name, missing)


def test_every_path_choice_names_a_registered_engine():
    seen = set()
    for call, requested, on_device, dtype, p2p, coll in itertools.product(
        CALLS, PATHS, (False, True), ("float32", "bfloat16"), (False, True), (False, True)
    ):
        support = DeviceSupport(p2p, "p2p", coll, "coll")
        try:
            c = choose(
                call, requested, on_device, dtype, 1 << 20, support, mpi_reduces=can_reduce(dtype)
            )
        except DeviceError:
            continue
        assert c.engine in KINDS, (call, requested, c.engine)
        assert c.inner in ("", *KINDS), (call, requested, c.inner)
        seen.add(c.engine)
    assert seen == set(KINDS)


def test_engines_do_not_import_the_communicator():
    code = (
        "import sys, cudampi.comm.engines\n"
        "bad = [m for m in ('cudampi.comm.communicator', 'mpi4py.MPI', 'torch', 'cupy')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
