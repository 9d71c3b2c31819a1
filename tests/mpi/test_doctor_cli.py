"""`cudampi doctor` for real: child processes, real mpiexec jobs, real MPI installs.

The mismatch and MPICH scenarios use the real PyPI ``mpich`` wheel installed into a temporary
prefix, the UCX recipe the real ``libucx-cu13`` wheel (its CUDA transports cannot load without
a GPU, which the doctor must say).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from cudampi.doctor.render import REPORT_SCHEMA
from tests.conftest import HAS_CUDA, cudampi_cli
from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def _doctor(*args: str, env: dict[str, str] | None = None, timeout: float = 240):
    proc = cudampi_cli("doctor", *args, env=env, timeout=timeout)
    return proc


def _json(proc) -> dict:
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"not JSON (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        ) from None


def _check(doc: dict, name: str) -> dict:
    for c in doc["checks"]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no check {name!r} in {[c['name'] for c in doc['checks']]}")


MACHINE_CHECKS = ("/dev/shm",)
"""Checks of what other jobs left on the machine (stale MPI segments in /dev/shm), not of the
stack under test: they may warn on a shared machine, so tests about the stack leave them out."""


def _stack_warnings(doc: dict) -> list[dict]:
    return [c for c in doc["checks"] if c["status"] == "warn" and c["name"] not in MACHINE_CHECKS]


def _without_machine_checks(lines: list[str]) -> list[str]:
    """The text report's lines less those of :data:`MACHINE_CHECKS` (a row and its wrapped
    detail and fix, indented under it)."""
    kept, skipping = [], False
    for line in lines:
        if line and not line[0].isspace():
            skipping = line.startswith(MACHINE_CHECKS)
        if not skipping:
            kept.append(line)
    return kept


def _pip_install(tmp: Path, spec: str, how: list[str]) -> Path:
    dest = tmp / "dest"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            *how,
            str(dest),
            spec,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.skip(
            f"cannot install {spec} from the package index here: {proc.stderr.strip()[-300:]}"
        )
    return dest


@pytest.fixture(scope="session")
def mpich_prefix(tmp_path_factory) -> Path:
    """A real MPICH 5.0.2 (the PyPI wheel) in its own prefix: bin/mpiexec, lib/libmpi.so.12."""
    prefix = _pip_install(tmp_path_factory.mktemp("mpich"), "mpich==5.0.2", ["--prefix"])
    assert (prefix / "bin" / "mpiexec").exists() and (prefix / "lib" / "libmpi.so.12").exists()
    return prefix


@pytest.fixture(scope="session")
def libucx_dir(tmp_path_factory) -> Path:
    """The real libucx-cu13 1.22.0 package folder."""
    target = _pip_install(tmp_path_factory.mktemp("ucx"), "libucx-cu13==1.22.0", ["--target"])
    return target / "libucx"


def rank_reads_the_cache(comm, cache_dir, expected_key):
    """In a rank launched like the probe: the key it computes finds the doctor's entry."""
    from mpi4py import MPI

    from cudampi.probe import capabilities

    key = capabilities.stack_key(MPI.Get_library_version(), os.environ)
    assert key == expected_key, (key, capabilities.stack_env())
    found = capabilities.lookup(cache_dir, MPI.Get_library_version(), os.environ)
    caps = found.entry
    assert caps is not None, found.note
    assert caps.device_p2p.status == "skipped" and not caps.device_p2p.ok


@pytest.mark.skipif(
    HAS_CUDA, reason="with a GPU the device rows run: see tests/gpu/test_doctor_gpu.py"
)
def test_doctor_json_on_the_wheels(isolated_cache):
    proc = _doctor("--json")
    doc = _json(proc)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert doc["exit_code"] == 0 and doc["summary"]["fail"] == 0
    jsonschema.validate(doc, REPORT_SCHEMA)
    assert sum(doc["summary"].values()) == len(doc["checks"])
    for c in doc["checks"]:
        assert set(c) == {"name", "section", "status", "detail", "fix"}
        assert c["status"] in ("ok", "warn", "fail", "n/a")
        assert c["status"] in ("ok", "n/a") or c["fix"], c  # every warning says what to do
    assert _check(doc, "MPI library")["status"] == "ok"
    assert "Open MPI 5.0.11" in _check(doc, "MPI library")["detail"]
    for name in ("host p2p", "host allreduce"):
        c = _check(doc, name)
        assert c["status"] == "ok" and c["detail"].startswith("2 ranks, correct data"), c
    probes = doc["data"]["runtime"]["probes"]
    assert probes["host_p2p"]["report"]["size"] == 2
    assert probes["host_p2p"]["report"]["ok"] is True and probes["host_p2p"]["gbps"] > 0
    # no GPU here: device probes are n/a, not failures, and the MPI is honestly not CUDA-aware
    for name in ("device p2p", "device allreduce", "host-staged allreduce", "GPUs"):
        assert _check(doc, name)["status"] == "n/a"
    # ... and with no GPU, nothing about CUDA is a warning; --json keeps every detail and fix
    assert doc["data"]["no_gpu"] is True and _stack_warnings(doc) == []
    build = _check(doc, "CUDA build")
    assert build["status"] == "n/a" and "built_with_cuda_support=false" in build["detail"]
    assert "MPIX_Query_cuda_support()=0 in a rank" in build["detail"]
    aware = _check(doc, "CUDA-aware MPI")
    assert aware["status"] == "n/a" and aware["detail"].startswith("no")
    assert "libucx-cu13" in aware["fix"] and "conda-forge" in aware["fix"]
    # the cache entry is where a rank launched the same way will look for it
    caps = doc["data"]["capabilities"]
    assert caps is not None and caps["device_p2p"]["status"] == "skipped"
    key = doc["data"]["cache"]["keys"][0]
    assert Path(doc["data"]["cache"]["path"]) == isolated_cache / "capabilities.json"
    run_mpi(2, __file__, "rank_reads_the_cache", str(isolated_cache), key)


def test_doctor_text_no_runtime(isolated_cache, tmp_path):
    proc = _doctor("--no-runtime", "--save-json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("cudampi doctor")
    assert "host p2p" in out and "skipped (--no-runtime)" in out
    assert "-> exit 0" in out.splitlines()[-1]
    assert not (isolated_cache / "capabilities.json").exists()  # nothing probed, nothing cached
    saved = json.loads((tmp_path / "r.json").read_text())  # the same report, as JSON
    assert [c["name"] for c in saved["checks"]][:3] == ["python", "mpi4py", "MPI library"]
    folded = saved["data"]["no_gpu"]  # without a GPU the GPU-only rows fold into one line
    for c in saved["checks"]:
        assert c["name"] in out or (folded and c["status"] == "n/a"), c["name"]


def test_mpirun_on_path_is_a_different_mpi(mpich_prefix, isolated_cache):
    env = {"PATH": f"{mpich_prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = _doctor("--no-runtime", "--json", "-x", "UCX_TLS=tcp,self", env=env)
    doc = _json(proc)
    assert proc.returncode == 1
    c = _check(doc, "mpirun on PATH")
    assert c["status"] == "fail"
    assert (
        f"{mpich_prefix}/bin/mpirun is MPICH 5.0.2 but mpi4py loads Open MPI 5.0.11" in c["detail"]
    )
    beside = Path(sys.executable).parent / "mpiexec"
    assert f"launch with {beside}" in c["fix"]
    assert f"MPI4PY_LIBMPI={mpich_prefix}/lib/libmpi.so" in c["fix"]
    inst = _check(doc, "MPI installations")
    assert "MPICH 5.0.2" in inst["detail"] and "Open MPI 5.0.11" in inst["detail"]
    # -x UCX_TLS=tcp,self reaches the ranks: flagged (warn without a GPU)
    s = _check(doc, "MPI/UCX/NCCL settings")
    assert s["status"] in ("warn", "fail") and "UCX_TLS" in s["detail"]


def test_mpi4py_on_mpich_is_probed_with_its_own_hydra(mpich_prefix, isolated_cache):
    # A user who switches mpi4py to MPICH puts MPICH's bin first on PATH too; with the Open MPI
    # venv's mpirun first instead (an activated venv), "mpirun on PATH" rightly fails.
    env = {
        "MPI4PY_LIBMPI": str(mpich_prefix / "lib" / "libmpi.so.12"),
        "PATH": os.pathsep.join([str(mpich_prefix / "bin"), os.environ.get("PATH", "")]),
    }
    doc = _json(proc := _doctor("--json", env=env))
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert proc.returncode == 0, failed
    assert "MPICH 5.0.2" in _check(doc, "MPI library")["detail"]
    assert _check(doc, "probe launcher")["detail"].startswith(str(mpich_prefix / "bin" / "mpiexec"))
    for name in ("host p2p", "host allreduce"):
        assert _check(doc, name)["status"] == "ok"
    assert "configured without CUDA" in _check(doc, "CUDA build")["detail"]
    assert doc["data"]["capabilities"]["mpi_library"].startswith("MPICH Version:")


def test_pml_ucx_that_cannot_be_selected_is_reported(isolated_cache):
    doc = _json(proc := _doctor("--json", "--mca", "pml", "ucx"))
    assert proc.returncode == 1
    c = _check(doc, "host p2p")
    assert c["status"] == "fail"
    assert "no usable PML" in c["detail"] and "pml_ucx_tls any" in c["fix"]
    assert _check(doc, "capabilities cache")["status"] == "warn"  # nothing proven, nothing saved


def test_preload_ucx_recipe(libucx_dir, isolated_cache):
    doc = _json(
        proc := _doctor(
            "--json",
            "--preload-ucx",
            str(libucx_dir),
            # no InfiniBand and no GPU here: pml ucx accepts only shm/tcp when told so
            "--mca",
            "pml_ucx_tls",
            "any",
            "--mca",
            "pml_ucx_devices",
            "any",
        )
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    for name in ("host p2p", "host allreduce"):
        assert _check(doc, name)["status"] == "ok"
    ucx = _check(doc, "UCX transports")
    assert "libucx wheel UCX 1.22.0" in ucx["detail"]
    assert "built with CUDA, but cuda_copy/cuda_ipc not loaded" in ucx["detail"]
    argv = doc["data"]["runtime"]["probes"]["host_p2p"]["argv"]
    assert argv[argv.index("pml") - 1 : argv.index("pml") + 2] == ["--mca", "pml", "ucx"]
    env = doc["data"]["capabilities"]["env"]  # as the ranks saw it
    assert env["LD_PRELOAD"].split(":")[0] == str(libucx_dir / "lib" / "libucs.so.0")
    assert env["UCX_MODULE_DIR"] == str(libucx_dir / "lib" / "ucx")
    assert env["OMPI_MCA_pml"] == "ucx"


def test_a_hung_probe_is_reported_not_waited_for(isolated_cache):
    doc = _json(proc := _doctor("--json", "--timeout", "0.5"))
    assert proc.returncode == 1
    c = _check(doc, "host p2p")
    assert c["status"] == "fail" and c["detail"].startswith("timeout: hung")


@pytest.mark.parametrize(
    "args, message",
    [
        (["-x", "NOEQUALS"], "expected VAR=VALUE"),
        (["--ranks", "1"], "--ranks must be at least 2"),
        (["--preload-ucx", "/nonexistent"], "no lib/libucp.so.0 there"),
        (["--size", "lots"], "expected a size"),
    ],
)
def test_usage_errors_exit_2(args, message):
    proc = _doctor(*args, "--no-runtime")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


def rank_sees_its_launcher(comm):
    from cudampi.rankenv import launched_by

    info = launched_by(os.environ)
    assert info.name in ("openmpi", "mpich"), info
    assert (info.rank, info.size) == (comm.rank, comm.size)
    assert info.local_rank == comm.rank  # one host


@pytest.mark.parametrize("n", [2, 4])
def test_launcher_detected_in_real_ranks(n):
    run_mpi(n, __file__, "rank_sees_its_launcher")


def test_doctor_started_on_two_ranks_reports_once(isolated_cache):
    from tests.mpirun import mpi_env, mpiexec_argv, run_launched

    argv = [*mpiexec_argv(2), sys.executable, "-m", "cudampi", "doctor", "--no-runtime", "--json"]
    proc = run_launched(argv, mpi_env(), 240, "doctor")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # one document: only rank 0 printed
    c = _check(doc, "launcher")
    assert c["status"] == "ok"
    assert c["detail"].startswith(("openmpi: rank 0 of 2", "mpich: rank 0 of 2"))
    # the launcher's own OMPI_MCA_* variables are not mistaken for user settings
    assert "OMPI_MCA_PREFIXES" not in _check(doc, "MPI/UCX/NCCL settings")["detail"]


def test_probe_launcher_of_another_mpi_is_caught(mpich_prefix, isolated_cache):
    # --mpiexec of MPICH while mpi4py loads Open MPI: each rank would be a world of 1
    doc = _json(proc := _doctor("--json", "--mpiexec", str(mpich_prefix / "bin" / "mpiexec")))
    assert proc.returncode == 1
    launcher = _check(doc, "probe launcher")
    assert (
        launcher["status"] == "fail"
        and "is MPICH 5.0.2 but mpi4py loads Open MPI" in launcher["detail"]
    )
    p2p = _check(doc, "host p2p")
    assert p2p["status"] == "fail" and "world of 1 rank" in p2p["detail"], p2p


def test_four_probe_ranks(isolated_cache):
    doc = _json(proc := _doctor("--json", "--ranks", "4", "--size", "1M"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name in ("host p2p", "host allreduce"):
        c = _check(doc, name)
        assert c["status"] == "ok" and c["detail"].startswith("4 ranks, correct data"), c
    assert doc["data"]["runtime"]["probes"]["host_allreduce"]["report"]["size"] == 4


@pytest.mark.skipif(HAS_CUDA, reason="the one-line GPU summary is for machines without a GPU")
def test_without_a_gpu_the_text_report_has_one_short_gpu_line(isolated_cache):
    proc = _doctor("--no-runtime")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = _without_machine_checks(proc.stdout.splitlines())
    gpu = [ln for ln in lines if ln.startswith("GPU ")]
    assert len(gpu) == 1 and "none here: host buffers only" in gpu[0], lines
    for name in ("CUDA-aware MPI", "UCX transports", "GPUDirect RDMA", "device p2p"):
        assert not any(ln.startswith(name) for ln in lines), name
    assert "fix: (1) PyPI wheels" not in proc.stdout  # no GPU recipes for a machine without one
    assert len(lines) < 40, "\n".join(lines)


def test_progress_lines_on_a_terminal(isolated_cache):
    """One line per probe on stderr while it works, when stderr is a terminal; none in a pipe."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cudampi", "doctor", "--json"],
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "CUDAMPI_CACHE_DIR": str(isolated_cache)},
    )
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=240)
    os.close(master)
    assert proc.returncode == 0, seen.decode(errors="replace")
    progress = [ln for ln in seen.decode().splitlines() if "doctor [" in ln]
    assert any("probing the MPI library mpi4py loads" in ln for ln in progress), progress
    assert any("probing host point-to-point, 2 ranks" in ln for ln in progress), progress
    assert any("probing host allreduce, 2 ranks" in ln for ln in progress), progress
    json.loads(out)  # stdout is still the report alone
    piped = _doctor("--no-runtime")
    assert "doctor [" not in piped.stderr


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--timeout", "nan"], {}, "argument --timeout: expected a positive, finite number"),
        (["--timeout", "0"], {}, "argument --timeout: expected a positive, finite number"),
        ([], {"CUDAMPI_PROBE_TIMEOUT": "inf"}, "CUDAMPI_PROBE_TIMEOUT='inf': expected a positive"),
        ([], {"CUDAMPI_PROBE_TIMEOUT": "-3"}, "CUDAMPI_PROBE_TIMEOUT='-3': expected a positive"),
    ],
)
def test_a_bad_timeout_is_a_usage_error_and_starts_nothing(isolated_cache, args, env, words):
    """A bad --timeout is a usage error (exit 2) that names the flag, and starts nothing."""
    proc = _doctor("--json", *args, env=env, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_no_home_is_named_as_the_cause(isolated_cache):
    """Open MPI cannot start without HOME; the doctor says so."""
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    proc = subprocess.run(
        [sys.executable, "-m", "cudampi", "doctor", "--json", "--no-runtime"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    home = _check(_json(proc), "HOME")
    assert home["status"] == "fail" and "Open MPI cannot start without it" in home["detail"]
    assert home["fix"].startswith("export HOME=")


@pytest.mark.skipif(HAS_CUDA, reason="the device probes make this run long on a GPU machine")
def test_a_cache_folder_that_cannot_be_made_is_a_warning(tmp_path):
    """The doctor reports it instead of a traceback."""
    (tmp_path / "file").write_text("")
    proc = _doctor("--json", env={"CUDAMPI_CACHE_DIR": str(tmp_path / "file" / "cache")})
    cache = _check(_json(proc), "capabilities cache")
    assert cache["status"] == "warn" and "not saved: cannot write" in cache["detail"], cache
    assert "--cache-dir" in cache["fix"] and "Traceback" not in proc.stderr
