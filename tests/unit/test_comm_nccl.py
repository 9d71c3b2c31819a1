"""The nccl engine's pure parts: where it can run (nccl_usable) and how each reduction maps onto
NCCL's datatypes and ops (nccl_reduction). The engine itself runs in tests/gpu/test_nccl_gpu.py;
its MPI bootstrap's agreement on failure in tests/mpi/test_comm_nccl.py."""

from __future__ import annotations

import importlib.util

import pytest

from cudampi.comm.arrays import ops_allowed
from cudampi.comm.engines import KINDS
from cudampi.comm.engines.nccl_support import (
    AVG_SINCE,
    RankGpu,
    Reduction,
    measured_why,
    nccl_reduction,
    nccl_usable,
)
from cudampi.names import REDUCE_OPS
from cudampi.probe.capabilities import ProbeOutcome

A, B = "0000:19:00.0", "0000:3B:00.0"


def test_registered_and_stream_ordered():
    assert KINDS["nccl"].stream_ordered is True


def test_every_rank_its_own_gpu_is_usable():
    ranks = [RankGpu("n1", A), RankGpu("n1", B), RankGpu("n2", A), RankGpu("n2", B)]
    assert nccl_usable(ranks, None) is None
    assert nccl_usable(ranks, [None] * 4, measured=None) is None
    assert nccl_usable([RankGpu("n1", A)], None) is None  # world size 1


def test_ranks_sharing_a_gpu_keep_ipc():
    why = nccl_usable([RankGpu("n1", A), RankGpu("n1", A), RankGpu("n1", B)], None)
    assert why is not None and "ranks 0, 1 share the GPU at PCI 0000:19:00.0 on n1" in why
    assert "keep 'ipc'" in why
    many = [RankGpu("n1", A), RankGpu("n1", A), RankGpu("n1", B), RankGpu("n1", B)]
    assert "(2 GPUs are shared)" in str(nccl_usable(many, None))
    # the same bus id on two hosts is two GPUs
    assert nccl_usable([RankGpu("n1", A), RankGpu("n2", A)], None) is None


def test_no_gpu_or_no_nccl_on_any_rank_says_which():
    why = nccl_usable([RankGpu("n1", A), RankGpu("n1", None)], None)
    assert why is not None and "rank(s) 1 have no GPU" in why
    why = nccl_usable([RankGpu("n1", A)], "CuPy finds no NCCL library")
    assert why == "NCCL is not importable on rank 0: CuPy finds no NCCL library"
    why = nccl_usable([RankGpu("n1", A), RankGpu("n1", B)], [None, "no cupy"])
    assert why == "NCCL is not importable on rank 1: no cupy"


def test_the_probe_must_have_measured_it_for_auto():
    ranks = [RankGpu("n1", A), RankGpu("n1", B)]
    assert measured_why(ProbeOutcome("ok", "", 300.0)) is None
    not_probed = measured_why(None)
    assert not_probed is not None and "cudampi doctor" in not_probed
    why = nccl_usable(ranks, None, measured=not_probed)
    assert why is not None and why.startswith("NCCL was not measured here: no NCCL probe")
    crashed = measured_why(ProbeOutcome("crash", "signal 11"))
    assert crashed == "the probe found NCCL crash: signal 11"
    # the hard conditions come first: a shared GPU is the reason, not the missing measurement
    shared = [RankGpu("n1", A), RankGpu("n1", A)]
    assert "share the GPU" in str(nccl_usable(shared, None, measured=not_probed))


@pytest.mark.parametrize(
    ("dtype", "op", "version", "want"),
    [
        ("float32", "sum", 22703, Reduction("NCCL_FLOAT32", "NCCL_SUM")),
        ("bfloat16", "max", 22703, Reduction("NCCL_BFLOAT16", "NCCL_MAX")),
        ("float16", "prod", 22703, Reduction("NCCL_FLOAT16", "NCCL_PROD")),
        ("float64", "avg", AVG_SINCE, Reduction("NCCL_FLOAT64", "NCCL_AVG")),
        ("float32", "avg", 20906, Reduction("NCCL_FLOAT32", "NCCL_SUM", divide=True)),
        ("int64", "min", 22703, Reduction("NCCL_INT64", "NCCL_MIN")),
        ("int32", "avg", 22703, Reduction("NCCL_INT32", "NCCL_SUM", divide=True)),
        ("uint8", "sum", 22703, Reduction("NCCL_UINT8", "NCCL_SUM")),
        ("bool", "sum", 22703, Reduction("NCCL_UINT8", "NCCL_MAX")),
        ("bool", "band", 22703, Reduction("NCCL_UINT8", "NCCL_MIN")),
        ("complex64", "sum", 22703, Reduction("NCCL_FLOAT32", "NCCL_SUM", factor=2)),
        ("complex128", "avg", 22703, Reduction("NCCL_FLOAT64", "NCCL_AVG", factor=2)),
        ("complex64", "avg", 20906, Reduction("NCCL_FLOAT32", "NCCL_SUM", 2, divide=True)),
    ],
)
def test_reductions_map_onto_nccls_types_and_ops(dtype, op, version, want):
    assert nccl_reduction(dtype, op, version) == want


@pytest.mark.parametrize(
    ("dtype", "op", "said"),
    [
        ("int16", "sum", "no int16 datatype"),
        ("uint16", "max", "no uint16 datatype"),
        ("int64", "bxor", "no bitwise reductions"),
        ("uint8", "band", "no bitwise reductions"),
        ("bool", "bxor", "no logical xor"),
        ("complex64", "prod", "sum and avg, not 'prod'"),
        ("uint64", "avg", "avg of uint64"),
    ],
)
def test_what_nccl_cannot_reduce_is_refused_naming_the_other_paths(dtype, op, said):
    why = nccl_reduction(dtype, op, 22703)
    assert isinstance(why, str) and said in why and "path 'ipc' or 'gpu-ring'" in why


def test_every_valid_dtype_and_op_has_an_answer():
    from cudampi.comm.arrays import DTYPES

    for dtype in DTYPES:
        for op in REDUCE_OPS:
            if op in ops_allowed(dtype):
                assert isinstance(nccl_reduction(dtype, op, 22703), (Reduction, str))


@pytest.mark.skipif(
    not importlib.util.find_spec("cupy"), reason="CuPy's NCCL constants need CuPy installed"
)
def test_the_names_are_cupys_constants():
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not nccl.available:
        pytest.skip("CuPy finds no libnccl (pip install nvidia-nccl-cu13)")
    from cudampi.comm.arrays import DTYPES

    names = {"NCCL_UINT8"}
    for dtype in DTYPES:
        for op in ops_allowed(dtype):
            r = nccl_reduction(dtype, op, 22703)
            if isinstance(r, Reduction):
                names |= {r.dtype, r.op}
    missing = sorted(n for n in names if not isinstance(getattr(nccl, n, None), int))
    assert not missing, missing
