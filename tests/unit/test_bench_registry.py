"""Each collective unit's buffers and expected data, checked against a collective computed
in-process from every simulated rank's input (NumPy and torch), and the wrong-data hook."""

from __future__ import annotations

import numpy as np
import pytest

from cudampi.bench.dtypes import parse_dtype
from cudampi.bench.metrics import collective_layout
from cudampi.bench.registry import UNITS, Case
from cudampi.comm.arrays import Unsupported, checks_for
from cudampi.errors import ConfigError
from tests import oracle


def _np(x):
    if hasattr(x, "detach"):
        import torch

        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def simulate(op, sends, n, redop, root):
    """What a correct collective leaves in each rank's result, from every rank's input."""
    xs = [_np(s).reshape(-1) for s in sends]
    if redop in ("band", "bor", "bxor"):
        red = oracle.reduce([x.astype(np.int64) for x in xs], redop).astype(np.float64)
    elif redop:
        red = oracle.reduce(xs, redop)
    if op in ("allreduce", "reduce"):
        return [red] * n
    if op == "reduce_scatter":
        k = xs[0].size // n
        return [red[r * k : (r + 1) * k] for r in range(n)]
    if op == "allgather":
        return [np.concatenate(xs)] * n
    if op == "alltoall":
        k = xs[0].size // n
        return [np.concatenate([xs[s][r * k : (r + 1) * k] for s in range(n)]) for r in range(n)]
    if op == "broadcast":
        return [xs[root]] * n
    if op == "sendrecv":
        return [xs[(r - 1) % n] for r in range(n)]
    if op == "copy":
        return xs
    raise AssertionError(op)


def libs():
    out = [checks_for("numpy", "cpu")]
    try:
        out.append(checks_for("torch", "cpu"))
    except Unsupported:
        pass
    return out


CASES = [
    ("allreduce", "sum", "float32"),
    ("allreduce", "prod", "float32"),
    ("allreduce", "min", "int32"),
    ("allreduce", "max", "float64"),
    ("allreduce", "avg", "float32"),
    ("allreduce", "bxor", "int64"),
    ("allreduce", "sum", "float16"),
    ("allreduce", "sum", "uint8"),
    ("reduce", "sum", "float32"),
    ("reduce_scatter", "sum", "float32"),
    ("reduce_scatter", "band", "int32"),
    ("allgather", None, "float32"),
    ("alltoall", None, "int8"),
    ("broadcast", None, "float32"),
    ("sendrecv", None, "float64"),
    ("copy", None, "float32"),
]


@pytest.mark.parametrize("lib", libs(), ids=lambda lib: lib.name)
@pytest.mark.parametrize(("op", "redop", "dtype"), CASES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_expected_matches_a_correct_collective(lib, op, redop, dtype, n):
    unit = UNITS[op]
    root = n - 1
    L = collective_layout(
        op, 4096, {"float16": 2, "float64": 8, "int64": 8, "int8": 1, "uint8": 1}.get(dtype, 4), n
    )
    cases = [Case(lib, L, r, n, dtype, redop, root, False) for r in range(n)]
    bufs = [unit.prepare(c) for c in cases]
    results = simulate(op, [b.send for b in bufs], n, redop, root)
    for r, c in enumerate(cases):
        exp = unit.expected(c)
        if exp is None:
            assert op == "reduce" and r != root
            continue
        out = np.asarray(results[r])
        # write the simulated result into the rank's real result buffer, then check it
        res = unit.result(bufs[r])
        if lib.name == "torch":
            import torch

            res.view(-1).copy_(torch.from_numpy(out).to(res.dtype))
        else:
            res.reshape(-1)[...] = out.astype(res.dtype)
        assert lib.count_wrong(res, exp, dtype) == 0, (op, redop, dtype, n, r)
        if lib.flat(res).shape[0]:
            lib.corrupt(res)
            assert lib.count_wrong(res, exp, dtype) == 1


def test_inputs_differ_between_ranks_so_mistakes_show():
    lib = checks_for("numpy", "cpu")
    a = lib.pattern64(64, 0, "sum")
    b = lib.pattern64(64, 1, "sum")
    assert (a != b).any()
    assert set(np.unique(lib.pattern64(64, 3, "prod"))) <= {1.0, 2.0}


def test_inplace_paths_get_the_input_in_the_result_buffer():
    lib = checks_for("numpy", "cpu")
    L = collective_layout("allreduce", 64, 4, 2)
    b = UNITS["allreduce"].prepare(Case(lib, L, 1, 2, "float32", "sum", 0, True))
    assert (b.recv == b.send).all()


def test_numpy_has_no_bfloat16_but_torch_does():
    with pytest.raises(Unsupported, match="bfloat16"):
        checks_for("numpy", "cpu").check_dtype("bfloat16")
    pytest.importorskip("torch")
    t = checks_for("torch", "cpu")
    x = t.pattern(16, 2, "sum", "bfloat16")
    assert t.count_wrong(x, t.pattern64(16, 2, "sum"), "bfloat16") == 0


def test_dtype_names():
    assert parse_dtype("float") == "float32"
    assert parse_dtype("bf16") == "bfloat16"
    assert parse_dtype("half") == "float16"
    with pytest.raises(ConfigError, match="'complex'"):
        parse_dtype("complex")
