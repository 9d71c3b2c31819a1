"""What a user can type, and do, to ``cudampi launch`` (the real one, on the PyPI Open MPI):
hostfiles that are no files, empty or huge host lists, an output that cannot be written, and
the signals a supervisor gets (SIGTERM, SIGKILL) or its launcher dies of. Each ends with a clear
message and exit status, nothing left running or behind."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mpi.test_launch_real import HOST, ROOT, TARGET, _alive, _children, launch

pytestmark = pytest.mark.mpi

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _usage_error(p: subprocess.CompletedProcess[str], words: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    assert words in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "OK" not in p.stdout


def test_a_hostfile_that_is_a_fifo_nothing_writes_to_is_not_waited_for_ever(tmp_path):
    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)
    start = time.monotonic()
    p = launch("--hostfile", str(fifo), TARGET, "check", "1", timeout=60)
    assert time.monotonic() - start < 30
    _usage_error(p, f"--hostfile {str(fifo)!r}: nothing came from it within 5 s")


def test_a_hostfile_written_through_a_pipe_still_works(tmp_path):
    """``--hostfile <(...)``, or a FIFO whose writer comes a little later, is read as it comes."""
    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)

    def write() -> None:
        time.sleep(1.0)
        with open(fifo, "w") as f:
            f.write(f"{HOST}:2\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    p = launch("--hostfile", str(fifo), TARGET, "check", "2", "--flag", "a b")
    writer.join(timeout=10)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout


def _at_most_2_gib() -> None:
    """Keeps the test from filling the machine where /dev/zero is read to its (no) end."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_a_device_as_hostfile_is_refused_after_a_bounded_read():
    p = subprocess.run(
        [sys.executable, "-m", "cudampi", "launch", "--hostfile", "/dev/zero", TARGET],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
        cwd=ROOT,
        preexec_fn=_at_most_2_gib,
    )
    _usage_error(p, "--hostfile '/dev/zero' holds more than 1048576 bytes: not a hostfile")


def test_a_binary_hostfile_is_refused_without_a_traceback(tmp_path):
    binary = tmp_path / "hosts.bin"
    binary.write_bytes(bytes(range(256)))
    p = launch("--hostfile", str(binary), TARGET)
    _usage_error(p, f"--hostfile {str(binary)!r} is not a text file")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["-H", ""], "--hosts '' names no host"),
        (["--hostfile", ""], "--hostfile '': No such file or directory"),
        (
            ["-H", f"{HOST}:99999999999999999999"],
            "has 99999999999999999999 slots, more than a launcher can count (2147483647)",
        ),
        (["-n", "99999999999999999999"], "-n must be 1 to 2147483647"),
    ],
    ids=["empty-hosts", "empty-hostfile", "huge-slots", "huge-n"],
)
def test_host_lists_that_say_nothing_or_too_much_are_refused(flags, words):
    """``-H ''`` ran on this machine alone; a count over 2**31-1 reached prterun's "bad
    parameter" (or its "All nodes ... are already filled")."""
    p = launch(*flags, TARGET, "check", "1")
    _usage_error(p, words)


def test_an_output_that_cannot_be_written_is_refused_before_the_job_runs(tmp_path):
    marker = tmp_path / "ran"
    p = launch(
        "-n",
        "1",
        "--json-file",
        str(tmp_path / "no-such-folder" / "result.json"),
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w').close()",
    )
    _usage_error(p, "cannot write in")
    assert not marker.exists(), "the job ran before its output was checked"
    into_folder = launch("-n", "1", "--json-file", str(tmp_path), TARGET)
    _usage_error(into_folder, "is a folder; give a file name")


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """``cudampi launch -n 2`` of ranks that sleep, once both have started: (the supervisor,
    the ranks' pids). Whatever the test did, nothing of it is left running."""
    # its work folder in a TMPDIR of its own: another launch on the machine (a test beside this
    # one) removes the folders of killed launches it finds in its TMPDIR when it starts
    (tmp_path / "tmp").mkdir()
    sup = subprocess.Popen(
        [sys.executable, "-m", "cudampi", "launch", "-n", "2", TARGET, "sleep", str(tmp_path)],
        env={**ENV, "TMPDIR": str(tmp_path / "tmp")},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert sup.poll() is None and time.monotonic() < deadline, sup.communicate()
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        yield sup, pids
    finally:
        for pid in [sup.pid, *_children(sup.pid), *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sup.wait(timeout=30)


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while [pid for pid in pids if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return not [pid for pid in pids if _alive(pid)]


def test_sigterm_stops_every_rank_and_says_terminated(started):
    sup, pids = started
    sup.send_signal(signal.SIGTERM)
    _out, err = sup.communicate(timeout=30)
    assert sup.returncode == 143, err
    assert "cudampi launch: terminated (SIGTERM): every rank was stopped" in err
    assert "Ctrl-C" not in err
    assert _gone(pids)


def _workdir_of(pid: int, tmp: Path) -> Path | None:
    for folder in tmp.glob("cudampi-launch-*"):
        owner = folder / "owner"
        if owner.exists() and owner.read_text().split()[0] == str(pid):
            return folder
    return None


def test_the_folder_of_a_killed_launch_is_removed_at_the_next_start(started, tmp_path):
    sup, pids = started
    folder = _workdir_of(sup.pid, tmp_path / "tmp")
    assert folder is not None and (folder / "reports").is_dir()
    sup.kill()  # nothing of cudampi launch runs after -9
    sup.communicate()
    assert _gone(pids) and folder.exists()
    p = launch(
        "-n", "1", TARGET, "check", "1", "--flag", "a b", env={"TMPDIR": str(tmp_path / "tmp")}
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert not folder.exists(), "the killed launch's work folder was left behind"


def test_a_launcher_that_crashes_is_named_not_a_rank(started):
    """prterun dying of SIGSEGV (seen once in 36 fault-matrix cells): the summary names the
    launcher's crash; no rank is blamed; no rank is left."""
    sup, pids = started
    launchers = _children(sup.pid)
    assert launchers
    os.kill(launchers[0], signal.SIGSEGV)
    _out, err = sup.communicate(timeout=60)
    assert sup.returncode == 139, err
    summary = err[err.index("cudampi launch: the job failed") :]
    assert "itself crashed (killed by signal 11, SIGSEGV): the launcher failed, not a rank" in (
        summary
    ), summary
    assert "the launcher mpiexec (Open MPI)" in summary, summary
    assert " - rank " not in summary and "no rank reported" not in summary, summary
    assert _gone(pids)
