"""``cudampi bench``: nccl-tests style collective, OSU-style p2p and DDP training benchmarks.

Every path (cudampi's gpu-ring/staged/native/host, torch.distributed's nccl/gloo/cudampi, plus
the peers mpi4py and a raw copy) fills the same table, so the numbers compare side by side.
Nothing here imports mpi4py, torch or CuPy at import time.
"""

from __future__ import annotations

from cudampi.bench.metrics import algbw, busbw, busbw_factor, collective_layout

__all__ = ["algbw", "busbw", "busbw_factor", "collective_layout"]
