"""The pip route installed for real: `cudampi env write --only pip`, the folder moved elsewhere,
its own `install.sh VENV --cpu` (the CPU requirements, then the cudampi wheel bundled beside
it), then the `next:` line it prints (activate the venv, source the settings, `cudampi doctor`)
must pass in a shell without the venv on PATH and report the wheel's MPI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudampi.env import files, pip
from cudampi.env.spec import DEFAULT

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, (
        f"{argv!r} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.mark.timeout(420)
def test_fresh_venv_pip_route_passes_doctor(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VIRTUAL_ENV", "PYTHON", "CUDAMPI_"))
    }
    written, out = tmp_path / "written", tmp_path / "moved" / "env"
    _run(
        [sys.executable, "-m", "cudampi", "env", "write", "--only", "pip", "--out", str(written)],
        env,
        300,
    )
    out.parent.mkdir()
    shutil.move(written, out)
    venv = tmp_path / "venv"
    env.update(
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        HOME=str(tmp_path),
        CUDAMPI_CACHE_DIR=str(tmp_path / "cache"),
        PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    # The folder's own installer, as its README line says: sh install.sh VENV --cpu.
    installed = _run(["sh", str(out / "install.sh"), str(venv), "--cpu"], env, 400)
    py = str(venv / "bin" / "python")
    freeze = _run([py, "-m", "pip", "freeze"], env, 60).stdout
    assert (
        pip.parse_lock(freeze).items()
        >= pip.parse_lock(out.joinpath("requirements-cpu.txt").read_text()).items()
    )
    # What install.sh says to do next, pasted into a shell where the venv is not on PATH:
    # it must activate the venv, so that cudampi-env.sh and the doctor use the venv's python.
    (said,) = [ln for ln in installed.stdout.splitlines() if ln.startswith("next: ")]
    bare = {**env, "PATH": "/usr/bin:/bin"}
    doctor = subprocess.run(
        [
            "sh",
            "-c",
            said.removeprefix("next: ") + ' --json && echo "python3=$(command -v python3)"',
        ],
        capture_output=True,
        text=True,
        env=bare,
        timeout=300,
        cwd=tmp_path,
    )
    assert doctor.returncode == 0, doctor.stdout[-4000:] + doctor.stderr[-2000:]
    printed, _, python3 = doctor.stdout.rpartition("python3=")
    assert python3.strip() == f"{venv}/bin/python3"  # the venv's, as cudampi-env.sh asks it
    report = json.loads(printed)
    assert report["exit_code"] == 0 and report["summary"]["fail"] == 0
    checks = {c["name"]: c for c in report["checks"]}
    lib = checks["MPI library"]
    assert lib["status"] == "ok"
    assert f"Open MPI {DEFAULT.mpi_pin}" in lib["detail"] and str(venv) in lib["detail"], lib


@pytest.mark.timeout(300)
def test_docker_lock_is_what_pip_resolves_today():
    """docker/requirements.lock names the files (and sha256) pip's resolver picks for the image."""
    fresh = pip.resolve_lock(DEFAULT)
    committed = (ROOT / "docker" / files.LOCK).read_text()
    assert fresh == committed, (
        "docker/requirements.lock is stale: cudampi env lock --spec docker/env.toml --out docker"
    )
