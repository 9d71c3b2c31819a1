"""``cudampi bench`` flags -> one frozen :class:`Options` (pure), and back to argv.

Flags follow nccl-tests where they exist (``-b -e -f -i -w -n -o -r`` and ``-d`` for the
dtype), so ``-n`` is the iteration count; the rank count of a self-relaunch is ``--np``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cudampi.bench.adapters import BENCH_PATHS, DDP_PATHS, FSDP_PATHS, FSDP_PEERS, TORCH_PATHS
from cudampi.bench.dtypes import parse_dtype
from cudampi.bench.registry import COLLECTIVES
from cudampi.bench.sizes import parse_bytes, size_sweep
from cudampi.errors import ConfigError
from cudampi.names import REDUCE_OPS

MODES = ("p2p", "ddp", "fsdp")
TRAINING = ("ddp", "fsdp")
"""The modes that train a model (no sizes; --model, --batch, --rounds, --ddp-option)."""
MODELS = ("auto", "all", "resnet50", "transformer")
"""``--model`` of ``bench ddp``/``fsdp``: each a model, or ``all``/``auto`` (see
bench.train.pick_models)."""
WHAT = (*COLLECTIVES, "all", *MODES)

DEFAULTS = {
    # mode: (minbytes, maxbytes, warmup, iters)
    "collectives": ("8", "64M", 5, 20),
    "p2p": ("1", "4M", 10, 100),
    "ddp": ("0", "0", 3, 10),
    "fsdp": ("0", "0", 3, 10),
}


@dataclass(frozen=True)
class Options:
    """Everything ``cudampi bench`` was asked to do, validated."""

    mode: str
    """collectives, p2p, ddp or fsdp."""
    ops: tuple[str, ...]
    paths: tuple[str, ...]
    sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    redops: tuple[str, ...]
    root: int
    warmup: int
    iters: int
    check: bool
    time_limit: float
    device: str
    """cpu, cuda or auto (cuda when a GPU is visible)."""
    array: str
    min_busbw: float | None
    json: str | None
    """None: no JSON; '-': JSON on stdout instead of the table; else a file."""
    csv: str | None
    plot: str | None
    np: int | None
    quiet: bool
    corrupt_rank: int | None
    window: int
    buffers: tuple[str, ...]
    model: str
    batch: int | None
    image_size: int | None
    rounds: int
    """ddp/fsdp: passes over every path, interleaved; a row is the median of its rounds."""
    ddp_options: tuple[tuple[str, Any], ...] = ()
    """ddp/fsdp: DistributedDataParallel keyword arguments given to every DDP path (--ddp-option)."""
    in_place: bool = False
    """cudampi's paths reduce in place (allreduce, reduce), as the torch paths always do."""


DDP_OPTIONS: dict[str, type] = {
    "bucket_cap_mb": float,
    "gradient_as_bucket_view": bool,
    "static_graph": bool,
    "broadcast_buffers": bool,
    "find_unused_parameters": bool,
}
"""The DistributedDataParallel settings ``bench ddp --ddp-option`` varies, with their types."""


def parse_ddp_options(items: list[str] | None) -> tuple[tuple[str, Any], ...]:
    """``NAME=VALUE`` items of --ddp-option into (name, typed value) pairs, the last one of a
    name winning."""
    out: dict[str, Any] = {}
    for item in items or ():
        name, eq, text = item.partition("=")
        name, text = name.strip(), text.strip()
        kind = DDP_OPTIONS.get(name)
        if not eq or kind is None:
            raise ConfigError(
                f"--ddp-option {item!r}: expected NAME=VALUE with NAME one of {', '.join(DDP_OPTIONS)}"
            )
        if kind is bool:
            word = text.lower()
            if word not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"--ddp-option {item!r}: {name} takes true or false")
            out[name] = word in ("true", "1", "yes")
            continue
        try:
            value = kind(text)
        except ValueError:
            raise ConfigError(f"--ddp-option {item!r}: {name} takes a number") from None
        if value <= 0:
            raise ConfigError(f"--ddp-option {item!r}: {name} must be > 0")
        out[name] = value
    return tuple(out.items())


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_paths(text: str, mode: str) -> tuple[str, ...]:
    """``all`` or a comma list of :data:`BENCH_PATHS` (for ddp: the torch paths; for p2p: cudampi,
    ipc, mpi and the torch paths; for fsdp: local, each FSDP2 path and its DDP peer)."""
    if mode == "ddp":
        known: tuple[str, ...] = (*DDP_PATHS, "local")
    elif mode == "fsdp":
        known = ("local", *(q for pair in zip(FSDP_PATHS, FSDP_PEERS) for q in pair))
    elif mode == "p2p":
        known = ("cudampi", "ipc", "mpi", *TORCH_PATHS)
    else:
        known = BENCH_PATHS
    if text.strip() == "all":
        return known
    out = []
    for p in _split(text):
        if p not in known:
            raise ConfigError(
                f"--paths {p!r} is not a {mode} path; choose from {', '.join(known)} or all"
            )
        if p not in out:
            out.append(p)
    if not out:
        raise ConfigError(f"--paths {text!r} names no path; choose from {', '.join(known)} or all")
    return tuple(out)


def check_writable(flag: str, path: str) -> None:
    """Refuse an output file that cannot be written before anything runs (the whole benchmark
    would run first, then fail on rank 0 alone)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag} {path!r} is a folder; give a file name")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path!r}: the folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{flag} {path!r} cannot be written (permission denied); give another")


def from_args(args: argparse.Namespace) -> Options:
    """Validate the parsed flags (every error is a ConfigError naming the flag and the value)."""
    mode, ops = _what(args)
    _, _, dwarm, diters = DEFAULTS[mode]
    sizes = _sizes(args, mode)
    dtypes = tuple(dict.fromkeys(parse_dtype(d) for d in _split(args.dtype)))
    redops = tuple(dict.fromkeys(_split(args.op)))
    for r in redops:
        if r not in REDUCE_OPS:
            raise ConfigError(f"--op {r!r}: expected one of {', '.join(REDUCE_OPS)}")
    if args.root < 0:
        raise ConfigError(f"--root {args.root!r} cannot be negative")
    warmup = dwarm if args.warmup is None else int(args.warmup)
    iters = diters if args.iters is None else int(args.iters)
    if warmup < 0 or iters < 1:
        raise ConfigError(f"-w {warmup!r} must be >= 0 and -n {iters!r} >= 1")
    if args.np is not None and args.np < 1:
        raise ConfigError(f"--np {args.np!r}: a job needs at least one rank")
    if args.json == "-" and args.csv == "-":
        raise ConfigError("--json and --csv cannot both go to stdout; give one of them a file")
    buffers, models = _p2p_and_ddp(args)
    if args.in_place and mode != "collectives":
        raise ConfigError(f"--in-place is for the collectives (allreduce, reduce), not {mode}")
    if args.ddp_option and mode not in TRAINING:
        raise ConfigError(
            f"--ddp-option sets DistributedDataParallel: `cudampi bench ddp` or `fsdp` only, not {mode}"
        )
    if args.min_busbw is not None and args.min_busbw < 0:
        raise ConfigError(f"--min-busbw {args.min_busbw!r} cannot be negative")
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path and path != "-":
            check_writable(flag, path)
    return Options(
        mode=mode,
        ops=tuple(ops),
        paths=parse_paths(args.paths, mode),
        sizes=sizes,
        dtypes=dtypes,
        redops=redops,
        root=int(args.root),
        warmup=warmup,
        iters=iters,
        check=bool(args.check),
        time_limit=float(args.time_limit),
        device=args.device,
        array=args.array,
        min_busbw=args.min_busbw,
        json=args.json,
        csv=args.csv,
        plot=args.plot,
        np=args.np,
        quiet=bool(args.quiet),
        corrupt_rank=args.corrupt_rank,
        window=int(args.window),
        buffers=buffers,
        model=",".join(models),
        batch=args.batch,
        image_size=args.image_size,
        rounds=int(args.rounds),
        ddp_options=parse_ddp_options(args.ddp_option),
        in_place=bool(args.in_place),
    )


def _what(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The mode (collectives, p2p or ddp) and the collectives the positional words name."""
    what = list(args.what or ["all"])
    for w in what:
        if w not in WHAT:
            raise ConfigError(f"unknown benchmark {w!r}; choose from {', '.join(WHAT)}")
    modes = [w for w in what if w in MODES]
    if modes and len(what) > 1:
        raise ConfigError(
            f"{modes[0]!r} runs on its own: `cudampi bench {modes[0]}`, not together with "
            f"{', '.join(w for w in what if w != modes[0])}"
        )
    ops: list[str] = []
    for w in what:
        for op in COLLECTIVES if w == "all" else (w,):
            if op not in ops and op not in MODES:
                ops.append(op)
    return (modes[0] if modes else "collectives"), ops


def _sizes(args: argparse.Namespace, mode: str) -> tuple[int, ...]:
    """The sweep of -b/-e/-f/-i (none for ddp)."""
    dmin, dmax, _, _ = DEFAULTS[mode]
    minb = parse_bytes(args.minbytes or dmin, "-b/--minbytes")
    maxb = parse_bytes(args.maxbytes or dmax, "-e/--maxbytes")
    if args.maxbytes is None and minb > maxb:
        maxb = minb  # `-b 1G` alone: one size
    step = parse_bytes(args.stepbytes, "-i/--stepbytes") if args.stepbytes else 0
    # -i alone adds; -f (default 2) multiplies, and wins when both are given
    factor = float(args.stepfactor) if args.stepfactor is not None else (1.0 if step else 2.0)
    return tuple(size_sweep(minb, maxb, factor, step)) if mode not in TRAINING else ()


def _p2p_and_ddp(args: argparse.Namespace) -> tuple[tuple[str, ...], list[str]]:
    """p2p's --buffers and --window, ddp's --model and --rounds."""
    buffers = tuple(_split(args.buffers))
    for b in buffers:
        if b not in ("host", "device"):
            raise ConfigError(f"--buffers {b!r}: expected host and/or device")
    if args.window < 1:
        raise ConfigError(f"--window {args.window!r} must be >= 1")
    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds!r} must be >= 1 (1: one pass over the paths)")
    models = _split(args.model)
    for m in models:
        if m not in MODELS:
            raise ConfigError(f"--model {m!r}: expected a comma list of {', '.join(MODELS)}")
    if not models:
        raise ConfigError(f"--model {args.model!r} names no model; choose from {', '.join(MODELS)}")
    return buffers, models


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``cudampi bench`` (see docs/benchmarks.md)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "Run it under a launcher (`cudampi launch -n 2 -m cudampi bench allreduce`, or "
        "mpiexec -n 2 cudampi bench ...): every rank runs it and rank 0 prints. Started plainly, "
        "it re-launches itself through cudampi launch on one rank per local GPU (2 where there "
        "are fewer GPUs), or on --np N. Exit 1 on any wrong result or a missed --min-busbw."
    )
    parser.add_argument(
        "what",
        nargs="*",
        metavar="WHAT",
        help=f"collectives ({', '.join(COLLECTIVES)}; all: every one), or p2p, or ddp, or fsdp "
        "(default: all)",
    )
    g = parser.add_argument_group("sizes and iterations (as nccl-tests)")
    g.add_argument("-b", "--minbytes", default=None, help="smallest size (default 8; p2p 1)")
    g.add_argument("-e", "--maxbytes", default=None, help="largest size (default 64M; p2p 4M)")
    g.add_argument("-f", "--stepfactor", type=float, default=None, help="size multiplier (2)")
    g.add_argument("-i", "--stepbytes", default=None, help="size increment, instead of -f")
    g.add_argument("-w", "--warmup", type=int, default=None, help="warmup calls per size (5)")
    g.add_argument("-n", "--iters", type=int, default=None, help="timed calls per size (20)")
    g.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        metavar="S",
        help="cap each size at about S seconds of timed calls (fewer iterations; 0: off)",
    )
    g = parser.add_argument_group("what to move")
    g.add_argument("-d", "--dtype", default="float32", help="comma list: float32,bfloat16,...")
    g.add_argument(
        "-o", "--op", default="sum", help="comma list of reductions: sum,prod,min,max,avg,..."
    )
    g.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce (0)")
    g.add_argument(
        "--paths",
        default="all",
        help=f"comma list or all: {', '.join(BENCH_PATHS)} (p2p: cudampi,ipc,mpi,torch-*; ddp: local,ddp-nocomm,torch-*; fsdp: local,torch-*,ddp-torch-*)",
    )
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="buffers on (auto: cuda if visible)",
    )
    g.add_argument(
        "--array", choices=("auto", "numpy", "torch", "cupy"), default="auto", help="array library"
    )
    g.add_argument(
        "--in-place",
        action="store_true",
        help="cudampi's paths reduce in place (allreduce, reduce: nccl-tests' in-place column; "
        "the torch paths always do); default out of place",
    )
    g.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every result (default on)",
    )
    g = parser.add_argument_group("verdict and output")
    g.add_argument(
        "--min-busbw", type=float, default=None, metavar="GBPS", help="exit 1 if a path peaks below"
    )
    g.add_argument(
        "--json", nargs="?", const="-", default=None, metavar="FILE", help="JSON (stdout, or FILE)"
    )
    g.add_argument(
        "--csv", nargs="?", const="-", default=None, metavar="FILE", help="CSV (stdout, or FILE)"
    )
    g.add_argument("--plot", default=None, metavar="PNG", help="busbw vs size, a line per path")
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    g.add_argument(
        "--np",
        type=int,
        default=None,
        metavar="N",
        help="started plainly: the ranks to re-launch on (default: one per GPU, at least 2; "
        "1: this process alone)",
    )
    g.add_argument("--corrupt-rank", type=int, default=None, help=argparse.SUPPRESS)
    g = parser.add_argument_group("p2p, ddp and fsdp")
    g.add_argument(
        "--window", type=int, default=64, help="p2p: messages in flight for bw/bibw (64)"
    )
    g.add_argument("--buffers", default="host,device", help="p2p: host,device")
    g.add_argument(
        "--model",
        default="auto",
        help="ddp/fsdp: comma list of resnet50, transformer, or all; auto = the transformer, and "
        "for ddp on cuda ResNet-50 before it (where torchvision is importable)",
    )
    g.add_argument("--batch", type=int, default=None, help="ddp/fsdp: samples per rank per step")
    g.add_argument("--image-size", type=int, default=None, help="ddp/fsdp: ResNet input side (224)")
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="ddp/fsdp: train every path R times, interleaved (local, A, B, local, A, B, ...); a row "
        "is the median of its rounds (1)",
    )
    g.add_argument(
        "--ddp-option",
        action="append",
        default=None,
        metavar="NAME=VALUE",
        help="ddp/fsdp: a DistributedDataParallel setting for every DDP path, repeatable: "
        + ", ".join(DDP_OPTIONS)
        + " (e.g. gradient_as_bucket_view=true; default: DDP's own)",
    )


def to_argv(
    args: argparse.Namespace, parser: argparse.ArgumentParser, *, drop: tuple[str, ...] = ("np",)
) -> list[str]:
    """Rebuild the flags of ``args`` (minus ``drop``) for a re-launch; defaults are left out."""
    out: list[str] = []
    positional: list[str] = []
    for action in parser._actions:
        if action.dest in ("help", *drop) or action.dest == argparse.SUPPRESS:
            continue
        value = getattr(args, action.dest, None)
        if not action.option_strings:
            if action.dest == "what" and value:
                positional = list(value)
            continue
        if value == action.default:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            if value:
                out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value or ():
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return [*positional, *out]
