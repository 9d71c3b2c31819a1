"""MPICH's Hydra mpiexec (also Intel MPI's and MVAPICH's): found by its ``--version``, run
through the one mpiexec command line (:class:`cudampi.mpiexec.Mpiexec`), its failure messages
read from real captured output (``tests/fixtures/launch/mpich-*.txt``).

Its policies: it never refuses more ranks than slots, forwards only the variables named with
``-genvlist``, takes one interface name for every host (``-iface``), and the ranks it kills leave
their MPICH shared-memory segment in ``/dev/shm`` (:mod:`cudampi.shm` removes them).
"""

from __future__ import annotations

import re

from cudampi.launch.events import RankFailure, Seen
from cudampi.launch.launchers.base import Command, LauncherFamily, LaunchPlan, mpiexec_command
from cudampi.shm import orphaned_mpich_segments, remove

_INTEL = re.compile(r"Intel\(R\) MPI Library.*?Version\s+(\S+)", re.S)
_HYDRA_VERSION = re.compile(r"Version:\s+(\S+)")
_BAD = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*EXIT CODE:\s*(\d+)")
_SIGNAL = re.compile(r"EXIT STRING: .*?\(signal (\d+)\)")
_ABORT = re.compile(r"Abort\((-?\d+)\) on node \d+ \(rank (\d+) in comm 0\)")


class Hydra(LauncherFamily):
    name = "mpich"
    mpi_flavours = ("mpich",)

    def parse_version(self, text: str) -> tuple[str, str] | None:
        m = _INTEL.search(text)
        if m:
            return "Intel MPI", m.group(1).rstrip(",")
        if "HYDRA build details" in text or "hydra" in text.lower():
            v = _HYDRA_VERSION.search(text)
            return "MPICH", v.group(1) if v else ""
        return None

    def command(self, plan: LaunchPlan, hostfile_path: str | None) -> Command:
        return mpiexec_command(plan, hostfile_path, "mpich")

    def network(
        self, ifname: str | None, subnet: str | None, local_ifname: str | None, notes: list[str]
    ) -> list[tuple[str, str]]:
        if ifname or local_ifname:
            notes.append(
                f"-iface {ifname or local_ifname}: Hydra uses this interface name on "
                f"every host (pass --ifname if the names differ)"
            )
        return []

    def read_output(self, text: str, seen: Seen) -> None:
        for m in _ABORT.finditer(text):
            seen.add_rank(RankFailure(int(m.group(2)), None, exit_code=int(m.group(1))))
        sig = _SIGNAL.search(text)
        for m in _BAD.finditer(text):
            # Hydra's PID is the first process of that host's proxy that did not exit by itself
            # (pmiserv_cb.c: the first !WIFEXITED status): one killed by a signal. Its fault file
            # names its rank (build_result).
            pid, host, code = int(m.group(1)), m.group(2), int(m.group(3))
            if sig is not None and int(sig.group(1)) == code:
                seen.add_rank(RankFailure(None, host, signal=code, pid=pid))
            else:
                seen.add_rank(RankFailure(None, host, exit_code=code, pid=pid))

    def after_run(self, returncode: int, since: float) -> None:
        if returncode != 0:
            # Ranks Hydra killed leave their MPICH segment on this host (cudampi.shm).
            remove(orphaned_mpich_segments(since))


FAMILY = Hydra()
