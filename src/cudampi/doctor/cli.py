"""``cudampi doctor``: exit 0 when nothing failed (warnings allowed), 1 on a failed check, 2 on
a usage error."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cudampi.config import PROBE_TIMEOUT, Config, parse_size, seconds_arg
from cudampi.errors import ConfigError
from cudampi.mpiexec import add_job_flags
from cudampi.probe.runtime import PROBE_BYTES, PROBE_RANKS


def _kv(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected VAR=VALUE, got {text!r}")
    return key, value


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"--size must be at least 4 bytes, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--save-json",
        metavar="FILE",
        default=None,
        help="also write the JSON report to FILE (text and JSON from one run)",
    )
    parser.add_argument(
        "--no-runtime",
        action="store_true",
        help="skip the runtime probe (no mpiexec jobs; build and environment checks only)",
    )
    parser.add_argument(
        "--mpiexec",
        metavar="PATH",
        help="launcher for the probe ranks (default: the mpiexec of the MPI that mpi4py loads)",
    )
    parser.add_argument(
        "--preload-ucx",
        nargs="?",
        const="auto",
        default=None,
        metavar="LIBUCX_DIR",
        help="test the PyPI UCX recipe: preload libucx-cu12/13's libucs/libucm/libuct/libucp, "
        "set UCX_MODULE_DIR and add --mca pml ucx (default: the importable libucx package)",
    )
    parser.add_argument(
        "--mca",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="an Open MPI MCA setting for the probe ranks (repeatable)",
    )
    parser.add_argument(
        "-x",
        dest="exports",
        type=_kv,
        action="append",
        default=[],
        metavar="VAR=VALUE",
        help="an environment variable for the probe ranks (repeatable)",
    )
    parser.add_argument(
        "--size",
        type=_size,
        default=PROBE_BYTES,
        metavar="BYTES",
        help=f"message size of the runtime probes, e.g. 256M (default {PROBE_BYTES >> 20}M)",
    )
    parser.add_argument(
        "--ranks", type=int, default=PROBE_RANKS, help=f"probe ranks (default {PROBE_RANKS})"
    )
    parser.add_argument(
        "--timeout",
        type=seconds_arg,
        default=None,
        metavar="SECONDS",
        help="seconds each probe job may run before it is reported hung (default: "
        f"CUDAMPI_PROBE_TIMEOUT or {PROBE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where to save the probed capabilities (default: CUDAMPI_CACHE_DIR or ~/.cache/cudampi)",
    )
    add_job_arguments(parser)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the doctor for a whole job (``--hosts``/``--hostfile``; inside an
    allocation the doctor takes its nodes without them)."""
    from cudampi.doctor.links import LINK_BYTES, NODE_TIMEOUT

    job = parser.add_argument_group(
        "a whole job",
        "every node's doctor side by side, then every link between them, one rank per node "
        "through cudampi launch (inside a Slurm/PBS/LSF allocation: its nodes, with no flag)",
    )
    add_job_flags(job)  # the nodes as cudampi launch takes them, --ssh and --launcher
    job.add_argument("--no-links", action="store_true", help="the nodes' facts only: no link test")
    job.add_argument(
        "--link-size",
        type=_size,
        default=LINK_BYTES,
        metavar="BYTES",
        help=f"message size of the link test (default {LINK_BYTES >> 20}M)",
    )
    job.add_argument(
        "--node-timeout",
        type=seconds_arg,
        default=NODE_TIMEOUT,
        metavar="SECONDS",
        help="seconds a node has to answer, and a pair of nodes to finish its link test "
        f"(default {NODE_TIMEOUT:g})",
    )


def _facts_data(facts: Any) -> dict[str, Any]:
    from cudampi.doctor.checks import no_gpu

    runtime = facts.runtime
    probes: dict[str, Any] = {}
    if runtime is not None:
        for test, run in runtime.runs.items():
            probes[test] = {
                "status": run.outcome.status,
                "detail": run.outcome.detail,
                "gbps": run.outcome.gbps,
                "returncode": run.returncode,
                "wall_s": round(run.wall_s, 3),
                "argv": list(run.argv),
                "failure": run.failure,
                "report": run.report,
            }
        for test, why in runtime.skipped.items():
            probes[test] = {"status": "skipped", "detail": why}
    return {
        "python": {
            "version": facts.python_version,
            "executable": facts.python,
            "platform": facts.platform,
        },
        "mpi_library": facts.library,
        "installations": facts.installations,
        "path_launcher": dict(zip(("path", "vendor", "version"), facts.path_launcher)),
        "probe_mpiexec": facts.probe_mpiexec,
        "ompi_info": facts.ompi,
        "mpichversion": facts.mpich,
        "ucx": facts.ucx,
        "preload_ucx": facts.ucx_package,
        "ranks_env": facts.ranks_env,
        "gpu_system": facts.gpu_system,
        "python_gpu": facts.python_gpu,
        "launcher": facts.launcher.launcher,
        "interfaces": facts.launcher.interfaces,
        "runtime": {
            "note": facts.runtime_note,
            "size": facts.options.nbytes,
            "ranks": facts.options.ranks,
            "probes": probes,
        },
        "capabilities": facts.capabilities.to_json() if facts.capabilities else None,
        "cache": {"path": facts.cache_path, "keys": list(facts.cache_keys)},
        "recipe": _recipe_data(facts),
        "no_gpu": no_gpu(facts),
    }


def _recipe_data(facts: Any) -> dict[str, Any] | None:
    if facts.recipe is None:
        return None
    return {
        "package": facts.recipe_package,
        "probes": {
            test: {
                "status": run.outcome.status,
                "detail": run.outcome.detail,
                "gbps": run.outcome.gbps,
            }
            for test, run in facts.recipe.runs.items()
        },
    }


def _progress_printer() -> Any:
    """One line per probe on stderr while the doctor works, when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None
    import time

    start = time.monotonic()

    def show(text: str) -> None:
        sys.stderr.write(f"  doctor [{time.monotonic() - start:4.1f} s] probing {text} ...\n")
        sys.stderr.flush()

    return show


def run(args: argparse.Namespace) -> int:
    from cudampi.doctor.checks import all_checks
    from cudampi.doctor.gather import gather
    from cudampi.doctor.render import render_json, render_text
    from cudampi.doctor.report import Report

    if args.ranks < 2:
        raise ConfigError(f"--ranks must be at least 2 (p2p needs a peer), got {args.ranks!r}")
    from cudampi.names import MPI_LAUNCHERS
    from cudampi.rankenv import job_env, launched_by

    launcher = launched_by(os.environ)
    given = bool(args.hosts or args.hostfile)
    mpi = launched_by(os.environ, MPI_LAUNCHERS)
    if not given and mpi.rank is not None and 0 < (mpi.local_size or 0) < (mpi.size or 0):
        # A rank of an MPI job over several nodes: rank 0 diagnoses every node of the job.
        from cudampi.doctor.job import hosts_of_this_job

        hosts = hosts_of_this_job(mpi.size or 0, mpi.rank, args.node_timeout)
        if hosts is None:
            return 0
        args.hosts, given = ",".join(hosts), True
    elif launcher.rank not in (None, 0):
        # Started on several ranks of one node (mpirun -n N cudampi doctor): rank 0 diagnoses
        # and prints; the others would only repeat it and start N copies of the probe jobs.
        return 0
    config = Config.load({"probe_timeout": args.timeout, "cache_dir": args.cache_dir})
    options = _options(args, config)
    if given or (launcher.rank is None and job_env(os.environ) is not None):
        code = _run_job(args, options)
        if code is not None:
            return code
    facts = gather(options, progress=_progress_printer())
    report = Report.of(all_checks(facts), _facts_data(facts))
    as_json = render_json(report)
    return _emit(as_json if args.json else render_text(report), as_json, args, report.exit_code)


def _options(args: argparse.Namespace, config: Config) -> Any:
    from cudampi.doctor.gather import DoctorOptions

    return DoctorOptions(
        mpiexec=args.mpiexec,
        preload_ucx=args.preload_ucx,
        mca=tuple((k, v) for k, v in args.mca),
        exports=tuple(args.exports),
        runtime=not args.no_runtime,
        nbytes=args.size,
        ranks=args.ranks,
        timeout=config.probe_timeout,
        cache_dir=config.cache_dir,
    )


def _run_job(args: argparse.Namespace, options: Any) -> int | None:
    """The doctor for a whole job; None inside an allocation of one node (the single-node
    doctor then runs as usual)."""
    from cudampi.doctor.job import JobDoctor, JobOptions, end_progress, progress_line
    from cudampi.doctor.job_render import job_json, render_job_json, render_job_text

    job = JobOptions(
        node=options,
        hosts=args.hosts,
        hostfile=args.hostfile,
        ssh=args.ssh,
        launcher=args.launcher,
        links=not args.no_links,
        link_bytes=args.link_size,
        node_timeout=args.node_timeout,
    )
    doctor = JobDoctor(job, progress_line())
    if not (args.hosts or args.hostfile):
        _, launcher = doctor.plan()
        if (launcher.get("nprocs") or 1) <= 1:
            return None
    result = doctor.run()
    end_progress()
    as_json = render_job_json(result)
    text = as_json if args.json else render_job_text(result)
    return _emit(text, as_json, args, int(job_json(result)["exit_code"]))


def _emit(text: str, as_json: str, args: argparse.Namespace, exit_code: int) -> int:
    """Print the report, save its JSON where --save-json says (whole or not at all); a file or
    standard output that cannot be written is said on stderr and makes the exit 1 (the report
    is still printed where it can be)."""
    from cudampi.atomic import why, write_stdout, write_text

    failed = []
    if args.save_json:
        try:
            write_text(args.save_json, as_json)
        except OSError as exc:
            failed.append(f"--save-json {args.save_json!r} was not written: {why(exc)}")
    problem = write_stdout(text)
    if problem:
        failed.append(f"the report could not be written to standard output: {problem}")
    for line in failed:
        sys.stderr.write(f"cudampi doctor: {line}\n")
    return max(exit_code, 1) if failed else exit_code
