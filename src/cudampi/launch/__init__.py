"""``cudampi launch``: run a script on N ranks with the right launcher, and supervise them.

- :mod:`~cudampi.launch.launchers`: one module per launcher family (Open MPI, MPICH/Hydra,
  Slurm, PBS, LSF): its launcher, its batch job's hosts, its argv, its failure messages
- :mod:`~cudampi.launch.plan`: request + machine -> one decided LaunchPlan (pure)
- :mod:`~cudampi.launch.prepare`: the plan on this machine (``plan_launch``: the entry for code
  that launches ranks); :mod:`~cudampi.launch.detect`: which launcher and MPI are here; cores,
  GPUs, the libucx recipe
- :mod:`~cudampi.launch.rank`: the bootstrap every rank runs before the script
- :mod:`~cudampi.launch.runner`: supervision, Ctrl-C, fault summary

``cudampi.init()``, which a script calls inside its rank, is :mod:`cudampi.start`.
"""
