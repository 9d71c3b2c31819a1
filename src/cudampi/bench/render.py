"""Render a :class:`BenchResult`: nccl-tests tables per path, a side-by-side busbw table, the
ratios against the peers, and the verdict footer; or JSON, or CSV. Pure: text in, text out."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from typing import Any

from cudampi.bench.adapters import DESCRIPTION
from cudampi.bench.dtypes import NCCL_TYPENAME
from cudampi.bench.results import NOISE, BenchResult, Row, SkipNote

PEER_ORDER = ("torch-gloo", "mpi", "copy", "torch-nccl")
"""The paths the ratios are taken against, when they ran in the same run."""

CSV_FIELDS = (
    "op",
    "path",
    "dtype",
    "redop",
    "root",
    "size",
    "count",
    "iters",
    "time_us",
    "time_min_us",
    "time_max_us",
    "algbw",
    "busbw",
    "wrong",
    "spread",
    "noisy",
    "skipped",
)


def fmt(value: float, width: int) -> str:
    """nccl-tests' number format: 2 decimals, fewer when the width is tight, then exponent."""
    if math.isinf(value) or math.isnan(value):
        return f"{value!s:>{width}}"
    for spec in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{spec}}"
        if len(text) <= width:
            return text
    return f"{value:{width}.1e}" if width >= 7 else f"{value:{width}.0e}"


def sig(value: float) -> str:
    """Three significant digits (the side-by-side table spans 8 B to 1 GB)."""
    return f"{value:.3g}"


Block = tuple[str, str, str | None]  # op, dtype, redop


def _blocks(rows: Iterable[Row], skips: Iterable[SkipNote]) -> list[Block]:
    seen: dict[Block, None] = {}
    for r in rows:
        seen.setdefault((r.op, r.dtype, r.redop), None)
    for s in skips:
        seen.setdefault((s.op, s.dtype, s.redop), None)
    return list(seen)


def _header_lines() -> list[str]:
    cols = (
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "min",
        "max",
        "algbw",
        "busbw",
        "#wrong",
    )
    units = ("(B)", "(elements)", "", "", "", "(us)", "(us)", "(us)", "(GB/s)", "(GB/s)", "")
    pattern = (
        "# {:>10s}  {:>12s}  {:>8s}  {:>6s}  {:>6s}  {:>9s}  {:>9s}  {:>9s}  {:>7s}  {:>7s}  {:>6s}"
    )
    return [pattern.format(*cols), pattern.format(*units)]


def row_line(r: Row) -> str:
    wrong = "N/A" if r.wrong is None else str(r.wrong)
    return (
        f"  {r.size:>10d}  {r.count:>12d}  {NCCL_TYPENAME.get(r.dtype, r.dtype):>8s}  "
        f"{r.redop or 'none':>6s}  {r.root:>6d}  {fmt(r.time_us, 9)}  {fmt(r.time_min_us, 9)}  "
        f"{fmt(r.time_max_us, 9)}  {fmt(r.algbw, 7)}  {fmt(r.busbw, 7)}  {wrong:>6s}"
        + (f"  noisy({r.spread:.1f}x)" if r.noisy else "")
    )


def _title(op: str, dtype: str, redop: str | None) -> str:
    return f"{op} {NCCL_TYPENAME.get(dtype, dtype)}" + (f" {redop}" if redop else "")


def ratios(result: BenchResult) -> list[dict[str, Any]]:
    """busbw of every path over every peer, at the largest size both ran, per block."""
    out: list[dict[str, Any]] = []
    for op, dtype, redop in _blocks(result.rows, ()):
        by_path: dict[str, dict[int, float]] = {}
        for r in result.rows:
            if (r.op, r.dtype, r.redop) == (op, dtype, redop):
                by_path.setdefault(r.path, {})[r.size] = r.busbw
        copy = {r.size: r.busbw for r in result.rows if r.op == "copy" and r.dtype == dtype}
        peers = {p: by_path[p] for p in PEER_ORDER if p in by_path}
        if copy and op != "copy":
            peers["copy"] = copy
        for path, sizes in by_path.items():
            if path in PEER_ORDER:
                continue  # peers are what the others are measured against
            for peer, psizes in peers.items():
                common = sorted(set(sizes) & set(psizes))
                if not common or psizes[common[-1]] <= 0:
                    continue
                size = common[-1]
                out.append(
                    {
                        "op": op,
                        "dtype": dtype,
                        "redop": redop,
                        "path": path,
                        "peer": peer,
                        "size": size,
                        "busbw": sizes[size],
                        "peer_busbw": psizes[size],
                        "ratio": sizes[size] / psizes[size],
                    }
                )
    return out


def render_text(result: BenchResult) -> str:
    m = result.meta
    lines = [
        f"# cudampi bench {m.get('mode', 'collectives')}: ranks {m.get('ranks')} "
        f"(nodes {m.get('nodes')}, {m.get('local_size')} per node)  device {m.get('device')}"
        + (f" [{m.get('gpu_name')} x{m.get('gpus')}]" if m.get("gpu_name") else "")
        + f"  warmup {m.get('warmup')}  iters {m.get('iters')}  check {'on' if m.get('check') else 'off'}"
        + ("  in place" if m.get("in_place") else "")
        + (f"  time-limit {m.get('time_limit')} s" if m.get("time_limit") else ""),
        f"# MPI: {m.get('mpi_library', '?')}",
    ]
    if m.get("ranks") == 1:
        lines.append(f"# {ONE_RANK}")
    if m.get("torch"):
        lines.append(f"# torch {m['torch']}")
    lines.append("#")
    for op, dtype, redop in _blocks(result.rows, result.skips):
        paths: dict[str, None] = {}
        for r in result.rows:
            if (r.op, r.dtype, r.redop) == (op, dtype, redop):
                paths.setdefault(r.path, None)
        for s in result.skips:
            if (s.op, s.dtype, s.redop) == (op, dtype, redop):
                paths.setdefault(s.path, None)
        for path in paths:
            rows = [
                r
                for r in result.rows
                if (r.op, r.path, r.dtype, r.redop) == (op, path, dtype, redop)
            ]
            skipped = [
                s
                for s in result.skips
                if (s.op, s.path, s.dtype, s.redop) == (op, path, dtype, redop)
            ]
            lines.append(f"# {_title(op, dtype, redop)} on {path}: {DESCRIPTION.get(path, '')}")
            for c in result.extra.get("choices", ()):
                if (c["op"], c["path"], c["dtype"], c["redop"]) == (op, path, dtype, redop):
                    lines.append(f"#   runs: {c['engine']} engine; {c['reason']}")
            if rows:
                lines += _header_lines()
                lines += [row_line(r) for r in rows]
            for s in skipped:
                lines.append(f"#   skipped: {s.reason}")
            lines.append("#")
        lines += _side_by_side(result, op, dtype, redop)
    lines += _ratio_lines(result)
    lines += footer(result)
    return "\n".join(lines) + "\n"


def _side_by_side(result: BenchResult, op: str, dtype: str, redop: str | None) -> list[str]:
    rows = [r for r in result.rows if (r.op, r.dtype, r.redop) == (op, dtype, redop)]
    paths = list(dict.fromkeys(r.path for r in rows))
    if len(paths) < 2:
        return []
    table: dict[int, dict[str, float]] = {}
    for r in rows:
        table.setdefault(r.size, {})[r.path] = r.busbw
    width = max(10, *(len(p) for p in paths))
    lines = [f"# busbw (GB/s) side by side: {_title(op, dtype, redop)}"]
    lines.append("# " + f"{'size (B)':>10s}" + "".join(f"  {p:>{width}s}" for p in paths))
    for size in sorted(table):
        cells = "".join(
            f"  {sig(table[size][p]) if p in table[size] else '-':>{width}s}" for p in paths
        )
        lines.append(f"  {size:>10d}{cells}")
    lines.append("#")
    return lines


def _ratio_lines(result: BenchResult) -> list[str]:
    rs = [r for r in ratios(result) if r["op"] != "copy"]
    if not rs:
        return []
    lines = ["# ratios against the peers measured in this run (busbw, largest common size)"]
    for r in rs:
        lines.append(
            f"#   {_title(r['op'], r['dtype'], r['redop']):<28s} {r['path']:>13s} / {r['peer']:<10s}"
            f" at {r['size']:>10d} B: {fmt(r['busbw'], 8)} / {fmt(r['peer_busbw'], 8)} GB/s"
            f" = {r['ratio']:.2f}x"
        )
    lines.append("#")
    return lines


ONE_RANK = (
    "1 rank: nothing crosses ranks, so busbw is 0; run more with --np 2 (cudampi bench ... "
    "--np 2) or under a launcher (cudampi launch -n 2 cudampi bench ...)"
)


def footer(result: BenchResult) -> list[str]:
    """nccl-tests' footer (out-of-bounds count, average busbw) and cudampi's verdict."""
    lines = [
        f"# {'Out of bounds values':<20s} : {result.wrong} {'FAILED' if result.wrong else 'OK'}"
    ]
    avg: dict[str, list[float]] = {}
    for r in result.rows:
        avg.setdefault(r.path, []).append(r.busbw)
    if avg:
        text = ", ".join(f"{p} {sum(v) / len(v):.3g}" for p, v in avg.items())
        lines.append(f"# {'Avg bus bandwidth':<20s} : {text}")
    if result.limit:
        lines.append(
            f"# {'Physical limit':<20s} : {result.limit.gbps:.1f} GB/s ({result.limit.kind}: "
            f"{result.limit.source})"
        )
    problems = []
    if result.wrong:
        bad = sorted({f"{r.op}/{r.path}/{r.dtype}" for r in result.rows if r.wrong})
        problems.append(f"{result.wrong} wrong elements ({', '.join(bad)})")
    for (op, path, dtype, _redop), peak in result.below_min():
        problems.append(
            f"{op} on {path} ({dtype}) peaked at {peak:.3g} GB/s < --min-busbw {result.min_busbw:g}"
        )
    noisy = result.noisy()
    if noisy:
        worst = max(noisy, key=lambda r: r.spread)
        lines.append(
            f"# {'Noise':<20s} : {len(noisy)} of {len(result.rows)} rows (marked noisy) varied "
            f"more than {NOISE:g}x between repeated timings (worst {worst.spread:.1f}x: {worst.op} "
            f"on {worst.path} at {worst.size} B): not a figure to quote. Rerun on an idle "
            "machine, with more iterations (-n), ranks bound to cores (cudampi launch binds "
            "them where no GPU does)"
        )
    ran = len({r.path for r in result.rows})
    notes = []
    if noisy:
        notes.append(f"{len(noisy)} noisy row(s)")
    if result.meta.get("ranks") == 1:
        notes.append("1 rank only: nothing crossed ranks (--np 2 for more)")
    lines.append(
        f"# Verdict: {'OK' if not problems else 'FAILED'}: {len(result.rows)} rows on {ran} path(s), "
        f"{len(result.skips)} skipped"
        + ("" if not problems else "; " + "; ".join(problems))
        + ("" if not notes else " (" + "; ".join(notes) + ")")
    )
    return lines


def render_json(result: BenchResult) -> str:
    data = result.to_json()
    data["ratios"] = ratios(result)
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


def render_csv(result: BenchResult) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), lineterminator="\n")
    w.writeheader()
    for r in result.rows:
        d = r.to_json()
        d["skipped"] = ""
        w.writerow(d)
    for s in result.skips:
        w.writerow(
            {"op": s.op, "path": s.path, "dtype": s.dtype, "redop": s.redop, "skipped": s.reason}
        )
    return buf.getvalue()
