"""The training runner ``bench ddp`` and ``bench fsdp`` share: the models, the rounds, the step
timing, the rows, the table and the JSON. A mode is a :class:`Method` (how a path wraps the
model, how its parameters are checked, what its report adds); nothing else differs.

Models: torchvision's ResNet-50 on synthetic 224x224 images and a stack of ``torch.nn``
TransformerEncoderLayers on synthetic sequences (4 x d=1024 on CUDA, 2 x d=256 on the CPU).
Every path starts from the same weights and trains on the same per-rank batches (rank ``r``'s
from seed ``1000 + r``) for the same number of steps. ``--rounds R`` trains every path R times,
interleaved, and reports the median round: a GPU shared by ranks drifts by about 2% from pass to
pass, the median of interleaved rounds by about 0.5%.
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

from cudampi.bench.adapters import Skip, attempt
from cudampi.bench.session import Session


@dataclass(frozen=True)
class TrainRow:
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
    blocks: tuple[Any, ...] = ()
    """The model's repeated blocks (FSDP2 shards each as one unit)."""


class Method:
    """One way of training data-parallel (DDP, FSDP2): what the runner asks of a mode."""

    mode = ""
    unchecked: tuple[str, ...] = ("local",)
    """Paths whose replicas legitimately differ: no #wrong."""
    diverged = "parameters diverged across ranks"
    """The verdict's words for parameters counted in #wrong."""

    def prepare(self, s: Session, o: Any, kind: str, device: Any, batch: int) -> None:
        """Called once per model before its rounds (every rank)."""

    def wrap(self, s: Session, path: str, w: Workload, device: Any) -> Any:
        """The module ``path`` trains (``w.model`` wrapped); :class:`Skip` where it cannot."""
        raise NotImplementedError

    def settings(self, path: str, net: Any) -> tuple[str, dict[str, Any]] | None:
        """What the wrapper runs with, for the JSON: (key under ``meta.models.<model>``, dict)."""
        return None

    def wrong(self, s: Session, o: Any, path: str, w: Workload) -> int:
        """Parameters of ``w.model`` that are wrong after the timed steps (collective)."""
        raise NotImplementedError

    def notes(self, kind: str, rows: list[TrainRow]) -> tuple[list[str], dict[str, Any]]:
        """Lines under a model's table and what they say as JSON (ratios between rows)."""
        return [], {}


def steps_per_pass(o: Any) -> int:
    """Optimizer steps of one pass: the probe step, ``-w`` minus one warmups, ``-n`` timed."""
    return 1 + max(o.warmup - 1, 0) + o.iters


def pick_models(choice: str, device: str, torchvision: bool, mode: str = "ddp") -> tuple[str, ...]:
    """The models of ``--model`` (a comma list of resnet50, transformer, all, auto) in run order.
    auto: for ddp on CUDA ResNet-50 (where torchvision is importable) and the transformer, else
    the transformer; all: both (ResNet-50 is then a skip with its reason where torchvision is
    missing)."""
    out: list[str] = []
    for item in choice.split(","):
        if item == "auto":
            both = ("resnet50", "transformer") if torchvision else ("transformer",)
            names: tuple[str, ...] = (
                both if device == "cuda" and mode == "ddp" else ("transformer",)
            )
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


def make_optimizer(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _transformer_dims(device: Any) -> tuple[int, int, int, int]:
    """(d, heads, layers, seq): 4 x d=1024 on CUDA, 2 x d=256 on the CPU."""
    big = getattr(device, "type", str(device)) == "cuda"
    return (1024, 16, 4, 256) if big else (256, 4, 2, 64)


def inputs(kind: str, device: Any, batch: int, image_size: int | None, rank: int) -> Any:
    """Rank ``rank``'s synthetic batch (x, target) of ``kind``: the same in every pass."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)
    if kind == "resnet50":
        side = image_size or 224
        images = torch.randn(batch, 3, side, side, generator=gen).to(device)
        return images, torch.randint(0, 1000, (batch,), generator=gen).to(device)
    d, _, _, seq = _transformer_dims(device)
    x = torch.randn(batch, seq, d, generator=gen).to(device)
    return x, torch.randn(batch, seq, d, generator=gen).to(device)


def build(kind: str, device: Any, batch: int, image_size: int | None, rank: int) -> Workload:
    """``kind``'s model (the same initial weights on every rank and for every path) and rank
    ``rank``'s batch."""
    import torch
    from torch import nn

    torch.manual_seed(1234)
    x, y = inputs(kind, device, batch, image_size, rank)
    if kind == "resnet50":
        try:
            import torchvision
        except ImportError as exc:
            raise Skip(f"--model resnet50 needs torchvision ({exc})") from None
        model = torchvision.models.resnet50(weights=None).to(device)
        ce = nn.CrossEntropyLoss()
        stages = (model.layer1, model.layer2, model.layer3, model.layer4)
        return Workload(
            "resnet50",
            "images/s",
            f"torchvision ResNet-50, synthetic {x.shape[-1]}x{x.shape[-1]} images",
            model,
            lambda: (x, y),
            lambda out, y: ce(out, y),
            tuple(block for stage in stages for block in stage),
        )
    d, heads, layers, seq = _transformer_dims(device)
    blocks = tuple(
        nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        for _ in range(layers)
    )
    model = nn.Sequential(*blocks, nn.Linear(d, d)).to(device)
    mse = nn.MSELoss()
    return Workload(
        "transformer",
        "sequences/s",
        f"{layers} x nn.TransformerEncoderLayer(d={d}, heads={heads}, ff={4 * d}), seq {seq}",
        model,
        lambda: (x, y),
        lambda out, y: mse(out, y),
        blocks,
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


def torch_device(s: Session) -> Any:
    import torch

    if s.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run(
    s: Session, o: Any, method: Method
) -> tuple[list[TrainRow], list[tuple[str, str, str]], dict[str, Any]]:
    """Every model of ``--model`` on every path; skips are (model, path, reason)."""
    if any("torch-cudampi" in p for p in o.paths):
        s.torch_default = "cudampi"
    rows: list[TrainRow] = []
    skips: list[tuple[str, str, str]] = []
    info: dict[str, Any] = {"models": {}, "rounds": o.rounds, "ddp_options": dict(o.ddp_options)}
    for kind in pick_models(o.model, s.device, _has_torchvision(), method.mode):
        r, sk, about = _run_model(s, o, method, kind)
        rows += r
        skips += [(kind, path, why) for path, why in sk]
        lines, ratios = method.notes(kind, r)
        if lines:
            about["notes"] = lines
        if ratios:
            about["ratios"] = ratios
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


def _run_model(
    s: Session, o: Any, method: Method, kind: str
) -> tuple[list[TrainRow], list[tuple[str, str]], dict[str, Any]]:
    """``--rounds`` passes over the paths, interleaved (local, A, B, local, A, B, ...), so a
    drift of the machine hits every path alike; a path skipped in the first round is not
    retried."""
    device = torch_device(s)
    batch = o.batch or (64 if kind == "resnet50" else (16 if s.device == "cuda" else 8))
    order = [p for p in o.paths if p == "local"] + [p for p in o.paths if p != "local"]
    times: dict[str, list[tuple[float, float, float]]] = {p: [] for p in order}
    wrongs: dict[str, list[int]] = {p: [] for p in order}
    skips: list[tuple[str, str]] = []
    info: dict[str, Any] = {"model": kind, "batch": batch}
    if o.check and any(p not in method.unchecked for p in order):
        _, why = attempt(s, lambda: method.prepare(s, o, kind, device, batch))
        if why is not None:  # e.g. the model itself cannot be built here
            return [], [(p, why) for p in order], info
    for r in range(o.rounds):
        for path in order:
            if r and not times[path]:
                continue  # skipped in the first round (or dropped since)
            if s.rank == 0 and not o.quiet:
                tag = f" round {r + 1}/{o.rounds}" if o.rounds > 1 else ""
                print(f"# {method.mode} {path} {kind}{tag}", file=sys.stderr, flush=True)
            timed = _one_pass(s, o, method, kind, path, device, batch, info)
            if isinstance(timed, str):
                skips.append((path, timed if not r else f"round {r + 1}: {timed}"))
                times[path].clear()
                continue
            times[path].append(timed[0])
            if timed[1] is not None:
                wrongs[path].append(timed[1])
    rows: list[TrainRow] = []
    local_rate: float | None = None
    for path in order:
        if not times[path]:
            continue
        lo, typical, hi = aggregate(times[path])
        per_rank = batch / typical
        if path == "local":
            local_rate = per_rank
        rows.append(
            TrainRow(
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
    s: Session,
    o: Any,
    method: Method,
    kind: str,
    path: str,
    device: Any,
    batch: int,
    info: dict[str, Any],
) -> str | tuple[tuple[float, float, float], int | None]:
    """One round of ``path``: a fresh model, the probe step, -w warmup and -n timed steps.
    Returns the step time's (min, mean, max) over the ranks and the #wrong (None: not
    checked), or the reason every rank agrees it cannot run."""
    import torch

    def start() -> tuple[Workload, Any, Any]:
        w = build(kind, device, batch, o.image_size, s.rank)
        info["describe"] = w.describe
        info["unit"] = w.unit
        net = w.model if path == "local" else method.wrap(s, path, w, device)
        about = method.settings(path, net)
        if about is not None:
            info[about[0]] = about[1]
        opt = make_optimizer(net.parameters())
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
    wrong = method.wrong(s, o, path, w) if o.check and path not in method.unchecked else None
    del net, opt, w
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return stats, wrong


# -- the report -------------------------------------------------------------------------------
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
    rows: list[TrainRow],
    skips: list[tuple[str, str, str]],
    mode: str = "ddp",
    diverged: str = Method.diverged,
) -> str:
    lines = [
        f"# cudampi bench {mode}: ranks {meta.get('ranks')}; device {meta.get('device')}"
        + (f" [{meta.get('gpu_name')}]" if meta.get("gpu_name") else "")
        + _mps_word(meta)
        + _rounds_words(meta, info),
        f"# MPI: {meta.get('mpi_library', '?')}   torch {meta.get('torch')}",
    ]
    if info.get("ddp_options"):
        settings = ", ".join(f"{k}={v}" for k, v in info["ddp_options"].items())
        lines.append(f"# DistributedDataParallel({settings}) on every DDP path")
    models = info.get("models") or {info.get("model"): info}
    wp = max([19, *(len(r.path) for r in rows)])
    for kind, about in models.items():
        unit = about.get("unit", "samples/s")
        lines += [
            "#",
            f"# {about.get('describe', kind)}; batch {about.get('batch')} per rank",
            f"# {'path':<{wp}s} {'step (ms)':>10s} {'min':>9s} {'max':>9s} {unit:>14s} "
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
                f"  {r.path:<{wp}s} {r.step_ms:10.2f} {r.step_min_ms:9.2f} {r.step_max_ms:9.2f} "
                f"{r.samples_per_s:14.2f} {r.per_rank:10.2f} {vs:>9s} {wrong:>7s}"
            )
        lines += [f"# {note}" for note in about.get("notes", ())]
    lines.append("#")
    for kind, path, why in skips:
        lines.append(f"# {path} ({kind}): skipped: {why}")
    wrong_total = sum(r.wrong or 0 for r in rows)
    lines.append(
        f"# {'Out of bounds values':<20s} : {wrong_total} {'FAILED' if wrong_total else 'OK'}"
    )
    lines.append(
        f"# Verdict: {'OK' if not wrong_total else 'FAILED'}: {len(rows)} rows, {len(skips)} skipped"
        + (f"; {diverged} on {wrong_total} tensors" if wrong_total else "")
    )
    return "\n".join(lines) + "\n"


def main(session: Session, o: Any, meta: dict[str, Any], method: Method) -> int:
    """Run ``method`` on every path and model, write the table / JSON / CSV / plot; exit 1 on
    any #wrong."""
    import csv
    import io

    from cudampi.bench.output import emit

    rows, skips, info = run(session, o, method)
    wrong = sum(r.wrong or 0 for r in rows)
    data = {
        "kind": f"cudampi-bench-{method.mode}",
        "meta": {**meta, **info},
        "results": [r.to_json() for r in rows],
        "skipped": [{"model": m, "path": p, "reason": w} for m, p, w in skips],
        "verdict": {"ok": wrong == 0, "wrong": wrong},
    }
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=[f.name for f in dataclasses.fields(TrainRow)], lineterminator="\n"
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
            title=f"{method.mode} {', '.join(info.get('models') or [info.get('model')])}: "
            f"{meta.get('ranks')} ranks, {meta.get('device')}{_mps_word(meta)}",
            ylabel="samples/s (all ranks)" if several else f"{info.get('unit')} (all ranks)",
        )
    emit(
        session,
        o,
        render_text(meta, info, rows, skips, method.mode, method.diverged),
        json.dumps(data, indent=2) + "\n",
        buf.getvalue(),
    )
    return 0 if wrong == 0 else 1
