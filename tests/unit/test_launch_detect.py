"""Launcher detection and machine facts: parsers on real output, the finder on this machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cudampi import net
from cudampi.errors import LaunchError
from cudampi.launch import detect

LAUNCH = Path(__file__).resolve().parents[1] / "fixtures" / "launch"


def test_parse_launcher_version_on_real_outputs():
    assert detect.parse_launcher_version((LAUNCH / "openmpi-version.txt").read_text()) == (
        "openmpi",
        "Open MPI",
        "5.0.11",
    )
    assert detect.parse_launcher_version((LAUNCH / "mpich-version.txt").read_text()) == (
        "mpich",
        "MPICH",
        "5.0.2",
    )
    assert detect.parse_launcher_version("prterun (PRRTE) 3.0.6\n")[0] == "openmpi"
    assert detect.parse_launcher_version("mpirun (Open MPI) 4.1.6\n\nReport bugs")[2] == "4.1.6"
    assert detect.parse_launcher_version("slurm 23.02.5\n") == ("slurm", "Slurm", "23.02.5")
    intel = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)"
    assert detect.parse_launcher_version(intel) == ("mpich", "Intel MPI", "2021.10")
    with pytest.raises(LaunchError, match="cannot tell which MPI"):
        detect.parse_launcher_version("lamboot 7.1\n")


def test_find_launcher_prefers_the_one_beside_python():
    found = detect.find_launcher("auto", env={"PATH": "/usr/bin:/bin"})
    assert found.path == str(Path(sys.executable).parent / "mpiexec")
    assert found.flavour == "openmpi" and found.version
    assert detect.find_launcher("mpirun", env={"PATH": ""}).path.endswith("/mpirun")
    flav = detect.mpi_flavour()
    assert flav is not None and flav[0] == found.flavour
    with pytest.raises(LaunchError, match="srun is not on PATH"):
        detect.find_launcher("srun", env={"PATH": "/nonexistent"})


def test_cpu_parsers():
    ht = "".join(f"processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {i % 2}\n\n" for i in range(4))
    assert detect.parse_physical_cores(ht) == 2
    assert detect.parse_physical_cores("processor : 0\n\nprocessor : 1\n") == 2
    assert detect.query_physical_cores() >= 1


def test_interfaces_and_routes_on_this_host():
    ifaces = net.interfaces()
    lo = [i for i in ifaces if i.loopback]
    assert lo and lo[0].network == "127.0.0.0/8"
    assert net.route_interface("127.0.0.1", ifaces) == lo[0]
    assert net.route_interface("no-such-host.invalid", ifaces) is None
    names = net.local_names(ifaces)
    assert net.is_local("localhost", names) and not net.is_local("no-such-host.invalid", names)


def test_slurm_version_of_the_debian_package():
    text = (LAUNCH / "slurm-version.txt").read_text()
    assert detect.parse_launcher_version(text) == ("slurm", "Slurm", "22.05.8")
