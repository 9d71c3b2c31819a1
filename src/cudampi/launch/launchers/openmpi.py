"""Open MPI's mpirun/prterun (PRRTE): found by its ``--version``, run through the one mpiexec
command line (:class:`cudampi.mpiexec.Mpiexec`), its failure messages read from real captured
output (``tests/fixtures/launch/openmpi-*.txt``).

Its policies: it refuses more ranks than a host's cores unless told (``--oversubscribe``), it
refuses to run as root without :data:`cudampi.mpiexec.ROOT_ENV`, and across hosts it forwards
only the variables named with ``-x`` and uses every interface unless its TCP is kept on the
network that reaches the hosts (``btl_tcp_if_include``, ``oob_tcp_if_include``).
"""

from __future__ import annotations

import re

from cudampi.launch.events import HostFailure, RankFailure, Seen, same_host
from cudampi.launch.launchers.base import Command, LauncherFamily, LaunchPlan, mpiexec_command

_VERSION = re.compile(r"\((Open MPI|OpenRTE|PRRTE)\)\s+(\S+)")
_EXIT = re.compile(r"Process name:\s*\[[^\]]*?,(\d+)\]\s+Exit code:\s*(\d+)")
_SIGNAL = re.compile(
    r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)", re.S
)
_ABORT = re.compile(
    r"MPI_ABORT was invoked on rank (\d+) in communicator \S+.*?Errorcode:\s*(-?\d+)", re.S
)
_ABORT_NODE = re.compile(r'process rank (\d+) with PID \d+ on node (\S+) calling\s+"abort"')
_IMPROPER = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exiting\s+improperly")
_DAEMON = re.compile(r"Remote host:\s+(\S+)\s+Daemon exit status:\s*(-?\d+)")
_LOST = re.compile(
    r"lost communication with a remote daemon\.(?:.*?\n)*?\s*Remote daemon:\s*\[[^\]]*?,(\d+)\]"
    r"\s+on node\s+(\S+)",
)


class OpenMpi(LauncherFamily):
    name = "openmpi"
    mpi_flavours = ("openmpi",)
    refuses_oversubscription = True
    needs_root_env = True

    def parse_version(self, text: str) -> tuple[str, str] | None:
        m = _VERSION.search(text)
        if m is None:
            return None
        return ("Open MPI" if m.group(1) != "PRRTE" else "PRRTE"), m.group(2)

    def command(self, plan: LaunchPlan, hostfile_path: str | None) -> Command:
        return mpiexec_command(plan, hostfile_path, "openmpi")

    def network(
        self, ifname: str | None, subnet: str | None, local_ifname: str | None, notes: list[str]
    ) -> list[tuple[str, str]]:
        if ifname:
            return [("btl_tcp_if_include", ifname), ("oob_tcp_if_include", ifname)]
        if subnet:
            notes.append(f"TCP of MPI and of its daemons kept on {subnet}")
            return [("btl_tcp_if_include", subnet), ("oob_tcp_if_include", subnet)]
        return []

    def read_output(self, text: str, seen: Seen) -> None:
        if "Unable to get the user home directory" in text:
            seen.problems.append(
                "Open MPI cannot start without a home folder (HOME is unset or not a folder "
                "where the launcher or a rank runs). Fix: export HOME=/path/to/a/folder"
            )
        for m in _EXIT.finditer(text):
            seen.add_rank(RankFailure(int(m.group(1)), None, exit_code=int(m.group(2))))
        for m in _SIGNAL.finditer(text):
            seen.add_rank(RankFailure(int(m.group(1)), m.group(2), signal=int(m.group(3))))
        for m in _ABORT.finditer(text):
            seen.add_rank(RankFailure(int(m.group(1)), None, exit_code=int(m.group(2))))
        for m in _ABORT_NODE.finditer(text):
            seen.add_rank(RankFailure(int(m.group(1)), m.group(2)))
        for m in _IMPROPER.finditer(text):
            seen.add_rank(
                RankFailure(int(m.group(1)), m.group(2), lines=("exited without finalizing MPI",))
            )
        for m in _DAEMON.finditer(text):
            name = seen.ssh_name(m.group(1))
            detail = seen.ssh_detail.get(name, f"its daemon exited with status {m.group(2)}")
            if name != m.group(1):
                detail += f" (Open MPI calls it {m.group(1)})"
            problem = "lost" if name in seen.lost else "unreachable"
            seen.add_host(HostFailure(name, problem, detail))
        for m in _LOST.finditer(text):
            vpid, node = int(m.group(1)), m.group(2)
            name = seen.ssh_name(node)
            given = [h for h in seen.remote if same_host(h, node)]
            if given:
                name = given[0]
            elif name == node and 1 <= vpid <= len(seen.remote):
                name = seen.remote[vpid - 1]  # the name the user gave, not the node's own
            detail = "its daemon stopped answering"
            if name != node:
                detail += f" (Open MPI calls it {node})"
            seen.add_host(HostFailure(name, "lost", detail))


FAMILY = OpenMpi()
