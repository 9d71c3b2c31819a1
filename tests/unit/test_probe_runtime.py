"""The runtime probe's pure parts on real outputs: the H200 probe.log (segfaults in btl vader,
btl sm and coll base, MPICH's process_vm_readv error, PML ucx not selectable), the launch
fixtures, and the argv/env/staging logic."""

from __future__ import annotations

import re

import pytest

from cudampi.probe.runtime import (
    ProbeSpec,
    classify,
    mpiexec_argv,
    parse_probe_failure,
    ranks_env,
    staging_verdict,
)


@pytest.fixture(scope="module")
def runs(fixtures_dir):
    """probe.log split into (section title, command output, rc) triples, in order."""
    log = (fixtures_dir / "device-h200-1gpu" / "probe.log").read_text()
    out = []
    for sec in re.split(r"^=== ", log, flags=re.M)[1:]:
        title = sec.splitlines()[0]
        parts = re.split(r"^rc=(\d+)\n", sec, flags=re.M)
        for i in range(0, len(parts) - 1, 2):
            out.append((title, parts[i], int(parts[i + 1])))
    return out


def _only(runs, title, rc=None):
    found = [(body, code) for t, body, code in runs if t == title and (rc is None or code == rc)]
    return found


def test_system_open_mpi_device_send_segfaults_in_btl_vader(runs):
    body, rc = _only(runs, "debian openmpi device test")[0]
    assert rc == 139
    f = parse_probe_failure(body)
    assert f is not None
    assert (f.kind, f.where, f.call, f.signal) == (
        "segfault",
        "btl vader",
        "MPI_Send",
        "Segmentation fault",
    )
    assert f.summary == "MPI_Send segfaults in btl vader"
    outcome, _, _ = classify("device_p2p", rc, "", body)
    assert outcome.status == "crash"
    assert "MPI_Send segfaults in btl vader" in outcome.detail
    assert "no CUDA support" in outcome.detail


def test_system_open_mpi_device_allreduce_segfaults_in_coll_base(runs):
    body, rc = _only(runs, "debian openmpi device test")[1]
    f = parse_probe_failure(body)
    assert f is not None and (f.kind, f.where, f.call) == (
        "segfault",
        "coll base allreduce",
        "MPI_Allreduce",
    )
    outcome, _, _ = classify("device_allreduce", rc, "", body)
    assert outcome.status == "crash" and "reduces on the CPU" in outcome.detail


def test_system_open_mpi_pml_ucx_not_selectable(runs):
    body, rc = _only(runs, "debian openmpi device test", 1)[0]
    f = parse_probe_failure(body)
    assert f is not None and f.kind == "pml-unavailable" and f.where == "pml ucx"
    outcome, _, _ = classify("host_p2p", rc, "", body)
    assert outcome.status == "error" and "PML ucx cannot be selected" in outcome.detail


def test_host_runs_that_passed_are_not_failures(runs):
    passed = _only(runs, "debian openmpi device test", 0)
    assert len(passed) == 2
    for body, _ in passed:
        assert parse_probe_failure(body) is None


def test_pypi_open_mpi_alone_segfaults_in_btl_sm(runs):
    body, rc = _only(runs, "openmpi sendrecv default")[0]
    f = parse_probe_failure(body)
    assert f is not None and (f.kind, f.where, f.call) == ("segfault", "btl sm", "MPI_Send")
    assert classify("device_p2p", rc, "", body)[0].status == "crash"


def test_pypi_open_mpi_with_cuda_ucx(runs):
    [(ok_body, ok_rc)] = _only(runs, "openmpi sendrecv ucx-cuda preload")
    assert ok_rc == 0 and parse_probe_failure(ok_body) is None
    [(bad, rc)] = _only(runs, "openmpi allreduce ucx-cuda preload")
    f = parse_probe_failure(bad)
    assert f is not None and (f.where, f.call) == ("coll base allreduce", "MPI_Allreduce")
    assert classify("device_allreduce", rc, "", bad)[0].status == "crash"


def test_mpich_device_recv_is_a_clean_error_then_a_hang(runs):
    for title in ("mpich sendrecv default", "mpich sendrecv ucx-cuda"):
        [(body, rc)] = _only(runs, title)
        assert rc == 124  # timeout(1) killed the job: the other rank hung
        f = parse_probe_failure(body)
        assert f is not None
        assert (f.kind, f.where, f.call) == (
            "mpi-error",
            "CMA (process_vm_readv errno 14)",
            "MPI_Recv",
        )
        outcome, _, _ = classify("device_p2p", None, "", body, timed_out=True)
        assert outcome.status == "timeout"
        assert "process_vm_readv" in outcome.detail and "not CUDA-aware" in outcome.detail
        # the same output without the hang is an error, not a crash
        assert classify("device_p2p", 1, "", body)[0].status == "error"


def test_launch_fixtures(fixtures_dir):
    d = fixtures_dir / "launch"
    segv = parse_probe_failure((d / "openmpi-segv.txt").read_text())
    assert segv is not None and segv.kind == "segfault" and segv.signal == "Segmentation fault"
    kill = parse_probe_failure((d / "mpich-kill.txt").read_text())
    assert kill is not None and kill.kind == "signal" and kill.signal == "Killed"
    okill = parse_probe_failure((d / "openmpi-kill.txt").read_text())
    assert okill is not None and okill.kind == "signal"
    assert classify("host_p2p", 137, "", (d / "openmpi-kill.txt").read_text())[0].status == "crash"


def test_classify_uses_the_rank_report():
    good = 'CUDAMPI_PROBE {"test": "host_p2p", "ok": true, "gbps": 2.5}\n'
    o, f, rep = classify("host_p2p", 0, good, "")
    assert (o.status, o.gbps, f) == ("ok", 2.5, None) and rep is not None and rep["ok"] is True
    wrong = 'CUDAMPI_PROBE {"test": "device_p2p", "ok": false, "gbps": 9.0}\n'
    assert classify("device_p2p", 0, wrong, "")[0].status == "wrong"
    # exit 0 without a report is not a pass
    assert classify("host_p2p", 0, "", "")[0].status == "error"


def test_mpiexec_argv_open_mpi_and_mpich():
    spec = ProbeSpec(
        "/x/bin/mpiexec",
        "/x/bin/python",
        "Open MPI",
        (("pml", "ucx"),),
        (("LD_PRELOAD", "/u/libucs.so.0"),),
        nbytes=1024,
        ranks=2,
        iters=3,
    )
    argv = mpiexec_argv(spec, "device_p2p", "cupy")
    assert argv == [
        "/x/bin/mpiexec",
        "-n",
        "2",
        "--oversubscribe",
        "--bind-to",
        "none",
        "--mca",
        "pml",
        "ucx",
        "-x",
        "LD_PRELOAD=/u/libucs.so.0",
        "/x/bin/python",
        "-m",
        "cudampi.probe.worker",
        "device_p2p",
        "1024",
        "cupy",
        "3",
    ]
    mp = ProbeSpec("/m/bin/mpiexec", "/m/bin/python", "MPICH", (), (("MPIR_CVAR_ENABLE_GPU", "1"),))
    assert mpiexec_argv(mp, "host_p2p", None)[:6] == [
        "/m/bin/mpiexec",
        "-n",
        "2",
        "-genv",
        "MPIR_CVAR_ENABLE_GPU",
        "1",
    ]
    with pytest.raises(ValueError, match="Open MPI setting"):
        mpiexec_argv(ProbeSpec("/m", vendor="MPICH", mca=(("pml", "ucx"),)), "host_p2p", None)
    assert mpiexec_argv(spec, "copy", "torch")[0] == "/x/bin/python"  # no MPI for the copy test


def test_ranks_env_is_what_the_ranks_see():
    spec = ProbeSpec(
        "/x/mpiexec", vendor="Open MPI", mca=(("pml", "ucx"),), exports=(("UCX_TLS", "all"),)
    )
    env = ranks_env(spec, {"PATH": "/bin", "PMIX_RANK": "0", "OMPI_COMM_WORLD_RANK": "0"})
    assert env == {"PATH": "/bin", "OMPI_MCA_pml": "ucx", "UCX_TLS": "all"}


def test_staging_verdict():
    assert staging_verdict(891.8, 50.0) is False  # cuda_ipc on the H200: far above a host copy
    assert staging_verdict(1.0, 25.0) is True  # no faster than one pinned copy: staged
    assert staging_verdict(None, 25.0) is None and staging_verdict(3.0, None) is None


def test_only_a_launcher_that_never_started_is_worth_a_retry():
    from cudampi.mpiexec import launcher_never_started

    pmix = (
        "--------------------------------------------------------------------------\n"
        "The PMIx server's listener thread failed to start. We cannot\ncontinue.\n"
    )
    assert launcher_never_started(213, pmix)
    assert not launcher_never_started(0, pmix)
    assert not launcher_never_started(139, "Segmentation fault (11)")
    assert not launcher_never_started(None, pmix)
