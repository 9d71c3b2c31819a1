"""Where the ranks of a job whose scripts all finished are (cudampi.launch.exits): the stage of
each from its marks and its process state, and the note that names them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from cudampi.launch.exits import (
    RankExit,
    describe,
    in_own_exit,
    process_state,
    stage_of,
    stuck,
    waiting_note,
)


def test_stages_from_process_state_and_the_exiting_mark():
    assert stage_of("running", False) == "python"
    assert stage_of("running", True) == "teardown"
    assert stage_of("exiting", True) == "kernel"
    assert stage_of("zombie", True) == "zombie"
    assert stage_of("gone", False) == "gone"
    assert stage_of(None, True) == "remote"
    assert stage_of(None, False) == "remote-python"


def test_process_state_of_a_rank_process_running_zombie_and_gone():
    child = subprocess.Popen(
        [sys.executable, "-c", "print('up', flush=True); input()", "cudampi.launch.rank"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        # once it has printed, it runs the new program (in exec its command line reads empty)
        assert child.stdout.readline() == b"up\n"
        assert process_state(child.pid) == "running"
    finally:
        child.stdin.close()
        child.stdout.close()
    for _ in range(500):  # exited, not yet waited for: a zombie
        if process_state(child.pid) == "zombie":
            break
        time.sleep(0.01)
    assert process_state(child.pid) == "zombie"
    child.wait()
    assert process_state(child.pid) == "gone"
    assert process_state(os.getpid()) == "gone"  # not a rank bootstrap (a reused pid)


def test_the_note_names_the_ranks_stuck_in_their_exit():
    exits = [
        RankExit(1, "python", 10.4, 4242, "n1"),
        RankExit(0, "teardown", 10.6, 4241, "n1"),
        RankExit(2, "gone", 11.0, 4243, "n1"),
        RankExit(3, "kernel", 10.0, 4244, "n1"),
    ]
    assert [e.rank for e in stuck(exits)] == [1, 0, 3]
    note = describe(exits, "Open MPI", 10)
    assert note.startswith("every rank finished its script, but 10 s later the job had not ended")
    assert (
        "rank 1 (pid 4242 on host n1) in Python's exit (a non-daemon thread or an atexit "
        "handler), 10 s after its script finished" in note
    )
    assert "rank 0 (pid 4241 on host n1) past Python's exit handlers" in note
    assert "rank 3 (pid 4244 on host n1) ending in the kernel" in note
    assert "(1 other rank had exited)" in note
    assert note.index("rank 0 (") < note.index("rank 1 (") < note.index("rank 3 (")
    assert "had not exited" not in note


def test_the_note_says_the_launcher_itself_lingered_when_every_rank_exited():
    exits = [RankExit(0, "gone", 12, 1, "n1"), RankExit(1, "zombie", 12, 2, "n1")]
    note = describe(exits, "Open MPI", 10)
    assert note.startswith("Open MPI had not exited 10 s after every rank's process had ended")
    assert "rank 1 exited but Open MPI had not collected it" in note
    assert "the launcher itself lingered" in note
    gone = describe([RankExit(0, "gone", 12), RankExit(1, "gone", 12)], "mpiexec", 2)
    assert "collected" not in gone and gone.startswith("mpiexec had not exited 2 s")


def test_ranks_in_their_own_exit_are_waited_for_and_the_note_says_so():
    exits = [
        RankExit(0, "teardown", 10.2, 11, "n1"),
        RankExit(1, "python", 10.4, 12, "n1"),
        RankExit(2, "remote-python", 10.1, None, "n2"),
    ]
    assert [e.rank for e in in_own_exit(exits)] == [1, 2]
    assert in_own_exit([RankExit(0, "teardown", 10.2), RankExit(1, "kernel", 10.0)]) == []
    note = waiting_note(exits, 10)
    assert note.startswith("every rank finished its script 10 s ago and the job waits for: ")
    assert "rank 1 (pid 12 on host n1) in Python's exit" in note
    assert "rank 2 (on host n2) in Python's exit or before it" in note
    assert "rank 0" not in note and "never ends" in note
