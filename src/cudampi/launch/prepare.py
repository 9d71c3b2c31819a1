"""From what was asked to a decided plan, on this machine: the launcher, the batch job, the
cores, GPUs and UCX recipe here, and the network toward the hosts (:func:`plan_launch`).

This is the entry for any code that launches ranks as ``cudampi launch`` does (its CLI, and
the doctor's one rank per host): build a :class:`~cudampi.launch.plan.PlanRequest` whose command
is :func:`rank_command`, call :func:`plan_launch`, then run it with
:func:`cudampi.launch.runner.execute` (or show :func:`cudampi.launch.runner.command_for`).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import sys
from collections.abc import Sequence

from cudampi import net
from cudampi.errors import LaunchError
from cudampi.launch import detect, launchers
from cudampi.launch.hosts import Host
from cudampi.launch.plan import LaunchPlan, Machine, PlanRequest, make_plan

BOOTSTRAP = ("-m", "cudampi.launch.rank")
"""What every rank runs first (:mod:`cudampi.launch.rank`), before the user's command."""


def rank_command(target: Sequence[str]) -> tuple[str, ...]:
    """The command every rank runs for ``target`` (``script.py args``, ``-m module args`` or
    ``--exec program args``): this python's rank bootstrap, then the target."""
    return (sys.executable, *BOOTSTRAP, *target)


def plan_launch(
    req: PlanRequest,
    workdir: str,
    *,
    launcher: str = "auto",
    resolve_hosts: bool = True,
    use_job: bool = True,
) -> LaunchPlan:
    """Detect the launcher (``--launcher``'s choice) and the machine, and decide the plan of
    ``req`` (runs nothing). The ranks write their fault files under ``workdir``.

    ``resolve_hosts`` False (a dry run): host names are not looked up (no DNS); a host is this
    machine only by one of its own names, and the network toward the others is decided only
    for hosts given by address. ``use_job`` False: the batch job this process may run in is
    ignored, and ``auto`` takes the MPI's mpiexec, not the job's launcher (``--standalone``).
    """
    if launcher == "auto" and not use_job:
        launcher = "mpiexec"  # this machine's ranks: not the batch job's launcher (srun, jsrun)
    found = detect.find_launcher(launcher)
    fam = launchers.family(found.flavour)
    beside = detect.mpi_flavour()
    mpi = beside[0] if beside else found.flavour
    if beside and beside[0] not in fam.mpi_flavours:
        raise LaunchError(
            f"{found.path!r} is {found.name} {found.version} but this python's MPI "
            f"(beside {sys.executable!r}) is {beside[1]}: ranks would not join one job. Use "
            f"--launcher with the matching mpiexec"
        )
    alloc = launchers.allocation(os.environ, found) if use_job else None
    hosts = req.hosts or (alloc.hosts if alloc is not None else ())
    ifaces = net.interfaces()
    names = net.local_names(ifaces)
    local = names
    if resolve_hosts:
        local = names | {h.name for h in hosts if net.is_local(h.name, names)}
    remote = [h for h in hosts if h.name not in local]
    subnet = ifname = None
    notes: list[str] = []
    if remote and resolve_hosts:
        _check_resolves(tuple(remote))
    if remote and (resolve_hosts or _is_address(remote[0].name)):
        iface = net.route_interface(remote[0].name, ifaces)
        if iface is not None and not iface.loopback:
            subnet, ifname = iface.network, iface.name
    elif remote:
        notes.append(
            "dry run: host names were not looked up; a run decides which hosts are this "
            "machine and the network that reaches the others"
        )
    machine = Machine(
        cores=detect.query_physical_cores(),
        gpus=len(detect.query_gpus()),
        is_root=os.geteuid() == 0,
        ucx=detect.find_ucx_recipe(),
        local_names=local,
        subnet=subnet,
        ifname=ifname,
        allocation=alloc,
        report_dir=os.path.join(workdir, "reports"),
        env_names=frozenset(os.environ),
    )
    if req.master_port is None:
        req = dataclasses.replace(req, master_port=net.free_port())
    plan = make_plan(req, found, machine, mpi)
    return dataclasses.replace(plan, notes=(*plan.notes, *notes)) if notes else plan


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _check_resolves(hosts: tuple[Host, ...]) -> None:
    for h in hosts:
        try:
            socket.getaddrinfo(h.name, None)
        except (socket.gaierror, UnicodeError) as exc:
            raise LaunchError(
                f"host {h.name!r} cannot be reached: its name does not resolve ({exc}). Fix the "
                f"name in --hosts/--hostfile or add it to /etc/hosts or DNS"
            ) from None
