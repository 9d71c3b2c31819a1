"""A torch.distributed backend on cudampi, for stock PyTorch wheels (2.4 and newer).

``import cudampi.torch`` registers the backend ``"cudampi"`` (CPU and CUDA tensors) and the
rendezvous ``cudampi://``; then, in a script started by ``cudampi launch``, mpirun, mpiexec or
srun::

    import torch.distributed as dist
    import cudampi.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("cudampi")  # rank and size from MPI: no MASTER_ADDR needed

Importing this package imports torch (that is its purpose); it starts no MPI and no CUDA: MPI
starts when the first group is created. Where cudampi is pip-installed, torch imports it at
``import torch`` (the ``torch.backends`` entry point, :mod:`cudampi._torch_autoload`), so
``init_process_group("cudampi")`` works without the import too. It also prints the fix after the
traceback of torch's errors for ``init_process_group("mpi")`` (:mod:`cudampi.torch.hints`).
"""

from __future__ import annotations

from cudampi.torch.backend import CudampiProcessGroup
from cudampi.torch.groups import register
from cudampi.torch.hints import install_excepthook
from cudampi.torch.options import BACKEND_NAME, Options
from cudampi.torch.rendezvous import INIT_METHOD, mpi_launcher
from cudampi.torch.world import install_exit_hook

__all__ = [
    "BACKEND_NAME",
    "INIT_METHOD",
    "CudampiProcessGroup",
    "Options",
    "mpi_launcher",
    "register",
]

register()
install_excepthook()
install_exit_hook()
