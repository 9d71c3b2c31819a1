"""``cudampi launch``: one command to run a program on N ranks with mpirun, mpiexec or srun.

    cudampi launch [-n N] [--hosts h1:4,h2:4 | --hostfile F] [--gpus-per-node G]
                   [options] (script.py | -m module | program) [args...] [-- raw launcher flags...]

The flags people type from habit work too: mpirun's ``-np``/``--np``, ``-H``/``--host``,
``-N``/``--npernode`` and ``--map-by ppr:N:node``, Hydra's ``-f`` and ``-ppn``, torchrun's
``--nproc-per-node``, ``--nnodes`` and ``--standalone``. Everything after the first ``--`` that
follows the command goes to the launcher unchanged; any other flag before the command is refused
with that hint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from cudampi.config import seconds_arg
from cudampi.errors import ConfigError
from cudampi.launch import workdir as workdirs
from cudampi.launch.hosts import Host, parse_hostfile, parse_hosts, read_hostfile
from cudampi.launch.plan import BINDS, GPU_BINDS, LaunchPlan, PlanRequest
from cudampi.launch.prepare import BOOTSTRAP, plan_launch, rank_command
from cudampi.mpiexec import add_job_flags

__all__ = ["BOOTSTRAP", "EXEC", "add_arguments", "prepare", "run", "split_target"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = (
        "cudampi launch [-n N] [--hosts H:S,... | --hostfile F] [--gpus-per-node G] [options] "
        "(script.py | -m module | program) [args...] [-- launcher flags...]"
    )
    parser.add_argument(
        "-n",
        "-np",
        "--np",
        "--nprocs",
        dest="nprocs",
        type=int,
        default=None,
        help="number of ranks (mpirun's -n/-np/--np)",
    )
    add_job_flags(parser)  # --hosts/-H, --hostfile/-f, --ssh, --launcher
    parser.add_argument(
        "--gpus-per-node",
        "--nproc-per-node",
        "--nproc_per_node",
        "-ppn",
        "-N",
        "--npernode",
        dest="gpus_per_node",
        type=int,
        default=None,
        help="ranks per node, one per GPU (torchrun's --nproc-per-node, Hydra's -ppn, "
        "mpirun's -N/--npernode)",
    )
    parser.add_argument(
        "--map-by",
        dest="gpus_per_node",
        type=_map_by,
        metavar="ppr:N:node",
        help="mpirun's spelling of N ranks per node (other mappings: pass them after --)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's single-node job: every rank on this machine (no hosts, no batch job's "
        "nodes)",
    )
    parser.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        help="nodes (torchrun's --nnodes): -n defaults to nodes x --nproc-per-node; the hosts "
        "(or the Slurm allocation) must have this many",
    )
    parser.add_argument(
        "--bind-to",
        dest="bind",
        default="gpu",
        choices=BINDS,
        help="gpu: each rank to its GPU's NUMA cores (default); none; or the launcher's core/numa/socket",
    )
    parser.add_argument(
        "--gpu-bind",
        default="local",
        choices=GPU_BINDS,
        help="local: all GPUs visible, device LOCAL_RANK %% GPUs (default); visible: "
        "CUDA_VISIBLE_DEVICES cut to the rank's GPU; none",
    )
    parser.add_argument(
        "--cuda-aware",
        default="auto",
        choices=("auto", "yes", "no"),
        help="preload the libucx wheel under --mca pml ucx (auto: when a GPU and libucx are here)",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        default=None,
        help="allow more ranks than slots (automatic on one host when -n exceeds its cores)",
    )
    parser.add_argument("--master-addr", default=None, help="MASTER_ADDR (default: rank 0's host)")
    parser.add_argument(
        "--master-port", type=_port, default=None, help="MASTER_PORT (default: a free port)"
    )
    parser.add_argument(
        "--ifname",
        default=None,
        help="network interface for NCCL/Gloo/MPI TCP (default: chosen per rank from the route "
        "to MASTER_ADDR; for MPI, the network reaching the remote hosts)",
    )
    parser.add_argument(
        "-x",
        dest="export",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="export a variable to every rank (repeatable); NAME alone forwards its value here",
    )
    parser.add_argument(
        "--tag-output",
        action="store_true",
        help="prefix every line of output with its rank (Open MPI --tag-output, Hydra -l, "
        "srun --label)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the exact command, run nothing"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="the plan (--dry-run: on stdout) or the result (after a run: on stderr, never mixed "
        "with the ranks' stdout) as JSON",
    )
    parser.add_argument(
        "--json-file", metavar="FILE", default=None, help="write that JSON to FILE instead"
    )
    parser.add_argument(
        "--grace",
        type=seconds_arg,
        default=10.0,
        help="seconds the launcher gets to end the job after a rank reports a failure",
    )
    parser.add_argument(
        "--timeout", type=seconds_arg, default=None, help="stop the job after this many seconds"
    )
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="MODULE",
        help="run a module as python -m does (the rest are its arguments)",
    )
    parser.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        help="script.py, or any program (python train.py, ./a.out, cudampi bench ...), and its "
        "arguments",
    )
    _refuse_unknown_flags(parser)


def _refuse_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """argparse hands a subcommand's unknown flags to the top-level parser, which then prints
    the top-level usage and nothing about them: refuse them here, saying where launcher flags
    go."""
    known = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        ns, extra = known(args, namespace)
        flags = [a for a in extra if a.startswith("-")]
        if flags:
            parser.error(
                f"{parser.prog} does not take {', '.join(map(repr, flags))}. A launcher's own "
                f"flags go after the command and --, unchanged: {parser.prog} -n 2 script.py "
                f"-- {' '.join(shlex.quote(f) for f in flags)} [their values]"
            )
        return ns, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _map_by(text: str) -> int:
    """mpirun's ``--map-by ppr:N:node`` (N ranks per node); other mappings are the launcher's."""
    m = re.fullmatch(r"ppr:([0-9]+):node", text.strip().lower())
    if m is None or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(
            f"--map-by {text!r}: cudampi launch takes ppr:N:node (N ranks per node, like "
            f"--gpus-per-node N); for Open MPI's other mappings pass them after the command and "
            f"--: cudampi launch -n 2 script.py -- --map-by {shlex.quote(text)}"
        )
    return int(m.group(1))


def _nnodes(text: str) -> int:
    if ":" in text:
        raise argparse.ArgumentTypeError(
            f"--nnodes {text!r}: elastic MIN:MAX node counts are torchrun's; cudampi launches a "
            "fixed job: give one number"
        )
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nnodes expects a number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--nnodes must be at least 1, got {text!r}")
    return value


EXEC = "--exec"
"""The rank bootstrap's marker for a program that is not Python run in-process."""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, got {text!r}")
    return port


def split_target(
    module: list[str] | None, target: list[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(rank command after the bootstrap, raw launcher flags) from the parsed remainder.

    A script (``train.py``) or ``-m module`` runs inside the bootstrap, so its exceptions are
    reported with their traceback; ``python script.py`` / ``python -m module`` with this very
    python is the same thing. Any other program (``./a.out``, ``cudampi bench``, another python)
    is executed by the bootstrap once the rank's environment and binding are set.
    """
    # argparse hands a "--" after -m's arguments (and what follows) to the positional.
    rest = [*module, *target] if module is not None else list(target)
    if module is not None and not module:
        raise ConfigError("-m needs a module name, e.g. -m cudampi.selftest")
    raw: list[str] = []
    if "--" in rest:
        i = rest.index("--")
        rest, raw = rest[:i], rest[i + 1 :]
    if not rest:
        raise ConfigError("nothing to run: give script.py, -m module or a program")
    if module is not None:
        return ("-m", *rest), tuple(raw)
    first, *args = rest
    if first.startswith("-"):
        raise ConfigError(
            f"unknown option {first!r} before the command (see cudampi launch --help)"
        )
    program = _program(first)
    if program is not None and _is_this_python(program) and args:
        if args[0] == "-m" and len(args) > 1:
            return ("-m", *args[1:]), tuple(raw)
        if not args[0].startswith("-"):
            first, *args = args  # python script.py ...: the script, run in-process
            program = None
    path = Path(first)
    if program is None or (path.suffix == ".py" and path.is_file()):
        if not path.is_file():
            raise ConfigError(
                f"{first!r} is neither a script nor a program here (cwd {os.getcwd()!r}): give "
                f"its path, or a program on PATH"
            )
        return (str(path.resolve()), *args), tuple(raw)
    return (EXEC, program, *args), tuple(raw)


def _program(name: str) -> str | None:
    """The executable ``name`` names (a path with a slash, else a PATH lookup), or None."""
    if os.sep in name:
        path = Path(name)
        if path.is_file() and os.access(path, os.X_OK):
            return os.path.abspath(path)  # not resolved: a venv's python is a link
        return None
    return shutil.which(name)


def _is_this_python(program: str) -> bool:
    """Is ``program`` this interpreter of this environment (same bin folder, a python name)?"""
    p, me = Path(program), Path(sys.executable)
    return p.name.startswith("python") and p.parent.resolve() == me.parent.resolve()


def _exports(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            raise ConfigError(f"-x {item!r}: expected NAME=VALUE or NAME")
        if not sep:
            if name not in os.environ:
                raise ConfigError(f"-x {name}: {name} is not set here; give -x {name}=VALUE")
            value = os.environ[name]
        out.append((name, value))
    return tuple(out)


def _ssh(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise ConfigError(f"--ssh {text!r}: {exc} (quote it as a shell would)") from None


def request(args: argparse.Namespace) -> PlanRequest:
    """The flags as one :class:`PlanRequest` (the hosts read, the command wrapped in the rank
    bootstrap)."""
    command, raw = split_target(args.module, args.target)
    hosts: tuple[Host, ...] = ()
    if args.hosts is not None:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile is not None:
        hosts = parse_hostfile(read_hostfile(args.hostfile))
    if args.standalone and (hosts or (args.nnodes or 1) > 1):
        raise ConfigError(
            "--standalone runs every rank on this machine: drop --hosts/--hostfile and --nnodes"
        )
    return PlanRequest(
        command=rank_command(command),
        nprocs=args.nprocs,
        hosts=hosts,
        gpus_per_node=args.gpus_per_node,
        nnodes=args.nnodes,
        tag_output=args.tag_output,
        bind=args.bind,
        gpu_bind=args.gpu_bind,
        cuda_aware=args.cuda_aware,
        oversubscribe=args.oversubscribe,
        master_addr=args.master_addr,
        master_port=args.master_port,
        ifname=args.ifname,
        rsh_agent=_ssh(args.ssh),
        extra=raw,
        env=_exports(args.export),
    )


def prepare(args: argparse.Namespace, workdir: str) -> LaunchPlan:
    """Detect the launcher and the machine, and decide the plan (runs nothing; a dry run looks
    up no host name)."""
    return plan_launch(
        request(args),
        workdir,
        launcher=args.launcher,
        resolve_hosts=not args.dry_run,
        use_job=not args.standalone,
    )


def _check_output(path: str | None) -> None:
    """``--json-file``'s folder takes a new file: checked before the job runs, so its result
    is not lost after it."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--json-file {path!r} is a folder; give a file name")
    try:
        fd, probe = tempfile.mkstemp(prefix=".cudampi-", dir=target.parent or ".")
    except OSError as exc:
        raise ConfigError(
            f"--json-file {path!r}: cannot write in {str(target.parent)!r} ({exc.strerror}); "
            "give a path in a folder you can write to"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _emit_json(data: object, args: argparse.Namespace, *, dry_run: bool) -> None:
    """JSON to --json-file (whole or not at all), else stdout for a dry run (nothing else is
    there), else stderr."""
    text = json.dumps(data, indent=2) + "\n"
    if args.json_file:
        target = Path(args.json_file)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".cudampi-", dir=target.parent or ".")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, target)
        except OSError as exc:
            raise ConfigError(f"--json-file {args.json_file!r}: {exc.strerror}") from None
    elif dry_run:
        sys.stdout.write(text)
    else:
        sys.stderr.write(text)


def run(args: argparse.Namespace) -> int:
    from cudampi.launch.runner import command_for, execute, write_hostfile

    want_json = args.json or args.json_file is not None
    _check_output(args.json_file)
    workdir = workdirs.new_workdir()
    keep = False
    try:
        plan = prepare(args, workdir)
        if args.dry_run:
            cmd = command_for(plan, workdir)
            write_hostfile(cmd)
            keep = cmd.hostfile_path is not None
            if want_json:
                _emit_json({"plan": plan.to_json(), "command": cmd.to_json()}, args, dry_run=True)
                if not args.json_file:
                    return 0
            for note in plan.notes:
                print(f"# {note}")
            if cmd.hostfile_path:
                print(f"# hostfile {cmd.hostfile_path}:")
                for line in (cmd.hostfile_text or "").splitlines():
                    print(f"#   {line}")
            print(cmd.shell())
            return 0
        result = execute(plan, workdir, grace=args.grace, timeout=args.timeout)
        if result.summary():
            print(result.summary(), file=sys.stderr)
        if want_json:
            _emit_json(result.to_json(), args, dry_run=False)
        return result.exit_code
    finally:
        workdirs.release(workdir, keep_it=keep)
