"""``cudampi launch`` and ``cudampi.init()``: run a script on N ranks with the right launcher.

- :mod:`~cudampi.launch.plan`: LaunchPlan (pure) -> argv per launcher (Open MPI, Hydra, srun)
- :mod:`~cudampi.launch.detect`: which launcher and MPI are here; cores, GPUs, the libucx recipe
- :mod:`~cudampi.launch.rank`: the bootstrap every rank runs before the script
- :mod:`~cudampi.launch.runner`: supervision, Ctrl-C, fault summary
- :mod:`~cudampi.launch.init`: ``cudampi.init()`` inside scripts
"""

from __future__ import annotations

from cudampi.launch.init import RankInfo, init

__all__ = ["RankInfo", "init"]
