"""``cudampi launch``: run a script on N ranks with the right launcher, and supervise them.

- :mod:`~cudampi.launch.plan`: LaunchPlan (pure) -> argv per launcher (Open MPI, Hydra, srun)
- :mod:`~cudampi.launch.detect`: which launcher and MPI are here; cores, GPUs, the libucx recipe
- :mod:`~cudampi.launch.rank`: the bootstrap every rank runs before the script
- :mod:`~cudampi.launch.runner`: supervision, Ctrl-C, fault summary

``cudampi.init()``, which a script calls inside its rank, is :mod:`cudampi.start`.
"""
