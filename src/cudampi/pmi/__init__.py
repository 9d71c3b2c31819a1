"""One MPI job out of processes that a non-MPI launcher (torchrun) started.

- :mod:`~cudampi.pmi.server`: a PMI-1 server (``python -m cudampi.pmi.server``) that rank 0
  starts and every rank's MPI connects to
- :mod:`~cudampi.pmi.client`: a rank's PMI and watch connections to it; :mod:`~cudampi.pmi.wire`:
  the PMI-1 line format both speak
- :mod:`~cudampi.pmi.join`: the ranks' side, run by the torch backend before MPI starts

Nothing here imports torch: the server runs in a plain child process.
"""
