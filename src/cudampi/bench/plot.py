"""``--plot out.png``: busbw against size, one line per path, the physical limit drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cudampi.bench.dtypes import NCCL_TYPENAME
from cudampi.bench.results import BenchResult, Limit
from cudampi.errors import BenchError

_LIMIT_LABEL = {
    "nvlink": "NVLink rate (topology)",
    "pcie": "PCIe rate (topology)",
    "hbm-copy": "HBM copy rate (ranks share one GPU)",
    "host-copy": "host memory copy rate",
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError(f"--plot needs matplotlib ({exc}); pip install 'cudampi[plot]'") from None
    return plt


def _draw_limit(ax: Any, limit: Limit | None) -> None:
    if limit is not None and limit.gbps > 0:
        ax.axhline(
            limit.gbps,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label=f"{_LIMIT_LABEL.get(limit.kind, limit.kind)}: {limit.gbps:.1f} GB/s",
        )


def plot_collectives(result: BenchResult, out: str | Path) -> Path:
    """One panel per (collective, dtype, redop); x: size (log2), y: busbw (log)."""
    plt = _pyplot()
    blocks = list(dict.fromkeys((r.op, r.dtype, r.redop) for r in result.rows if r.op != "copy"))
    copy_rows = [r for r in result.rows if r.op == "copy"]
    if not blocks and copy_rows:
        blocks = [("copy", copy_rows[0].dtype, None)]
    if not blocks:
        raise BenchError("--plot: no rows ran, nothing to draw (every path was skipped)")
    cols = min(2, len(blocks))
    nrows = (len(blocks) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 4.8 * nrows), squeeze=False)
    m = result.meta
    for ax, (op, dtype, redop) in zip(axes.flat, blocks):
        rows = [r for r in result.rows if (r.op, r.dtype, r.redop) == (op, dtype, redop)]
        if op != "copy":
            rows += [r for r in copy_rows if r.dtype == dtype]
        for name in dict.fromkeys(r.path for r in rows):
            pts = sorted((r.size, r.busbw) for r in rows if r.path == name and r.busbw > 0)
            if not pts:
                continue
            style = ":" if name in ("copy", "mpi") else "-"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                marker="o",
                markersize=3,
                label=name,
            )
        _draw_limit(ax, result.limit)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        title = f"{op} {NCCL_TYPENAME.get(dtype, dtype)}" + (f" {redop}" if redop else "")
        ax.set_title(f"{title}: {m.get('ranks')} ranks, {m.get('device')}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(blocks) :]:
        ax.set_visible(False)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_series(
    series: dict[str, list[tuple[int, float]]],
    out: str | Path,
    *,
    title: str,
    ylabel: str,
    limit: Limit | None = None,
) -> Path:
    """Generic lines (p2p bandwidth): name -> [(size, value)]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, pts in series.items():
        pts = sorted(p for p in pts if p[1] > 0)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
    _draw_limit(ax, limit)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(values: dict[str, float], out: str | Path, *, title: str, ylabel: str) -> Path:
    """One bar per path (ddp throughput)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = list(values)
    ax.bar(names, [values[n] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.text(i, values[n], f"{values[n]:.3g}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
