"""A full disk, for real: every file cudampi writes for the user (the doctor's --save-json,
`cudampi env write`, bench's --json, the capabilities cache, a rank's CUDAMPI_TRACE file) is
written whole or not at all, the failure is said without a traceback, and what was measured is
still printed. The folder is a full tmpfs in a private mount namespace (tests/fulldisk.py);
standard output is /dev/full."""

from __future__ import annotations

import json
import sys

import pytest

from tests.fulldisk import run_on_full_disk, why_no_full_disk
from tests.mpirun import ROOT, mpi_env, mpiexec_argv

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(why_no_full_disk() is not None, reason=str(why_no_full_disk())),
]

CLI = [sys.executable, "-m", "cudampi"]
NO_SPACE = "No space left on device"


def _clean(found: dict[str, str], proc) -> None:
    """No empty, partial or temporary file was left (the cache's lock file is empty by design),
    and nothing crashed."""
    empty = [n for n, text in found.items() if not text and not n.endswith(".capabilities.lock")]
    assert not empty and not [n for n in found if n.endswith(".tmp")], found.keys()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("free", [0, 8 << 10], ids=["full", "room-for-8K"])
def test_the_doctors_saved_report_is_whole_or_absent_and_the_report_is_printed(tmp_path, free):
    full = tmp_path / "full"
    proc, found = run_on_full_disk(
        [*CLI, "doctor", "--no-runtime", "--save-json", str(full / "report.json")],
        full,
        free=free,
        seed={"old.json": '{"old": 1}'},
        env=mpi_env({"CUDAMPI_CACHE_DIR": str(tmp_path / "cache")}),
    )
    _clean(found, proc)
    assert set(found) == {"old.json"} and found["old.json"] == '{"old": 1}'
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"--save-json '{full / 'report.json'}' was not written: {NO_SPACE}" in proc.stderr
    assert proc.stdout.startswith("cudampi doctor") and "-> exit 0" in proc.stdout


def test_a_report_to_a_full_standard_output_is_said_not_a_traceback(tmp_path):
    import subprocess

    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [*CLI, "doctor", "--no-runtime", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=mpi_env({"CUDAMPI_CACHE_DIR": str(tmp_path / "cache")}),
        )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"could not be written to standard output: {NO_SPACE}" in proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_env_write_leaves_no_empty_files(tmp_path):
    full = tmp_path / "full"
    proc, found = run_on_full_disk(
        [*CLI, "env", "write", "--out", str(full / "env")], full, env=mpi_env()
    )
    _clean(found, proc)
    assert proc.returncode != 0 and f"cannot write '{full / 'env'}" in proc.stderr
    assert NO_SPACE in proc.stderr


def test_bench_prints_its_results_when_its_json_file_cannot_be_written(tmp_path):
    full = tmp_path / "full"
    argv = [*mpiexec_argv(2), *CLI, "bench", "allreduce", "-b", "8", "-e", "64", "-n", "2"]
    argv += ["--paths", "host", "--device", "cpu", "--quiet", "--json", str(full / "b.json")]
    proc, found = run_on_full_disk(argv, full, env=mpi_env())
    _clean(found, proc)
    assert found == {}
    assert proc.returncode != 0
    assert f"--json '{full / 'b.json'}' cannot be written: {NO_SPACE}" in proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln.split()[:1] in (["8"], ["64"])]
    assert len(rows) == 2, proc.stdout  # the measured sizes are printed all the same


def test_the_cache_keeps_its_old_entries_when_the_doctor_cannot_save(tmp_path):
    full = tmp_path / "full"
    old = json.dumps({"k@h": {"key": "k"}})
    proc, found = run_on_full_disk(
        [*CLI, "doctor", "--json"],
        full,
        seed={"cache/capabilities.json": old},
        env=mpi_env({"CUDAMPI_CACHE_DIR": str(full / "cache")}),
    )
    _clean(found, proc)
    assert found["cache/capabilities.json"] == old
    cache = next(c for c in json.loads(proc.stdout)["checks"] if c["name"] == "capabilities cache")
    assert cache["status"] == "warn" and NO_SPACE in cache["detail"], cache


def test_a_trace_that_cannot_be_written_is_said_and_leaves_no_empty_file(tmp_path):
    full = tmp_path / "full"
    program = (
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from cudampi.comm import Communicator\n"
        "with Communicator(MPI.COMM_WORLD) as c:\n"
        "    c.allreduce(np.ones(4))\n"
        "print('ran', flush=True)\n"
    )
    argv = [*mpiexec_argv(2), sys.executable, "-c", program]
    proc, found = run_on_full_disk(
        argv, full, env=mpi_env({"CUDAMPI_TRACE": str(full / "trace")}), cwd=ROOT
    )
    _clean(found, proc)
    assert found == {} and proc.stdout.count("ran") == 2, proc.stdout + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"cudampi: rank {rank} on " in proc.stderr, proc.stderr[-3000:]
    assert f"could not write its trace {full / 'trace'}" in proc.stderr
    assert NO_SPACE in proc.stderr and "calls are not saved" in proc.stderr
