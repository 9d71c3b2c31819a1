"""The settings check against the real MPI: each setting check_settings calls fatal for this
library (the PyPI Open MPI wheel) does stop MPI_Init here, and the recommended ones do not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cudampi.env.settings import check_settings
from tests.conftest import HAS_CUDA, cudampi_cli
from tests.mpirun import is_open_mpi, mpi_env, mpiexec, mpiexec_argv, run_launched

pytestmark = pytest.mark.mpi

PROGRAM = "from mpi4py import MPI; c = MPI.COMM_WORLD; assert c.allreduce(1) == c.size; print('ok')"
WHEEL_BTLS = {"self", "sm", "tcp", "ofi", "uct"}  # ompi_info of the 5.0.11 wheel (fixture)


def run_job(n: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [*mpiexec_argv(n), sys.executable, "-c", PROGRAM]
    full = mpi_env(env)
    for k in [
        k for k in full if k.startswith(("OMPI_MCA_pml", "OMPI_MCA_btl", "OMPI_MCA_opal_cuda"))
    ]:
        if k not in env:
            del full[k]
    return run_launched(argv, full, 60, f"{n}-rank job")


@pytest.fixture(scope="module", autouse=True)
def _open_mpi_only():
    if not is_open_mpi():
        pytest.skip("these settings are Open MPI's; the test MPI is not Open MPI")


@pytest.mark.parametrize(
    ("env", "n", "message"),
    [
        # The help text ("A requested component was not found ... Component: smcuda") is not
        # always flushed before the abort; MPI_Init's failure always is.
        ({"OMPI_MCA_btl": "tcp,self,smcuda"}, 1, "MPI_Init"),
        ({"OMPI_MCA_btl": "tcp,sm"}, 2, 'forgetting to\nspecify the "self" BTL'),
        ({"OMPI_MCA_opal_cuda_support": "true"}, 1, "not compiled with any support"),
    ],
)
def test_fatal_settings_are_fatal_and_flagged(env, n, message):
    proc = run_job(n, env)
    assert proc.returncode != 0 and "ok" not in proc.stdout
    assert message in proc.stdout + proc.stderr
    findings = check_settings(
        env, gpus=False, ompi_major=5, btl_components=WHEEL_BTLS, built_with_cuda=False
    )
    assert any(f.status == "fail" and f.name in env for f in findings), findings


def test_pml_ucx_without_gpu_or_ib_transports_aborts_and_is_warned():
    env = {"OMPI_MCA_pml": "ucx"}
    proc = run_job(1, env)
    assert proc.returncode != 0
    assert "No components were able to be opened in the pml framework" in proc.stdout + proc.stderr
    assert [f.status for f in check_settings(env, gpus=False)] == ["warn"]


def test_recommended_multi_node_settings_run_on_this_host():
    # What the generated files export for the wheel, minus pml/osc ucx (no GPU here), with the
    # documented mpirun placement flags.
    env = {"OMPI_MCA_plm_rsh_agent": "ssh", "NCCL_SOCKET_IFNAME": "^lo,docker"}
    argv = [
        mpiexec(),
        "-n",
        "2",
        "--map-by",
        "ppr:2:node",
        "--bind-to",
        "numa",
        sys.executable,
        "-c",
        PROGRAM,
    ]
    proc = run_launched(argv, mpi_env(env), 60, "2-rank job")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == 2
    assert check_settings(env, gpus=False, multi_node=True, ompi_major=5) == []


def _named(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def test_a_cuda_switch_on_a_build_without_cuda_is_named_by_doctor_and_env_check(isolated_cache):
    # conda-forge's Open MPI needs this switch; the wheel aborts MPI_Init on it. The doctor's
    # failed probe must carry the library's own words, and both judges must name the variable.
    env = {"OMPI_MCA_opal_cuda_support": "true"}
    if HAS_CUDA:
        pytest.skip("checks the host rows of a machine without a GPU (the wheel has no CUDA)")
    proc = cudampi_cli("doctor", "--json", env=env, timeout=240)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1
    probe = _named(doc, "host p2p")
    assert probe["status"] == "fail"
    assert "not compiled with any support" in probe["detail"], probe
    settings = _named(doc, "MPI/UCX/NCCL settings")
    assert settings["status"] == "fail" and "OMPI_MCA_opal_cuda_support" in settings["detail"]
    assert "unset OMPI_MCA_opal_cuda_support" in settings["fix"]

    check = cudampi_cli("env", "check", "--cpu", env=env, timeout=120)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "[fail] OMPI_MCA_opal_cuda_support=true" in check.stdout
    assert "not compiled with any support" in check.stdout
