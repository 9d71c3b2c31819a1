"""The fault matrix (tools/fault_matrix.py): every fault x launcher x API as a real
job must end non-zero within its limit, name the fault, and leave no process behind (a corrupt
capabilities cache must be named and let the job end well). CI runs two cells (the others are
covered by tests/mpi/test_torch_faults.py, test_comm_deadline.py, test_launch_real.py,
test_config_real.py, test_cache_real.py, test_comm_threads.py and test_comm_lifecycle.py); one
per launcher and fault kind and the whole matrix (72 cells) run with ``pytest -m slow``."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.mpirun import MPICH_PYTHON, MPICH_SKIP, ROOT, mpich_venv, only_when_asked

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")


def _tool():
    spec = importlib.util.spec_from_file_location(
        "fault_matrix", ROOT / "tools" / "fault_matrix.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_matrix"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _mpich():
    venv = mpich_venv()
    return venv / "lib" / "libmpi.so.12" if venv is not None else None


def _cell(fault: str, launcher: str, api: str):
    fm = _tool()
    if launcher == "torchrun" and _mpich() is None:
        pytest.skip(MPICH_SKIP)
    cell = fm.run_cell(fault, launcher, api, 3, _mpich())
    assert cell.ok, fm.markdown([cell])
    return cell


@pytest.mark.parametrize(
    ("fault", "launcher", "api"),
    [
        ("exit0", "cudampi-launch", "comm"),
        ("badsetting", "mpiexec", "comm"),
        pytest.param("skip", "mpiexec", "torch", marks=only_when_asked()),
        pytest.param("sigkill", "torchrun", "torch", marks=only_when_asked()),
        pytest.param("badcache", "torchrun", "torch", marks=only_when_asked()),
        pytest.param("threads", "mpiexec", "torch", marks=only_when_asked()),
        pytest.param("halfmade", "cudampi-launch", "comm", marks=only_when_asked()),
        pytest.param("waitexit", "mpiexec", "comm", marks=only_when_asked()),
        pytest.param("closeexit", "torchrun", "torch", marks=only_when_asked()),
    ],
)
def test_a_cell_of_each_launcher(fault, launcher, api):
    _cell(fault, launcher, api)


@pytest.mark.parametrize("asked", [pytest.param("", marks=only_when_asked())])
def test_the_whole_matrix(tmp_path, asked):
    fm = _tool()
    assert (
        fm.main(["--mpich-python", str(MPICH_PYTHON), "--json", str(tmp_path / "cells.json")]) == 0
    )
