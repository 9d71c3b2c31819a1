"""``cudampi bench ddp``: training throughput of a real model under DistributedDataParallel,
per torch.distributed backend, against a no-communication baseline (``local``).

Models: torchvision's ResNet-50 on synthetic 224x224 images and a stack of ``torch.nn``
TransformerEncoderLayers on synthetic sequences (4 x d=1024 on CUDA, 2 x d=256 on the CPU).
On CUDA the default runs both, one after the other, each against its own ``local``; on the CPU
the transformer. Every path starts from the same weights; the check is DDP's own invariant:
after the timed steps every rank holds the same parameters (per-parameter float64 sums compared
across ranks; a differing parameter is one #wrong). Whether the CUDA MPS daemon was serving the
run is reported with it (``meta.mps``): ranks sharing a GPU time-slice it without MPS.

``ddp-nocomm`` is DDP whose comm hook hands every bucket back untouched: DDP's own cost (bucket
copies, hooks, the buffer broadcast) without gradient communication, the ceiling for every
backend; its replicas differ by design, so it is not checked. ``--rounds R`` trains every path
R times, interleaved, and reports the median round: a GPU shared by ranks drifts by about 2%
from pass to pass, the median of interleaved rounds by about 0.5%.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.bench.adapters import DDP_PATHS, Skip, attempt
from cudampi.bench.options import DDP_OPTIONS
from cudampi.bench.session import Session


@dataclass(frozen=True)
class DDPRow:
    path: str
    model: str
    batch: int
    steps: int
    step_ms: float
    step_min_ms: float
    step_max_ms: float
    samples_per_s: float
    """All ranks together."""
    per_rank: float
    vs_local: float | None
    """Throughput relative to the ``local`` baseline measured in the same run (1.0 = free)."""
    wrong: int | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Workload:
    name: str
    unit: str
    describe: str
    model: Any
    make_batch: Any
    loss: Any


def pick_models(choice: str, device: str, torchvision: bool) -> tuple[str, ...]:
    """The models of ``--model`` (a comma list of resnet50, transformer, all, auto) in run order.
    auto: on CUDA ResNet-50 (where torchvision is importable) and the transformer, on the CPU the
    transformer; all: both (ResNet-50 is then a skip with its reason where torchvision is
    missing)."""
    out: list[str] = []
    for item in choice.split(","):
        if item == "auto":
            both = ("resnet50", "transformer") if torchvision else ("transformer",)
            names: tuple[str, ...] = both if device == "cuda" else ("transformer",)
        elif item == "all":
            names = ("resnet50", "transformer")
        else:
            names = (item,)
        out += [n for n in names if n not in out]
    return tuple(out)


def _has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def build(kind: str, device: Any, batch: int, image_size: int | None, rank: int) -> Workload:
    import torch
    from torch import nn

    torch.manual_seed(1234)  # the same initial weights on every rank and for every path
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
    if kind == "resnet50":
        try:
            import torchvision
        except ImportError as exc:
            raise Skip(f"--model resnet50 needs torchvision ({exc})") from None
        side = image_size or 224
        model = torchvision.models.resnet50(weights=None).to(device)
        images = torch.randn(batch, 3, side, side, generator=gen).to(device)
        labels = torch.randint(0, 1000, (batch,), generator=gen).to(device)
        ce = nn.CrossEntropyLoss()
        return Workload(
            "resnet50",
            "images/s",
            f"torchvision ResNet-50, synthetic {side}x{side} images",
            model,
            lambda: (images, labels),
            lambda out, y: ce(out, y),
        )
    big = getattr(device, "type", str(device)) == "cuda"
    d, heads, layers, seq = (1024, 16, 4, 256) if big else (256, 4, 2, 64)
    model = nn.Sequential(
        *[
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        ],
        nn.Linear(d, d),
    ).to(device)
    x = torch.randn(batch, seq, d, generator=gen).to(device)
    target = torch.randn(batch, seq, d, generator=gen).to(device)
    mse = nn.MSELoss()
    return Workload(
        "transformer",
        "sequences/s",
        f"{layers} x nn.TransformerEncoderLayer(d={d}, heads={heads}, ff={4 * d}), seq {seq}",
        model,
        lambda: (x, target),
        lambda out, y: mse(out, y),
    )


def _steps(net: Any, opt: Any, w: Workload, n: int) -> None:
    for _ in range(n):
        x, y = w.make_batch()
        opt.zero_grad(set_to_none=True)
        loss = w.loss(net(x), y)
        loss.backward()
        opt.step()


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize()


def _param_sums(model: Any) -> list[float]:
    import torch

    with torch.no_grad():
        return [float(p.detach().double().sum().item()) for p in model.parameters()]


def run_ddp(
    session: Session, o: Any, meta: dict[str, Any]
) -> tuple[list[DDPRow], list[tuple[str, str, str]], dict[str, Any]]:
    """Every model of ``--model`` on every path; skips are (model, path, reason)."""
    s = session
    if "torch-cudampi" in o.paths or "torch-cudampi-async" in o.paths:
        s.torch_default = "cudampi"
    rows: list[DDPRow] = []
    skips: list[tuple[str, str, str]] = []
    info: dict[str, Any] = {"models": {}, "rounds": o.rounds, "ddp_options": dict(o.ddp_options)}
    for kind in pick_models(o.model, s.device, _has_torchvision()):
        r, sk, about = _run_model(s, o, kind)
        rows += r
        skips += [(kind, path, why) for path, why in sk]
        info["models"][kind] = about
        for key in ("model", "batch", "describe", "unit"):  # the first model's, as before
            info.setdefault(key, about.get(key))
    return rows, skips, info


def aggregate(rounds: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """One row's step time (min, typical, max) from its rounds' (min, mean, max) over the ranks:
    the median of the rounds' means (a round that the shared GPU slowed moves it least), the min
    and the max over every round and rank."""
    return (
        min(r[0] for r in rounds),
        statistics.median(r[1] for r in rounds),
        max(r[2] for r in rounds),
    )


UNCHECKED = ("local", "ddp-nocomm")
"""Paths whose replicas legitimately differ (no gradient is averaged): no #wrong check."""


def _run_model(
    s: Session, o: Any, kind: str
) -> tuple[list[DDPRow], list[tuple[str, str]], dict[str, Any]]:
    """``--rounds`` passes over the paths, interleaved (local, A, B, local, A, B, ...), so a
    drift of the machine hits every path alike; a path skipped in the first round is not
    retried."""
    import torch

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if s.device == "cuda"
        else torch.device("cpu")
    )
    batch = o.batch or (64 if kind == "resnet50" else (16 if s.device == "cuda" else 8))
    order = [p for p in o.paths if p == "local"] + [p for p in o.paths if p != "local"]
    times: dict[str, list[tuple[float, float, float]]] = {p: [] for p in order}
    wrongs: dict[str, list[int]] = {p: [] for p in order}
    skips: list[tuple[str, str]] = []
    info: dict[str, Any] = {"model": kind, "batch": batch}
    for r in range(o.rounds):
        for path in order:
            if r and not times[path]:
                continue  # skipped in the first round (or dropped since)
            if s.rank == 0 and not o.quiet:
                tag = f" round {r + 1}/{o.rounds}" if o.rounds > 1 else ""
                print(f"# ddp {path} {kind}{tag}", file=sys.stderr, flush=True)
            timed = _one_pass(s, o, kind, path, device, batch, info)
            if isinstance(timed, str):
                skips.append((path, timed if not r else f"round {r + 1}: {timed}"))
                times[path].clear()
                continue
            times[path].append(timed[0])
            if timed[1] is not None:
                wrongs[path].append(timed[1])
    rows: list[DDPRow] = []
    local_rate: float | None = None
    for path in order:
        if not times[path]:
            continue
        lo, typical, hi = aggregate(times[path])
        per_rank = batch / typical
        if path == "local":
            local_rate = per_rank
        rows.append(
            DDPRow(
                path=path,
                model=kind,
                batch=batch,
                steps=o.iters,
                step_ms=typical * 1e3,
                step_min_ms=lo * 1e3,
                step_max_ms=hi * 1e3,
                samples_per_s=per_rank * s.size,
                per_rank=per_rank,
                vs_local=None if local_rate is None or path == "local" else per_rank / local_rate,
                wrong=max(wrongs[path]) if wrongs[path] else None,
            )
        )
    return rows, skips, info


def _one_pass(
    s: Session, o: Any, kind: str, path: str, device: Any, batch: int, info: dict[str, Any]
) -> str | tuple[tuple[float, float, float], int | None]:
    """One round of ``path``: a fresh model, the probe step, -w warmup and -n timed steps.
    Returns the step time's (min, mean, max) over the ranks and the #wrong (None: not
    checked), or the reason every rank agrees it cannot run."""
    import torch

    def start() -> tuple[Workload, Any, Any]:
        w = build(kind, device, batch, o.image_size, s.rank)
        info["describe"] = w.describe
        info["unit"] = w.unit
        net = w.model if path == "local" else _wrap(s, path, w.model, device, dict(o.ddp_options))
        if path != "local":
            info["ddp"] = _settings_of(net)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        _steps(net, opt, w, 1)  # the probe step
        _sync(device)
        return w, net, opt

    made, agreed = attempt(s, start)
    if agreed is not None:
        return agreed
    assert made is not None
    w, net, opt = made
    _steps(net, opt, w, max(o.warmup - 1, 0))
    _sync(device)
    s.barrier()
    t0 = time.perf_counter()
    _steps(net, opt, w, o.iters)
    _sync(device)
    step = (time.perf_counter() - t0) / o.iters
    stats = s.stats(step)
    wrong = _count_wrong(s, o, w.model) if o.check and path not in UNCHECKED else None
    del net, opt, w
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return stats, wrong


def _wrap(s: Session, path: str, model: Any, device: Any, settings: dict[str, Any]) -> Any:
    """``model`` in DistributedDataParallel on ``path``'s backend (:class:`Skip` where that
    backend cannot train here) with ``settings`` (--ddp-option); ``ddp-nocomm`` on the run's
    default group, with a comm hook that communicates nothing."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    backend = DDP_PATHS[path]
    why = s.nccl_refusal(s.device) if backend == "nccl" else None
    if why is not None:
        raise Skip(why)
    group = _default_group(s) if backend is None else s.torch_group(backend)
    ids = [device.index] if device.type == "cuda" else None
    net = DDP(model, device_ids=ids, process_group=group, **settings)
    if backend is None:
        net.register_comm_hook(None, _nocomm_hook(device))
    return net


def _settings_of(net: Any) -> dict[str, Any]:
    """The settings DistributedDataParallel runs with (DDP's defaults or --ddp-option's), as it
    reports them, for the JSON."""
    out = {name: getattr(net, name, None) for name in DDP_OPTIONS if name != "bucket_cap_mb"}
    cap = getattr(net, "bucket_bytes_cap", None)
    out["bucket_cap_mb"] = None if cap is None else cap / 2**20
    return out


def _default_group(s: Session) -> Any:
    """torch's default group in this run: the one the torch paths' DDP would meet (cudampi's
    when a torch-cudampi path is asked, else gloo's). DDP still broadcasts the initial weights
    and, every forward, the buffers (BatchNorm's statistics) on it."""
    backend = s.torch_default
    try:
        return s.torch_group(backend)
    except Exception:
        if s.torch_default == backend:
            raise
        return s.torch_group(s.torch_default)  # cudampi's world group failed: gloo's is it


def _nocomm_hook(device: Any) -> Any:
    """A DDP comm hook that hands the bucket back untouched: no communication, no averaging."""
    import torch

    # No annotations: DDP refuses a hook whose annotations are not dist.GradBucket and
    # Future[Tensor] (and under `from __future__ import annotations` every one is a string).
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        cuda = device.type == "cuda"
        fut: Any = torch.futures.Future(devices=[device]) if cuda else torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    return hook


def _count_wrong(s: Session, o: Any, model: Any) -> int:
    """Parameters that differ from rank 0's after training (DDP keeps the replicas equal)."""
    import torch

    if o.corrupt_rank == s.rank:
        # test-only: this rank's first parameter really diverges before the check
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1.0
    every = s.comm.allgather(_param_sums(model))
    ref = every[0]
    return sum(1 for r in every[1:] for a, b in zip(r, ref) if abs(a - b) > 1e-6 * max(1.0, abs(b)))


def _mps_word(meta: dict[str, Any]) -> str:
    if meta.get("device") != "cuda":
        return ""
    return "; MPS on" if meta.get("mps") else "; MPS off"


def _rounds_words(meta: dict[str, Any], info: dict[str, Any]) -> str:
    rounds = info.get("rounds", 1)
    if rounds == 1:
        return ""
    steps = meta.get("iters")
    return f"; {steps} step{'' if steps == 1 else 's'} x {rounds} rounds, the median round"


def render_text(
    meta: dict[str, Any],
    info: dict[str, Any],
    rows: list[DDPRow],
    skips: list[tuple[str, str, str]],
) -> str:
    lines = [
        f"# cudampi bench ddp: ranks {meta.get('ranks')}; device {meta.get('device')}"
        + (f" [{meta.get('gpu_name')}]" if meta.get("gpu_name") else "")
        + _mps_word(meta)
        + _rounds_words(meta, info),
        f"# MPI: {meta.get('mpi_library', '?')}   torch {meta.get('torch')}",
    ]
    if info.get("ddp_options"):
        settings = ", ".join(f"{k}={v}" for k, v in info["ddp_options"].items())
        lines.append(f"# DistributedDataParallel({settings}) on every DDP path")
    models = info.get("models") or {info.get("model"): info}
    for kind, about in models.items():
        unit = about.get("unit", "samples/s")
        lines += [
            "#",
            f"# {about.get('describe', kind)}; batch {about.get('batch')} per rank",
            f"# {'path':<19s} {'step (ms)':>10s} {'min':>9s} {'max':>9s} {unit:>14s} "
            f"{'per rank':>10s} {'vs local':>9s} {'#wrong':>7s}",
        ]
        if not any(r.model == kind for r in rows):
            lines.append("  (every path skipped: the reasons follow)")
        for r in rows:
            if r.model != kind:
                continue
            vs = "-" if r.vs_local is None else f"{r.vs_local:.2f}x"
            wrong = "N/A" if r.wrong is None else str(r.wrong)
            lines.append(
                f"  {r.path:<19s} {r.step_ms:10.2f} {r.step_min_ms:9.2f} {r.step_max_ms:9.2f} "
                f"{r.samples_per_s:14.2f} {r.per_rank:10.2f} {vs:>9s} {wrong:>7s}"
            )
    lines.append("#")
    for kind, path, why in skips:
        lines.append(f"# {path} ({kind}): skipped: {why}")
    wrong_total = sum(r.wrong or 0 for r in rows)
    lines.append(
        f"# {'Out of bounds values':<20s} : {wrong_total} {'FAILED' if wrong_total else 'OK'}"
    )
    lines.append(
        f"# Verdict: {'OK' if not wrong_total else 'FAILED'}: {len(rows)} rows, {len(skips)} skipped"
        + (f"; parameters diverged across ranks on {wrong_total} tensors" if wrong_total else "")
    )
    return "\n".join(lines) + "\n"


def main(session: Session, o: Any, meta: dict[str, Any]) -> int:
    from cudampi.bench.output import emit

    rows, skips, info = run_ddp(session, o, meta)
    wrong = sum(r.wrong or 0 for r in rows)
    data = {
        "kind": "cudampi-bench-ddp",
        "meta": {**meta, **info},
        "results": [r.to_json() for r in rows],
        "skipped": [{"model": m, "path": p, "reason": w} for m, p, w in skips],
        "verdict": {"ok": wrong == 0, "wrong": wrong},
    }
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=[f.name for f in dataclasses.fields(DDPRow)], lineterminator="\n"
    )
    writer.writeheader()
    for r in rows:
        writer.writerow(r.to_json())
    if o.plot and session.rank == 0 and rows:
        from cudampi.bench.plot import plot_bars

        several = len({r.model for r in rows}) > 1
        plot_bars(
            {(f"{r.model} {r.path}" if several else r.path): r.samples_per_s for r in rows},
            o.plot,
            title=f"ddp {', '.join(info.get('models') or [info.get('model')])}: "
            f"{meta.get('ranks')} ranks, {meta.get('device')}{_mps_word(meta)}",
            ylabel="samples/s (all ranks)" if several else f"{info.get('unit')} (all ranks)",
        )
    emit(
        session,
        o,
        render_text(meta, info, rows, skips),
        json.dumps(data, indent=2) + "\n",
        buf.getvalue(),
    )
    return 0 if wrong == 0 else 1
