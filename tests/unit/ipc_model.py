"""A NumPy model of what the ipc kernels do with their parameters (data movement only).

It runs every rank's launch list in lock step, the way the kernels' barriers order them, on
byte arrays standing in for the inputs, outputs and data buffers, so the planning in
cudampi.comm.ipc.plan can be checked on the CPU. The GPU tests check the kernels themselves.
"""

from __future__ import annotations

import numpy

from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
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
        if ls[0].kernel == "twoshot":
            _twoshot(ranks, ps, numpy.dtype(dtype), op)
        elif ls[0].kernel == "reduce":
            _reduce(ranks, ps, numpy.dtype(dtype), op)
        else:
            _exchange(ranks, ps)


def _ptr(p: numpy.ndarray, slot: int) -> int:
    return int(p[slot])


def _x(rank: Rank, p: numpy.ndarray) -> numpy.ndarray:
    assert _ptr(p, L.P_IN) in (X_BASE, 0)
    return rank.x


def _combine(vals: list[numpy.ndarray], dt: numpy.dtype, op: str) -> numpy.ndarray:
    """The reduction of every rank's values in rank order, as bytes of ``dt``."""
    acc_dt = numpy.float32 if dt == numpy.float16 else dt
    acc = vals[0].view(dt).astype(acc_dt)
    for v in vals[1:]:
        oracle.ufunc(op, acc.dtype)(acc, v.view(dt).astype(acc_dt), out=acc)
    if op == "avg":
        acc = acc / len(vals) if acc.dtype.kind in "fc" else acc // len(vals)
    return acc.astype(dt).view(numpy.uint8)


def _twoshot(ranks: list[Rank], ps: list[numpy.ndarray], dt: numpy.dtype, op: str) -> None:
    """The two-shot allreduce (kernels.cu ``twoshot_kernel``): one launch in rounds of
    P_CHUNK elements through the data buffers, or one round where every rank registered both
    buffers (read and written in place, no buffer used)."""
    n, es, pe = len(ranks), dt.itemsize, L.PACK // dt.itemsize
    count, chunk = int(ps[0][L.P_COUNT]), int(ps[0][L.P_CHUNK])
    assert all(int(p[L.P_COUNT]) == count and int(p[L.P_CHUNK]) == chunk for p in ps)
    regin = [bool(int(p[L.P_REGIN])) for p in ps]
    regout = [bool(int(p[L.P_REGOUT])) for p in ps]
    step = count if all(regin) and all(regout) else chunk
    for c0 in range(0, max(count, 1), max(step, 1)):
        m = min(step, count - c0)
        sl = [(lo * es, hi * es) for lo, hi in plan._slices(m, n, pe)]
        base = c0 * es
        for r, rk in enumerate(ranks):  # stage every slice but its own, unless registered
            if not regin[r]:
                for q, (a, b) in enumerate(sl):
                    if q != r:
                        assert b <= len(rk.buf), "a round larger than the data buffer"
                        rk.buf[a:b] = rk.x[base + a : base + b]
        done = []
        for q, (a, b) in enumerate(sl):  # rank q reduces slice q
            vals = [
                ranks[s].x[base + a : base + b] if s == q or regin[s] else ranks[s].buf[a:b]
                for s in range(n)
            ]
            done.append(_combine(vals, dt, op))
        for q, (a, b) in enumerate(sl):
            ranks[q].out[base + a : base + b] = done[q]
            if not all(regout[s] for s in range(n) if s != q):
                ranks[q].buf[a:b] = done[q]  # kept for the ranks that fetch
            for s in range(n):  # pushed into the outputs of the ranks that registered theirs
                if s != q and regout[s]:
                    ranks[s].out[base + a : base + b] = done[q]
        for r, rk in enumerate(ranks):
            if not regout[r]:
                for q, (a, b) in enumerate(sl):
                    if q != r:
                        rk.out[base + a : base + b] = ranks[q].buf[a:b]


def _reduce(ranks: list[Rank], ps: list[numpy.ndarray], dt: numpy.dtype, op: str) -> None:
    n, es = len(ranks), dt.itemsize
    for r, (rk, p) in enumerate(zip(ranks, ps)):
        mode, root = int(p[L.P_MODE]), int(p[L.P_ROOT])
        if mode == L.MODE_ROOT and r == root:
            continue  # the root reads its own input
        for q in range(n):
            if mode == L.MODE_SCATTER and q == r:
                continue
            a, b, c = (int(p[s + q]) * es for s in (L.P_A, L.P_B, L.P_C))
            assert c % L.PACK == 0 and c + b <= len(rk.buf)
            rk.buf[c : c + b] = rk.x[a : a + b]
    for r, p in enumerate(ps):
        mode, root = int(p[L.P_MODE]), int(p[L.P_ROOT])
        for q in range(n):
            if not (
                mode == L.MODE_ONESHOT
                or (mode == L.MODE_ROOT and r == root)
                or (mode == L.MODE_SCATTER and q == r)
            ):
                continue
            a, b, c, d = (int(p[s + q]) * es for s in (L.P_A, L.P_B, L.P_C, L.P_D))
            vals = [ranks[s].x[a : a + b] if s == r else ranks[s].buf[c : c + b] for s in range(n)]
            ranks[r].out[d : d + b] = _combine(vals, dt, op)


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
