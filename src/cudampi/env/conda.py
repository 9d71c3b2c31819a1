"""The conda route: ``environment.yml`` for conda/mamba from conda-forge.

Facts it relies on (conda-forge feedstocks, read in their recipes):

- ``openmpi`` 5.0.10 for Linux is built ``--with-cuda`` (CUDA 12.9 compiler, driver API only, so
  it runs under ``cuda-version`` 12 and 13) and ``--with-ucx``/``--with-ucc``, but writes
  ``opal_cuda_support = 0`` into ``etc/openmpi-mca-params.conf``: the environment must set
  ``OMPI_MCA_opal_cuda_support=true``. Builds named ``external_*`` (label ``mpi-external``) are
  empty shims for a system MPI; the main channel gives the real library.
- ``ucx`` 1.20.0 is built ``--with-cuda`` (variants for CUDA 12.9 and 13.0) and needs
  ``cuda-cudart`` of the matching ``cuda-version`` at run time for its cuda transports.
- ``mpi4py`` 4.1.1 has one build per MPI; having ``openmpi`` in the environment selects it.
- ``pytorch`` CUDA builds carry the build string ``cuda130_*`` / ``cuda129_*``.
- ``mpich`` 5.0.1 is built without CUDA: with MPICH the GPU path is host staging.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from cudampi.env import source
from cudampi.env.pip import HEADER, extra_requirements
from cudampi.env.spec import EnvSpec
from cudampi.errors import EnvGenError

CONDA_PINS = {"openmpi": "5.0.10", "mpich": "5.0.1", "ucx": "1.20.0", "mpi4py": "4.1.1"}


def conda_cuda(spec: EnvSpec) -> str:
    """The conda-forge CUDA variant for the spec: 13.0, or 12.9 for any CUDA 12."""
    return "13.0" if spec.cuda_major == "13" else "12.9"


def environment_yml(spec: EnvSpec, env: dict[str, str]) -> str:
    """The conda/mamba environment file; ``env`` goes under ``variables:`` (set on activate)."""
    if not spec.gpu:
        return _environment_yml(spec, env, cuda=None, note="")
    cuda = conda_cuda(spec)
    note = ""
    if cuda != spec.cuda:
        note = (
            f"# CUDA {spec.cuda} asked; conda-forge builds CUDA 12 packages against 12.9, "
            "which runs on any driver >= 12.9's minimum (CUDA minor-version compatibility).\n"
        )
    return _environment_yml(spec, env, cuda=cuda, note=note)


def _environment_yml(spec: EnvSpec, env: dict[str, str], *, cuda: str | None, note: str) -> str:
    """``cuda``: conda-forge's CUDA variant, or None for the CPU builds."""
    mpi_lines: list[str]
    if spec.mpi == "openmpi" and cuda:
        mpi_lines = [
            f"  - openmpi={CONDA_PINS['openmpi']}  # conda-forge's Linux build: CUDA + UCX + UCC",
            f"  - ucx={CONDA_PINS['ucx']}  # built --with-cuda: cuda_copy, cuda_ipc, gdr_copy",
            "  - cuda-cudart  # UCX's cuda transports load libcudart at run time",
        ]
    elif spec.mpi == "openmpi":
        mpi_lines = [f"  - openmpi={CONDA_PINS['openmpi']}  # CUDA support stays off (CPU)"]
    else:
        mpi_lines = [
            f"  - mpich={CONDA_PINS['mpich']}  # built without CUDA: device buffers go host-staged",
        ]
    if cuda:
        cuda_line = f"  - cuda-version={cuda}  # every CUDA package below builds for this CUDA\n"
        torch_build = "cuda" + cuda.replace(".", "") + "*  # the CUDA build, not cpu_*"
    else:
        cuda_line, torch_build = "", "cpu_*  # the CPU build"
    variables = "\n".join(f"  {k}: '{v}'" for k, v in env.items())
    pip_lines = [f"    - {r}" for r in extra_requirements(spec)]
    pip_lines.append(f"    - {source.requirement(spec)}  # cudampi itself (relative to this file)")
    return (
        HEADER + note + f"# conda env create -f environment.yml && conda activate {spec.name}\n"
        f"name: {spec.name}\n"
        "channels:\n"
        "  - conda-forge\n"
        "  - nodefaults\n"
        "dependencies:\n"
        f"  - python={spec.python}\n" + cuda_line + "\n".join(mpi_lines) + "\n"
        f"  - mpi4py={CONDA_PINS['mpi4py']}  # the build for the MPI above (conda's mpi metapackage)\n"
        f"  - pytorch={spec.torch}={torch_build}\n"
        "  - numpy\n"
        "  - pip\n"
        "  - pip:\n"
        + "\n".join(pip_lines)
        + "\n"
        + ("variables:\n" + variables + "\n" if env else "")
    )


def load_schema() -> dict[str, Any]:
    """The JSON Schema of a conda environment file (``schemas/conda-environment.schema.json``)."""
    path = resources.files("cudampi.env").joinpath("schemas/conda-environment.schema.json")
    return dict(json.loads(path.read_text()))


def validate_environment(doc: Any) -> None:
    """Raise :class:`EnvGenError` naming the first entry that conda would not read as meant."""
    try:
        import jsonschema
    except ModuleNotFoundError:
        raise EnvGenError(
            "validating environment.yml needs jsonschema: pip install jsonschema"
        ) from None
    errors = sorted(
        jsonschema.Draft7Validator(load_schema()).iter_errors(doc),
        key=lambda e: list(e.absolute_path),
    )
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "(top)"
        raise EnvGenError(f"environment.yml does not match conda's format at {where}: {e.message}")
