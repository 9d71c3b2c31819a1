"""``cudampi bench``: run under an MPI launcher (every rank runs it, rank 0 prints), or plainly:
it then re-launches itself through ``cudampi launch`` on ``--np N`` ranks, by default one per
local GPU where there are two or more, else 2 (the fewest that move data); ``--np 1`` runs in
this process alone."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from typing import Any

from cudampi.bench import options as opts
from cudampi.errors import BenchError, ConfigError, CudampiError

_PARSER_KEY = "_bench_parser"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    opts.add_arguments(parser)
    parser.set_defaults(**{_PARSER_KEY: parser})


# -- where are we? --------------------------------------------------------------------------------
def launched_size(env: dict[str, str] | os._Environ[str] | None = None) -> int | None:
    """World size announced by an MPI launcher in ``env``, or None when started plainly."""
    from cudampi.rankenv import mpi_launcher

    found = mpi_launcher(os.environ if env is None else env)
    return None if found is None else found[2]


def relaunch_argv(np: int, bench_argv: list[str], executable: str = sys.executable) -> list[str]:
    """The argv that runs ``cudampi bench <bench_argv>`` on ``np`` ranks: through
    ``cudampi launch``, which builds the launcher's argv (:mod:`cudampi.launch.plan`)."""
    launch = [executable, "-m", "cudampi", "launch", "-n", str(np)]
    return [*launch, "-m", "cudampi", "bench", *bench_argv]


def plain_ranks(device: str, gpus: int, visible: str | None) -> tuple[int, str]:
    """How many ranks a plain start runs on, and why (pure): one per GPU it may use where there
    are two or more (nccl-tests' habit), else 2, the fewest between which data moves."""
    from cudampi.launch.gpu import visible_list

    listed = visible_list(visible)
    usable = 0 if device == "cpu" else gpus if listed is None else min(gpus, len(listed))
    if usable >= 2:
        return usable, f"one per GPU ({usable} here)"
    shared = " (they share the GPU)" if usable == 1 else ""
    return 2, f"the fewest between which data moves{shared}"


def _relaunch(args: argparse.Namespace, o: opts.Options) -> int:
    parser = getattr(args, _PARSER_KEY)
    if o.np is not None:
        np, why = o.np, "--np"
    else:
        from cudampi.launch.detect import query_gpus

        np, why = plain_ranks(o.device, len(query_gpus()), os.environ.get("CUDA_VISIBLE_DEVICES"))
    argv = relaunch_argv(np, opts.to_argv(args, parser))
    if not o.quiet:
        print(
            f"# cudampi bench: started without a launcher: running on {np} ranks ({why}) "
            f"through cudampi launch; --np N chooses, --np 1 runs here alone: {' '.join(argv)}",
            file=sys.stderr,
            flush=True,
        )
    try:
        return subprocess.call(argv)
    except OSError as exc:
        raise BenchError(f"cannot start {argv[0]!r} to re-launch on {np} ranks: {exc}") from None


# -- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    o = opts.from_args(args)
    size = launched_size()
    if size is None and o.np != 1:
        return _relaunch(args, o)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if size is None and world.size == 1 and not o.quiet:
        from cudampi.bench.render import ONE_RANK

        print(f"# cudampi bench: started without a launcher: {ONE_RANK}", file=sys.stderr)
    if o.np is not None and o.np != world.size:
        raise ConfigError(
            f"--np {o.np} but this MPI job has {world.size} ranks; drop --np when you start "
            "`cudampi bench` under a launcher"
        )
    try:
        return _run_in_job(world, o, args)
    except Exception as exc:
        if world.size == 1:
            raise
        # one rank failing alone would leave the others waiting in a collective: end the job
        _abort(world, 2 if isinstance(exc, ConfigError) else 1, exc)
    return 1


def _abort(world: Any, code: int, exc: BaseException) -> None:
    from cudampi.abort import abort_job

    # cudampi's own errors are messages for the user; anything else is a bug: its traceback
    why = f"{exc}\n" if isinstance(exc, CudampiError) else traceback.format_exc()
    abort_job(code, f"--- cudampi bench: rank {world.rank} of {world.size} failed:\n{why}", world)


def _device(o: opts.Options) -> str:
    if o.device != "auto":
        return o.device
    from cudampi.bench.session import cuda_device_count

    return "cuda" if cuda_device_count() > 0 else "cpu"


def _meta(session: Any, o: opts.Options) -> dict[str, Any]:
    import platform

    from mpi4py import MPI

    from cudampi._version import __version__
    from cudampi.probe.gpu import mps_active

    meta: dict[str, Any] = {
        "mode": o.mode,
        "cudampi": __version__,
        "ranks": session.size,
        "nodes": session.nodes,
        "local_size": session.local_size,
        "device": session.device,
        "gpus": session.gpus,
        "gpu_name": session.gpu_name,
        "shares_gpu": session.shares_gpu,
        "host": platform.node(),
        "mpi_library": MPI.Get_library_version()
        .replace("\x00", "")
        .strip()
        .splitlines()[0]
        .strip(),
        "warmup": o.warmup,
        "iters": o.iters,
        "check": o.check,
        "in_place": o.in_place,
        "time_limit": o.time_limit,
        "argv": ["cudampi", "bench", *sys.argv[2:]] if len(sys.argv) > 1 else [],
        "mps": mps_active(),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:
        meta["torch"] = None
    return meta


def _run_in_job(world: Any, o: opts.Options, args: argparse.Namespace) -> int:
    from cudampi.bench.session import open_session

    device = _device(o)
    if o.root >= world.size:
        raise ConfigError(f"--root {o.root} but the job has only {world.size} ranks")
    session = open_session(world, device)
    try:
        if o.mode == "p2p":
            from cudampi.bench import p2p

            return p2p.main(session, o, _meta(session, o))
        if o.mode == "ddp":
            from cudampi.bench import ddp

            return ddp.main(session, o, _meta(session, o))
        if o.mode == "fsdp":
            from cudampi.bench import fsdp

            return fsdp.main(session, o, _meta(session, o))
        return _collectives(session, o)
    finally:
        session.close()


def _collectives(session: Any, o: opts.Options) -> int:
    import dataclasses

    from cudampi.bench import render
    from cudampi.bench.output import emit
    from cudampi.bench.runner import Spec, run_collectives

    spec = Spec(
        ops=o.ops,
        paths=o.paths,
        dtypes=o.dtypes,
        redops=o.redops,
        root=o.root,
        sizes=o.sizes,
        warmup=o.warmup,
        iters=o.iters,
        check=o.check,
        time_limit=o.time_limit,
        array=o.array,
        corrupt_rank=o.corrupt_rank,
        in_place=o.in_place,
        progress=not o.quiet,
        meta=_meta(session, o),
    )
    result = run_collectives(session, spec)
    result = dataclasses.replace(result, min_busbw=o.min_busbw)
    emit(
        session,
        o,
        render.render_text(result),
        render.render_json(result),
        render.render_csv(result),
    )
    if o.plot and session.rank == 0:
        from cudampi.bench import plot

        plot.plot_collectives(result, o.plot)
    return 0 if result.ok else 1
