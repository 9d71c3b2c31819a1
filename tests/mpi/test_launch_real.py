"""Real launches through ``cudampi launch`` (the PyPI Open MPI here): 1, 2, 4 ranks, the
selftest, every kind of rank failure, Ctrl-C, --dry-run's argv run by hand, raw flags."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpirun import MPICH_PYTHON, MPICH_SKIP

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[2]
TARGET = str(Path(__file__).with_name("_launch_target.py"))
HOST = socket.gethostname()


def launch(
    *args: str,
    timeout: float = 120,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        **(env or {}),
    }
    return subprocess.run(
        [python, "-m", "cudampi", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        cwd=ROOT,
    )


@pytest.mark.parametrize("n", [1, 2, 4])
def test_launch_runs_n_ranks_with_the_torch_env(n):
    p = launch("-n", str(n), TARGET, "check", str(n), "--flag", "a b")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "cudampi launch:" not in p.stderr  # no note: the job ended by itself
    assert f"OK {n}" in p.stdout
    for r in range(n):
        assert f"rank {r} ok on {HOST} ifname=lo" in p.stdout


def test_selftest_passes_on_two_ranks():
    p = launch("-n", "2", "-m", "cudampi.selftest")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("cudampi ") and "2 rank(s) on 1 host(s) via openmpi" in lines[0]
    assert "ok  mpi4py host Allreduce sum int64" in p.stdout
    assert lines[-1].startswith("selftest: PASS")
    assert p.stdout.count("selftest:") == 1  # only rank 0 prints


def test_module_mode_and_raw_launcher_flags():
    p = launch(
        "-n",
        "2",
        "-m",
        "tests.mpi._launch_target",
        "check",
        "2",
        "--flag",
        "a b",
        "--",
        "--tag-output",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[1,1]<stdout>: rank 1 ok" in p.stdout  # --tag-output reached mpirun


@pytest.mark.parametrize(
    ("mode", "code", "words"),
    [
        (
            ["raise", "1"],
            1,
            [
                "rank 1 on host {h} exited with code 1",
                "ValueError: planted failure on rank 1",
                "_launch_target.py",
            ],
        ),
        (
            ["deep", "1"],
            1,
            [
                "json.decoder.JSONDecodeError: Expecting property name",
                '_launch_target.py", line',
                "in parse_config",
                "return json.loads(text)  # the user's line the summary must keep",
            ],
        ),
        (
            ["exit", "1", "3"],
            3,
            ["rank 1 on host {h} exited with code 3", "SystemExit: exited with code 3"],
        ),
        (["kill", "0"], 137, ["rank 0 on host {h} was killed by signal 9 (SIGKILL)"]),
        (
            ["segv", "1"],
            139,
            [
                "rank 1 on host {h} was killed by signal 11 (SIGSEGV)",
                "Fatal Python error: Segmentation fault",
            ],
        ),
    ],
    ids=["raise", "deep", "exit", "kill", "segv"],
)
def test_a_failing_rank_ends_the_job_with_a_summary(mode, code, words):
    start = time.monotonic()
    p = launch("-n", "2", TARGET, *mode)
    assert time.monotonic() - start < 20, "the other rank was not stopped (it sleeps 20 s)"
    assert p.returncode == code, p.stdout + p.stderr
    summary = p.stderr[p.stderr.index("cudampi launch: the job failed") :]
    for w in words:
        assert w.format(h=HOST) in summary, summary
    assert "[cudampi-fault" not in p.stderr  # tagged lines are for the supervisor only


def test_json_result_of_a_failed_job():
    p = launch("-n", "2", "--json", TARGET, "exit", "0", "5")
    assert p.returncode == 5
    assert "{" not in p.stdout  # the JSON goes to stderr, never among the ranks' stdout
    res = json.loads(p.stderr[p.stderr.index("\n{\n") + 1 :])
    assert res["ok"] is False and res["failures"][0]["rank"] == 0
    assert res["failures"][0]["host"] == HOST and res["failures"][0]["exit_code"] == 5


def test_ctrl_c_stops_every_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    sup = subprocess.Popen(
        [sys.executable, "-m", "cudampi", "launch", "-n", "3", TARGET, "sleep", str(tmp_path)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 3:
        assert sup.poll() is None and time.monotonic() < deadline, sup.communicate()
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert all(_alive(pid) for pid in pids)
    sup.send_signal(signal.SIGINT)
    _out, err = sup.communicate(timeout=30)
    assert sup.returncode == 130, err
    assert "interrupted (Ctrl-C): every rank was stopped" in err
    time.sleep(0.3)
    assert [pid for pid in pids if _alive(pid)] == []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_dry_run_prints_the_exact_command_and_running_it_works():
    p = launch("-n", "2", "--dry-run", TARGET, "check", "2", "--flag", "a b")
    assert p.returncode == 0, p.stderr
    line = [ln for ln in p.stdout.splitlines() if not ln.startswith("#")][-1]
    words = shlex.split(line)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    while "=" in words[0] and not words[0].startswith("/"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    assert words[0].endswith("mpiexec") and words[1:3] == ["-n", "2"]
    assert words[-7:] == ["-m", "cudampi.launch.rank", TARGET, "check", "2", "--flag", "a b"]
    run = subprocess.run(words, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK 2" in run.stdout
    four = launch("-n", "4", "--dry-run", "--json", TARGET)
    plan = json.loads(four.stdout)
    cores = os.cpu_count() or 1
    assert ("--oversubscribe" in plan["command"]["argv"]) == (cores < 4)


def test_an_unresolvable_host_is_named_before_anything_starts():
    p = launch("-n", "2", "--hosts", "localhost:1,nosuchhost.invalid:1", TARGET, "check", "2")
    assert p.returncode == 1
    assert "host 'nosuchhost.invalid' cannot be reached" in p.stderr


def test_usage_errors_exit_2():
    p = launch("-n", "2", "no_such_script.py")
    assert p.returncode == 2 and "neither a script nor a program" in p.stderr
    p = launch("-n", "2", "--launcher", "lamrun", TARGET)
    assert p.returncode == 2 and "--launcher 'lamrun'" in p.stderr


MPICH_PY = str(MPICH_PYTHON)


@pytest.mark.skipif(not Path(MPICH_PY).exists(), reason=MPICH_SKIP)
def test_mpich_hydra_launch_and_fault():
    """... and the MPICH segment of the ranks Hydra killed is not left in /dev/shm (each holds
    2-3 MiB of a tmpfs containers cap at 64 MiB; Hydra removes none)."""
    p = launch("-n", "2", TARGET, "check", "2", "--flag", "a b", python=MPICH_PY)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout
    p = launch("-n", "2", "--grace", "1", TARGET, "raise", "1", python=MPICH_PY)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"rank 1 on host {HOST} exited with code 1" in p.stderr
    assert "rank 0" not in p.stderr.split("the job failed")[1]  # stopped, not failed
    p = launch("-n", "2", "--grace", "1", TARGET, "mpi-kill", "1", python=MPICH_PY)
    # Hydra names one process per host that did not exit by itself, the first by rank: rank 1
    # (it killed itself), or rank 0 where Hydra's SIGKILL of the others reached it before it
    # saw its peer gone and exited (seen on a loaded machine)
    killed = re.findall(rf"rank ([01]) on host {HOST} was killed by signal 9 \(SIGKILL\)", p.stderr)
    assert p.returncode != 0 and len(killed) == 1, p.stderr
    # this job's segments, as its rank 0 mapped them (other jobs on the machine have theirs)
    line = next((ln for ln in p.stdout.splitlines() if "SEGMENTS" in ln), "")
    segments = line.split("SEGMENTS", 1)[-1].split()
    assert segments, p.stdout + p.stderr
    assert [s for s in segments if os.path.exists(s)] == []


def test_timeout_stops_the_job(tmp_path):
    start = time.monotonic()
    p = launch("-n", "2", "--timeout", "3", TARGET, "sleep", str(tmp_path))
    assert p.returncode == 124, p.stdout + p.stderr
    assert time.monotonic() - start < 30
    assert "stopped after --timeout 3 s" in p.stderr
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not [pid for pid in pids if _alive(pid)]


def rank_init_under_plain_mpiexec(comm, n):
    """cudampi.init() in a rank started by mpiexec itself (no cudampi launch, no bootstrap)."""
    import cudampi

    assert "RANK" not in os.environ and "LOCAL_RANK" not in os.environ
    info = cudampi.init()
    assert (info.rank, info.world_size, info.launcher) == (comm.rank, int(n), "openmpi")
    assert os.environ["RANK"] == str(comm.rank) and os.environ["WORLD_SIZE"] == n
    ports = comm.allgather((info.master_addr, info.master_port, os.environ["MASTER_PORT"]))
    assert len(set(ports)) == 1 and ports[0][0] == "127.0.0.1", ports
    assert cudampi.init() is info  # idempotent


@pytest.mark.parametrize("n", [1, 2])
def test_init_under_plain_mpiexec(n):
    from tests.mpirun import run_mpi

    run_mpi(n, __file__, "rank_init_under_plain_mpiexec", str(n))


def test_report_like_output_does_not_end_a_healthy_job():
    """The fault channel is not forgeable from ordinary output."""
    start = time.monotonic()
    p = launch("-n", "2", "--grace", "1", TARGET, "forge")
    assert p.returncode == 0, p.stdout + p.stderr
    assert time.monotonic() - start < 30
    assert "rank=7 code=3] ValueError: from an old log" in p.stdout  # passed through as output
    assert p.stderr.count("ValueError: from an old log") == 2
    assert "cudampi launch:" not in p.stderr


def test_a_launcher_that_starts_no_rank_is_a_failure():
    """Raw flags that make mpiexec print its version and exit 0."""
    p = launch("-n", "2", TARGET, "check", "2", "--", "--version")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "started none of the 2 ranks" in p.stderr


def _fake_launcher(tmp_path: Path, after: str = "exec sleep 300") -> str:
    """The real mpiexec, then a launcher that never exits (prterun hanging after its ranks), or
    that runs ``after`` and exits with mpiexec's status."""
    real = Path(sys.executable).parent / "mpiexec"
    fake = tmp_path / "bin" / "mpiexec"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\n"{real}" "$@"\nrc=$?\ncase "$1" in --version|-V) exit $rc;; esac\n'
        f"{after}\nexit $rc\n"
    )
    fake.chmod(0o755)
    return str(fake)


def _flaky_launcher(tmp_path: Path, fails: int, message: str) -> str:
    """The real mpiexec, after ``fails`` starts that print ``message`` and exit 213 at once (as
    prterun does when its PMIx listener fails to start); each start is counted in ``starts``."""
    real = Path(sys.executable).parent / "mpiexec"
    fake = tmp_path / "bin" / "mpiexec"
    fake.parent.mkdir()
    count = tmp_path / "starts"
    fake.write_text(
        f'#!/bin/sh\ncase "$1" in --version|-V) exec "{real}" "$@";; esac\n'
        f'echo x >> "{count}"\n'
        f'if [ "$(wc -l < "{count}")" -le {fails} ]; then echo "{message}" >&2; exit 213; fi\n'
        f'exec "{real}" "$@"\n'
    )
    fake.chmod(0o755)
    return str(fake)


PMIX_LISTENER = "The PMIx server's listener thread failed to start. We cannot"


@pytest.mark.parametrize(
    ("fails", "message", "code", "starts"),
    [(1, PMIX_LISTENER, 0, 2), (5, PMIX_LISTENER, 213, 3), (1, "some other failure", 213, 1)],
    ids=["once", "every-time", "unknown-failure"],
)
def test_a_launcher_that_failed_to_start_is_started_again(tmp_path, fails, message, code, starts):
    """Open MPI's launcher sometimes fails before starting any rank ("The PMIx server's listener
    thread failed to start"; seen in CI here): cudampi launch starts it again, twice at most,
    and only for that known message."""
    launcher = _flaky_launcher(tmp_path, fails, message)
    p = launch("-n", "2", "--launcher", launcher, TARGET, "check", "2", "--flag", "a b")
    assert p.returncode == code, p.stdout + p.stderr
    assert len((tmp_path / "starts").read_text().split()) == starts
    again = "failed before it started any rank"
    assert (again in p.stderr) == (message == PMIX_LISTENER), p.stderr


@pytest.mark.parametrize(
    ("mode", "code", "words"),
    [
        (["kill", "1"], 137, "rank 1 on host {h} was killed by signal 9"),
        (["quit"], 1, "had not exited 2 s after every rank ended"),
        (["check", "2", "--flag", "a b"], 0, "note: Open MPI had not exited 2 s after every rank"),
    ],
    ids=["after-a-kill", "after-silent-ends", "after-success"],
)
def test_a_launcher_that_hangs_after_its_ranks_ended_is_stopped(tmp_path, mode, code, words):
    """prterun sometimes hangs once every rank has died (a rank that dies in C,
    in MPI_Init say, reports nothing itself: the launcher's own words must start the grace)."""
    start = time.monotonic()
    p = launch("-n", "2", "--grace", "2", "--launcher", _fake_launcher(tmp_path), TARGET, *mode)
    assert p.returncode == code, p.stdout + p.stderr
    assert words.format(h=HOST) in p.stderr
    assert time.monotonic() - start < 40


def test_a_launcher_that_exits_soon_after_its_ranks_gets_no_note(tmp_path):
    """A launcher seen alive after every rank had ended, that then exits on its own well
    within the grace, did not linger: no "had not exited" note (it came whenever the
    supervisor's poll landed between the ranks' end and the launcher's, about 2 runs in 8 of a
    GPU bench; here the launcher takes 1.5 s, so every poll lands there)."""
    start = time.monotonic()
    p = launch("-n", "2", "--launcher", _fake_launcher(tmp_path, "sleep 1.5"), TARGET, "env")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "cudampi launch:" not in p.stderr, p.stderr
    assert time.monotonic() - start < 30


def test_a_rank_in_its_exit_handlers_is_waited_for_and_named(tmp_path):
    """Every rank's script finished, then rank 1's atexit handler works for 6 s (an upload):
    after --grace the job says it waits for rank 1, in Python's exit, and lets the handler end
    (its file is written: nothing cut off); the job then ends by itself, status 0."""
    done = tmp_path / "done"
    start = time.monotonic()
    p = launch("-n", "2", "--grace", "2", TARGET, "stuck-exit", "1", "work", str(done), timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert done.read_text() == "done"
    note = p.stderr.split("cudampi launch: note: ", 1)[1]
    assert note.startswith("every rank finished its script 2 s ago and the job waits for: "), note
    assert "rank 1 (pid " in note and f" on host {HOST}) in Python's exit (a non-daemon" in note
    assert "cudampi launch waits for it (--timeout ends the job" in note
    assert "stopped the job" not in p.stderr and "rank 0 (pid" not in note, p.stderr
    assert 6 < time.monotonic() - start < 40


def test_a_rank_slow_to_tear_down_after_its_exit_handlers_gets_the_grace_from_then(tmp_path):
    """Rank 1's exit handler works 6 s, past --grace, then its teardown (interpreter
    finalisation, MPI_Finalize) takes 1.2 s more: the teardown's grace counts from when the
    rank left its handlers, not from when the scripts finished, so the job ends by itself
    instead of being stopped in the rank's MPI_Finalize."""
    done = tmp_path / "done"
    start = time.monotonic()
    p = launch(
        "-n", "2", "--grace", "3", TARGET, "stuck-exit", "1", "work", str(done), "1.2",
        timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert done.read_text() == "done"
    assert "waits for: rank 1 (pid " in p.stderr, p.stderr
    assert "stopped the job" not in p.stderr, p.stderr
    assert 7 < time.monotonic() - start < 40


def test_a_collective_at_exit_is_named_while_the_job_waits_for_the_timeout():
    """Rank 0's atexit handler calls a Barrier that rank 1, in MPI_Finalize, never joins: the
    job used to hang until --timeout, saying nothing of it. Now it says, after --grace, that
    it waits for rank 0 in Python's exit and that such a handler never ends; --timeout ends
    it."""
    start = time.monotonic()
    p = launch(
        "-n", "2", "--grace", "2", "--timeout", "12", TARGET, "stuck-exit", "0", "barrier",
        timeout=60,
    )  # fmt: skip
    assert p.returncode == 124, p.stdout + p.stderr
    note = p.stderr.split("cudampi launch: note: ", 1)[1]
    assert "rank 0 (pid " in note and ") in Python's exit (a non-daemon" in note, note
    assert "a collective or a barrier at exit" in note, note
    assert time.monotonic() - start < 40


def test_a_rank_stuck_past_its_exit_handlers_is_named_and_the_job_ends():
    """Rank 1 hangs in the C library's exit, after Python's exit handlers and MPI_Finalize
    (what a stuck MPI_Finalize or CUDA teardown looks like from here): nothing of the script
    can be lost there, so the job is stopped after --grace, status 0, and the note names it."""
    start = time.monotonic()
    p = launch("-n", "2", "--grace", "2", TARGET, "stuck-exit", "1", "pause", timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    note = p.stderr.split("cudampi launch: note: ", 1)[1]
    assert "every rank finished its script, but 2 s later the job had not ended" in note
    assert "rank 1 (pid " in note and f" on host {HOST}) past Python's exit handlers" in note
    assert "cudampi launch stopped the job (the scripts' results stand)" in note
    assert time.monotonic() - start < 40


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_sigkill_of_cudampi_launch_takes_the_launcher_and_every_rank_down(tmp_path, mpi):
    """No rank outlives its launcher, even when the supervisor gets -9."""
    python = sys.executable if mpi == "openmpi" else MPICH_PY
    if not Path(python).exists():
        pytest.skip(MPICH_SKIP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    sup = subprocess.Popen(
        [python, "-m", "cudampi", "launch", "-n", "2", TARGET, "sleep", str(tmp_path)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert sup.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        launcher = _children(sup.pid)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")] + launcher
        assert launcher and all(_alive(pid) for pid in pids)
        sup.kill()
        sup.wait()
        deadline = time.monotonic() + 10
        while [pid for pid in pids if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if _alive(pid)] == [], "left running after kill -9"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _remove_workdir_of(pids)


def _remove_workdir_of(pids: list[int]) -> None:
    """The work folder a killed ``cudampi launch`` could not remove (nothing runs after -9):
    the one whose rank reports name these ranks' pids, so no other job's folder is touched."""
    import shutil
    import tempfile

    for folder in Path(tempfile.gettempdir()).glob("cudampi-launch-*"):
        said = " ".join(p.read_text() for p in folder.glob("reports/rank-*.fault"))
        if any(f"pid={pid}" in said.split() for pid in pids):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--timeout", "0"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
        (["--grace", "-1"], "--grace"),
        (["--master-port", "0"], "--master-port"),
        (["--master-port", "70000"], "--master-port"),
        (["--ssh", '"unbalanced'], "--ssh"),
    ],
)
def test_bad_launch_flags_are_usage_errors(flags, words):
    """Exit 2 with the flag named, no traceback, nothing run."""
    p = launch("-n", "2", *flags, TARGET, "check", "2", timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert words in p.stderr and "Traceback" not in p.stderr
