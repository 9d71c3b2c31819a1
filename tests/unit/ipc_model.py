"""A NumPy model of what the ipc kernels do with their parameters (data movement only).

It runs every rank's launch list in lock step, the way the kernels' barriers order them, on
byte arrays standing in for the inputs, outputs and data buffers, so the planning in
cudampi.comm.ipc.plan can be checked on the CPU. The GPU tests check the kernels themselves.
"""

from __future__ import annotations

import numpy

from cudampi.comm.ipc import layout as L
from tests import oracle


class Rank:
    def __init__(self, x: numpy.ndarray, out: numpy.ndarray | None, capacity: int) -> None:
        self.x = x.view(numpy.uint8).reshape(-1)
        self.out = None if out is None else out.view(numpy.uint8).reshape(-1)
        self.buf = numpy.full(capacity, 0xEE, numpy.uint8)  # poisoned: unstaged bytes show


X_BASE, OUT_BASE = 1 << 40, 2 << 40
"""The fake addresses plans are made with (x at X_BASE, out at OUT_BASE, per rank)."""


def run(ranks: list[Rank], plans: list[list], dtype: numpy.dtype, op: str = "") -> None:
    """Run each rank's launches (plans[r]) in lock step. Raises AssertionError where the
    kernels would report a mismatch."""
    n = len(ranks)
    assert len({len(p) for p in plans}) == 1, "ranks plan different numbers of launches"
    for step in range(len(plans[0])):
        ls = [plans[r][step] for r in range(n)]
        assert len({lc.kernel for lc in ls}) == 1, "different kernels"
        sigs = {tuple(lc.params[L.P_SIG : L.P_SIG + L.SIG_WORDS]) for lc in ls}
        assert len(sigs) == 1, "signature mismatch"
        ps = [lc.params for lc in ls]
        if ls[0].kernel == "reduce":
            _reduce(ranks, ps, numpy.dtype(dtype), op)
        else:
            _exchange(ranks, ps)


def _ptr(p: numpy.ndarray, slot: int) -> int:
    return int(p[slot])


def _x(rank: Rank, p: numpy.ndarray) -> numpy.ndarray:
    assert _ptr(p, L.P_IN) in (X_BASE, 0)
    return rank.x


def _reduce(ranks: list[Rank], ps: list[numpy.ndarray], dt: numpy.dtype, op: str) -> None:
    n, es = len(ranks), dt.itemsize
    for r, (rk, p) in enumerate(zip(ranks, ps)):
        mode, root = int(p[L.P_MODE]), int(p[L.P_ROOT])
        if (mode == L.MODE_ROOT and r == root) or int(p[L.P_REGIN]):
            continue  # the root reads its own input; a registered input is read where it lies
        for q in range(n):
            if mode in (L.MODE_TWOSHOT, L.MODE_SCATTER) and q == r:
                continue
            a, b, c = (int(p[s + q]) * es for s in (L.P_A, L.P_B, L.P_C))
            assert c % L.PACK == 0 and c + b <= len(rk.buf)
            rk.buf[c : c + b] = rk.x[a : a + b]
    acc_dt = numpy.float32 if dt == numpy.float16 else dt
    results = []
    for r, p in enumerate(ps):
        mode, root = int(p[L.P_MODE]), int(p[L.P_ROOT])
        for q in range(n):
            if not (
                mode == L.MODE_ONESHOT
                or (mode == L.MODE_ROOT and r == root)
                or (mode in (L.MODE_TWOSHOT, L.MODE_SCATTER) and q == r)
            ):
                continue
            a, b, c, d = (int(p[s + q]) * es for s in (L.P_A, L.P_B, L.P_C, L.P_D))
            vals = []
            for s in range(n):
                if s == r or int(ps[s][L.P_REGIN]):
                    src = ranks[s].x[a : a + b]
                else:
                    src = ranks[s].buf[c : c + b]
                vals.append(src.view(dt).astype(acc_dt))
            acc = vals[0].copy()
            for v in vals[1:]:
                oracle.ufunc(op, acc.dtype)(acc, v, out=acc)
            if op == "avg":
                acc = acc / n if acc.dtype.kind in "fc" else acc // n
            res = acc.astype(dt).view(numpy.uint8)
            results.append((r, mode, d, c, res))
    for r, mode, d, c, res in results:
        ranks[r].out[d : d + len(res)] = res
        if mode == L.MODE_TWOSHOT:
            ranks[r].buf[c : c + len(res)] = res
            for s in range(n):  # pushed into the outputs of the ranks that registered theirs
                if s != r and int(ps[s][L.P_REGOUT]):
                    ranks[s].out[d : d + len(res)] = res
    for r, (rk, p) in enumerate(zip(ranks, ps)):
        if int(p[L.P_MODE]) != L.MODE_TWOSHOT or int(p[L.P_REGOUT]):
            continue
        for q in range(n):
            if q != r:
                b, c, d = (int(p[s + q]) * es for s in (L.P_B, L.P_C, L.P_D))
                rk.out[d : d + b] = ranks[q].buf[c : c + b]


def _exchange(ranks: list[Rank], ps: list[numpy.ndarray]) -> None:
    n = len(ranks)
    for rk, p in zip(ranks, ps):
        if int(p[L.P_MODE]) == L.XMODE_SHARED:
            off, ln = int(p[L.P_STAGEOFF]), int(p[L.P_STAGE])
            rk.buf[0:ln] = rk.x[off : off + ln]
        else:
            for d in range(n):
                ln = int(p[L.P_B + d])
                if ln > 0:
                    a, e = int(p[L.P_A + d]), int(p[L.P_E + d])
                    assert a % L.PACK == 0 and a + ln <= len(rk.buf)
                    rk.buf[a : a + ln] = rk.x[e : e + ln]
    for r, p in enumerate(ps):
        for s in range(n):
            sent, want = int(ps[s][L.P_B + r]), int(p[L.P_D + s])
            assert max(sent, 0) == max(want, 0), f"rank {s} sends {sent} B, rank {r} expects {want}"
    for r, (rk, p) in enumerate(zip(ranks, ps)):
        for s in range(n):
            ln = int(p[L.P_D + s])
            if ln > 0:
                off, c = int(ps[s][L.P_A + r]), int(p[L.P_C + s])
                rk.out[c : c + ln] = ranks[s].buf[off : off + ln]
