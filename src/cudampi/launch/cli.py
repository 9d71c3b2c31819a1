"""``cudampi launch``: one command to run a script on N ranks with mpirun, mpiexec or srun.

    cudampi launch [-n N] [--hosts h1:4,h2:4 | --hostfile F] [--gpus-per-node G]
                   [options] (script.py | -m module) [args...] [-- raw launcher flags...]

Everything after the first ``--`` that follows the script goes to the launcher unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch import detect, net
from cudampi.launch.plan import (
    BINDS,
    GPU_BINDS,
    Host,
    LaunchPlan,
    Machine,
    PlanRequest,
    expand_nodelist,
    make_plan,
    parse_hostfile,
    parse_hosts,
)

BOOTSTRAP = ("-m", "cudampi.launch.rank")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = (
        "cudampi launch [-n N] [--hosts H:S,... | --hostfile F] [--gpus-per-node G] [options] "
        "(script.py | -m module) [args...] [-- launcher flags...]"
    )
    parser.add_argument("-n", "--nprocs", type=int, default=None, help="number of ranks")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", default=None, help="hosts and slots, e.g. h1:4,h2:4")
    where.add_argument("--hostfile", default=None, help="hostfile (host slots=N or host:N lines)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="ranks (GPUs) per node")
    parser.add_argument(
        "--launcher",
        default="auto",
        help="auto, mpirun, mpiexec, srun or a path (auto: srun in a Slurm allocation, else the "
        "mpiexec beside this python, else PATH)",
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
        "--master-port", type=int, default=None, help="MASTER_PORT (default: a free port)"
    )
    parser.add_argument(
        "--ifname",
        default=None,
        help="network interface for NCCL/Gloo/MPI TCP (default: chosen per rank from the route "
        "to MASTER_ADDR; for MPI, the network reaching the remote hosts)",
    )
    parser.add_argument(
        "--ssh",
        default=None,
        help='remote shell command with options, e.g. "ssh -i key -o StrictHostKeyChecking=no"',
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
        "--dry-run", action="store_true", help="print the exact command, run nothing"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the plan (--dry-run) or the result as JSON"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds the launcher gets to end the job after a rank reports a failure",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop the job after this many seconds"
    )
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="MODULE",
        help="run a module as python -m does (the rest are its arguments)",
    )
    parser.add_argument("target", nargs=argparse.REMAINDER, help="script.py and its arguments")


def split_target(
    module: list[str] | None, target: list[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(rank command after the bootstrap, raw launcher flags) from the parsed remainder."""
    # argparse hands a "--" after -m's arguments (and what follows) to the positional.
    rest = [*module, *target] if module is not None else list(target)
    if module is not None and not module:
        raise ConfigError("-m needs a module name, e.g. -m cudampi.selftest")
    raw: list[str] = []
    if "--" in rest:
        i = rest.index("--")
        rest, raw = rest[:i], rest[i + 1 :]
    if not rest:
        raise ConfigError("nothing to run: give script.py or -m module")
    if module is not None:
        return ("-m", *rest), tuple(raw)
    script, *args = rest
    if script.startswith("-"):
        raise ConfigError(
            f"unknown option {script!r} before the script (see cudampi launch --help)"
        )
    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"script {script!r} does not exist (cwd {os.getcwd()!r}); give its path")
    return (str(path.resolve()), *args), tuple(raw)


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _check_resolves(hosts: tuple[Host, ...]) -> None:
    for h in hosts:
        try:
            socket.getaddrinfo(h.name, None)
        except (socket.gaierror, UnicodeError) as exc:
            raise LaunchError(
                f"host {h.name!r} cannot be reached: its name does not resolve ({exc}). Fix the "
                f"name in --hosts/--hostfile or add it to /etc/hosts or DNS"
            ) from None


def prepare(args: argparse.Namespace, workdir: str) -> LaunchPlan:
    """Detect the launcher and the machine, and decide the plan (runs nothing)."""
    command, raw = split_target(args.module, args.target)
    hosts: tuple[Host, ...] = ()
    if args.hosts:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile:
        try:
            hosts = parse_hostfile(Path(args.hostfile).read_text())
        except OSError as exc:
            raise ConfigError(f"--hostfile {args.hostfile!r}: {exc.strerror}") from None
    launcher = detect.find_launcher(args.launcher)
    beside = detect.mpi_flavour()
    mpi = beside[0] if beside else launcher.flavour
    if launcher.flavour != "slurm" and mpi != launcher.flavour:
        raise LaunchError(
            f"{launcher.path!r} is {launcher.name} {launcher.version} but this python's MPI "
            f"(beside {sys.executable!r}) is {beside[1] if beside else '?'}: ranks would not "
            f"join one job. Use --launcher with the matching mpiexec"
        )
    ifaces = net.interfaces()
    names = net.local_names(ifaces)
    local = names | {h.name for h in hosts if net.is_local(h.name, names)}
    remote = [h for h in hosts if h.name not in local]
    subnet = ifname = None
    if remote:
        _check_resolves(tuple(remote))
        iface = net.route_interface(remote[0].name, ifaces)
        if iface is not None and not iface.loopback:
            subnet, ifname = iface.network, iface.name
    slurm_nodes: tuple[str, ...] = ()
    slurm_ntasks = None
    if launcher.flavour == "slurm":
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
        slurm_nodes = tuple(expand_nodelist(nodelist))
        ntasks = os.environ.get("SLURM_NTASKS", "")
        slurm_ntasks = int(ntasks) if ntasks.isdigit() else None
    machine = Machine(
        cores=detect.query_physical_cores(),
        gpus=len(detect.query_gpus()),
        is_root=os.geteuid() == 0,
        ucx=detect.find_ucx_recipe(),
        local_names=local,
        subnet=subnet,
        ifname=ifname,
        slurm_nodes=slurm_nodes,
        slurm_ntasks=slurm_ntasks,
        report_dir=os.path.join(workdir, "reports"),
        env_names=frozenset(os.environ),
    )
    req = PlanRequest(
        command=(sys.executable, *BOOTSTRAP, *command),
        nprocs=args.nprocs,
        hosts=hosts,
        gpus_per_node=args.gpus_per_node,
        bind=args.bind,
        gpu_bind=args.gpu_bind,
        cuda_aware=args.cuda_aware,
        oversubscribe=args.oversubscribe,
        master_addr=args.master_addr,
        master_port=args.master_port if args.master_port is not None else _free_port(),
        ifname=args.ifname,
        rsh_agent=tuple(shlex.split(args.ssh)) if args.ssh else (),
        extra=raw,
        env=_exports(args.export),
    )
    return make_plan(req, launcher, machine, mpi)


def run(args: argparse.Namespace) -> int:
    from cudampi.launch.runner import command_for, execute, write_hostfile

    workdir = tempfile.mkdtemp(prefix="cudampi-launch-")
    keep = False
    try:
        plan = prepare(args, workdir)
        if args.dry_run:
            cmd = command_for(plan, workdir)
            write_hostfile(cmd)
            keep = cmd.hostfile_path is not None
            if args.json:
                print(json.dumps({"plan": plan.to_json(), "command": cmd.to_json()}, indent=2))
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
        if not result.ok:
            print(result.summary(), file=sys.stderr)
        if args.json:
            print(json.dumps(result.to_json(), indent=2))
        return result.exit_code
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m cudampi.launch.cli`` (same as ``cudampi launch``)."""
    from cudampi.cli import main as cudampi_main

    return cudampi_main(["launch", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
