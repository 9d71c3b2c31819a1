"""The ``cudampi`` command: argparse subcommands, each in its own package's ``cli`` module.

Only the chosen subcommand's module is imported, and those import mpi4py, torch or CuPy only
inside the functions that need them, so ``cudampi --help`` works on any machine.
Exit codes: 0 ok, 1 a check or run failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from cudampi._version import __version__
from cudampi.errors import ConfigError, CudampiError

SUBCOMMANDS = {
    "doctor": ("cudampi.doctor.cli", "diagnose the MPI/CUDA/NCCL/torch stack, with fixes"),
    "launch": ("cudampi.launch.cli", "run a program on N ranks with mpirun, mpiexec or srun"),
    "bench": ("cudampi.bench.cli", "benchmark collectives, p2p and DDP on every path"),
    "env": ("cudampi.env.cli", "write conda/pip/Dockerfile/Slurm/Kubernetes files for the stack"),
    "trace": ("cudampi.trace_cli", "run a job and write a Chrome-trace timeline of its calls"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cudampi",
        description="CUDA-aware MPI for GPU training with PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"cudampi {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args))
    except ConfigError as exc:
        print(f"cudampi {args.command}: {exc}", file=sys.stderr)
        return 2
    except CudampiError as exc:
        print(f"cudampi {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"cudampi {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
