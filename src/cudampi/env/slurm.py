"""The Slurm route: an sbatch script that starts one rank per GPU with ``srun``.

``srun --mpi=pmix`` starts the ranks directly (no mpirun, no ssh): Slurm's PMIx server wires
them up, which the PyPI Open MPI wheel (internal PMIx) and MPICH both speak. GPUs: the job asks
``--gpus-per-node`` and every rank sees all of its node's GPUs (``--gpu-bind=none``); the rank
picks ``SLURM_LOCALID``'s GPU itself. Binding each task to its own GPU (``closest``, ``map_gpu``)
hides the other GPUs from it, and CUDA IPC between ranks of a node then fails (Slurm bug 17793,
open-mpi/ompi#11949), which is the fast path of UCX's cuda_ipc.

:func:`parse_sbatch` reads the ``#SBATCH`` header back (the tests use it, and so can a user
checking a script before submitting it).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from cudampi.config import ENV_SH, PYTHON, UCX_PRELOAD, VENV
from cudampi.env.pip import HEADER
from cudampi.env.spec import EnvSpec
from cudampi.errors import EnvGenError

SBATCH_OPTIONS = frozenset(
    {
        "job-name",
        "nodes",
        "ntasks",
        "ntasks-per-node",
        "gpus-per-node",
        "gpus-per-task",
        "cpus-per-task",
        "time",
        "partition",
        "account",
        "output",
        "error",
        "exclusive",
        "gres",
        "mem",
        "mem-per-gpu",
        "constraint",
        "qos",
        "signal",
        "requeue",
    }
)
"""The sbatch long options the generator writes or a user commonly adds (checked by the parser)."""


@dataclass(frozen=True)
class SbatchScript:
    """The ``#SBATCH`` options of a batch script and the ``srun`` lines of its body."""

    options: dict[str, str] = field(default_factory=dict)
    srun_lines: tuple[tuple[str, ...], ...] = ()
    exports: dict[str, str] = field(default_factory=dict)


def parse_sbatch(text: str) -> SbatchScript:
    """Parse an sbatch script: ``#SBATCH --opt=value`` lines (before the first command, as
    sbatch reads them), ``export NAME=value`` lines and ``srun`` command lines (as argv)."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("#!"):
        raise EnvGenError("sbatch script: the first line must be a #! interpreter line")
    options: dict[str, str] = {}
    exports: dict[str, str] = {}
    sruns: list[tuple[str, ...]] = []
    header = True
    body: list[str] = []
    for number, line in enumerate(lines[1:], start=2):
        stripped = line.strip()
        if header and stripped.startswith("#SBATCH"):
            for word in shlex.split(stripped[len("#SBATCH") :], comments=True):
                m = re.match(r"^--([a-z-]+)(?:=(.*))?$", word)
                if not m:
                    raise EnvGenError(
                        f"sbatch script line {number}: {word!r} is not --option[=value]"
                    )
                name = m.group(1)
                if name not in SBATCH_OPTIONS:
                    raise EnvGenError(f"sbatch script line {number}: unknown option --{name}")
                options[name] = m.group(2) if m.group(2) is not None else ""
            continue
        if stripped and not stripped.startswith("#"):
            header = False  # sbatch stops reading #SBATCH at the first command
        body.append(line)
    # Join backslash continuations before splitting commands.
    joined = re.sub(r"\\\n\s*", " ", "\n".join(body))
    for line in joined.splitlines():
        stripped = line.strip()
        m = re.match(r"^export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", stripped)
        if m:
            value = shlex.split(m.group(2))[0] if m.group(2) else ""
            exports[m.group(1)] = value
        elif stripped.startswith("srun ") or stripped.startswith("exec srun "):
            argv = shlex.split(stripped.removeprefix("exec "))
            sruns.append(tuple(argv))
    return SbatchScript(options, tuple(sruns), exports)


def srun_argv(spec: EnvSpec) -> list[str]:
    """The srun line that starts the ranks (argv; ``$VAR`` expanded by the batch shell)."""
    mpi = "pmix"
    gpu = ["--gpu-bind=none", f"--export=ALL,LD_PRELOAD=${{{UCX_PRELOAD}:-}}"]
    return [
        "srun",
        f"--mpi={mpi}",
        "--kill-on-bad-exit=1",
        f"--ntasks-per-node={spec.ranks_per_node_resolved}",
        f"--cpus-per-task={spec.cpus_per_task}",
        "--cpu-bind=cores",
        *(gpu if spec.gpu else []),
        *spec.command,
    ]


def sbatch_script(spec: EnvSpec, env: dict[str, str]) -> str:
    """The batch script. The venv (pip route) is ``CUDAMPI_VENV``; ``cudampi-env.sh`` is found
    beside the script wherever its folder was moved (or named by ``CUDAMPI_ENV_SH``)."""
    opts = {
        "job-name": spec.name,
        "nodes": str(spec.nodes),
        "ntasks-per-node": str(spec.ranks_per_node_resolved),
        "gpus-per-node": str(spec.gpus_per_node) if spec.gpu else None,
        "cpus-per-task": str(spec.cpus_per_task),
        "time": spec.time_limit,
        "exclusive": "",
        "output": "%x-%j.out",
    }
    if spec.partition:
        opts["partition"] = spec.partition
    header = "\n".join(
        f"#SBATCH --{k}" + (f"={v}" if v else "") for k, v in opts.items() if v is not None
    )
    del env  # the settings come from cudampi-env.sh, which the script sources
    srun = " \\\n  ".join(_shell_word(a) for a in srun_argv(spec))
    return f"""#!/bin/bash
{header}
{HEADER}# {spec.nodes} node(s) x {spec.ranks_per_node_resolved} rank(s){", one GPU each" if spec.gpu else " (CPU)"}. Submit: sbatch job.sbatch
# The PyPI route installed into {VENV} (sh install.sh "${VENV}").
set -euo pipefail
: "${{{VENV}:=$HOME/.venvs/{spec.name}}}"
# shellcheck source=/dev/null
. "${VENV}/bin/activate"
# cudampi-env.sh: {ENV_SH}, else beside this script (sbatch runs a copy: Slurm knows the
# original), else in the submit directory.
if [ -z "${{{ENV_SH}:-}}" ]; then
  _job_script=$(scontrol show job "${{SLURM_JOB_ID:-0}}" 2>/dev/null | sed -n 's/^ *Command=//p' || true)
  for _dir in "$(dirname "$0")" "$(dirname "${{_job_script:-.}}")" "${{SLURM_SUBMIT_DIR:-.}}"; do
    if [ -r "$_dir/cudampi-env.sh" ]; then {ENV_SH}="$_dir/cudampi-env.sh"; break; fi
  done
  if [ -z "${{{ENV_SH}:-}}" ]; then
    echo "job.sbatch: no cudampi-env.sh beside the job script nor in ${{SLURM_SUBMIT_DIR:-.}}: set {ENV_SH}" >&2
    exit 2
  fi
fi
# The venv's python tells cudampi-env.sh where the libucx wheel is (a shell variable: not
# passed to the ranks).
# shellcheck disable=SC2034
{PYTHON}="${VENV}/bin/python"
# shellcheck source=/dev/null
. "${ENV_SH}"
echo "cudampi: $SLURM_JOB_NUM_NODES node(s), $SLURM_NTASKS rank(s) on $SLURM_JOB_NODELIST"
{srun}
"""


def _shell_word(arg: str) -> str:
    # Keep ${...} expansions live for the batch shell; quote everything else.
    if "${" in arg:
        return '"' + arg.replace('"', '\\"') + '"'
    return shlex.quote(arg)
