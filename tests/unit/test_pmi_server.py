"""cudampi's PMI-1 server: the protocol state machine, then the real server over loopback sockets
with clients speaking the wire protocol as MPICH's simple PMI client does (the lines below are
the ones MPICH 5.0.2 sent in a 2-rank MPI_Init, captured while this server was written)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cudampi.pmi import server as pmi
from cudampi.pmi.client import InitGuard, client_env, connect, single_node_mapping, watch
from cudampi.pmi.server import PmiServer
from cudampi.pmi.state import Client, PmiState, max_entries
from cudampi.pmi.wire import parse_command
from cudampi.shm import SHM_DIR, mpich_world_id, unique_kvsname
from tests.mpirun import ROOT, mpi_env

KVSNAME = unique_kvsname(4242)
SECRET = "0123456789abcdef0123456789abcdef"


def test_parse_command():
    assert parse_command("cmd=put kvsname=k key=hostname[0] value=vm\n") == {
        "cmd": "put",
        "kvsname": "k",
        "key": "hostname[0]",
        "value": "vm",
    }
    assert parse_command("cmd=barrier_in") == {"cmd": "barrier_in"}
    assert parse_command("  \n") == {}


def test_handshake_answers_as_hydra_does():
    st = PmiState(2, kvsname=KVSNAME)
    c = Client()
    replies, _ = st.handle(c, "cmd=initack pmiid=1\n")
    assert replies == ["cmd=initack\n", "cmd=set size=2\n", "cmd=set rank=1\n", "cmd=set debug=0\n"]
    assert c.rank == 1
    replies, _ = st.handle(c, "cmd=init pmi_version=1 pmi_subversion=1\n")
    assert replies == ["cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n"]
    assert "kvsname_max=256" in st.handle(c, "cmd=get_maxes\n")[0][0]
    assert st.handle(c, "cmd=get_appnum\n")[0] == ["cmd=appnum appnum=0 rc=0\n"]
    assert st.handle(c, "cmd=get_my_kvsname\n")[0] == [f"cmd=my_kvsname kvsname={KVSNAME} rc=0\n"]
    assert st.handle(c, "cmd=get_universe_size\n")[0] == ["cmd=universe_size size=2 rc=0\n"]


def test_bad_rank_and_version_are_refused():
    st = PmiState(2, log=lambda m: None)
    assert st.handle(Client(), "cmd=initack pmiid=2\n")[0] == ["cmd=initack rc=-1\n"]
    assert "rc=-1" in st.handle(Client(), "cmd=init pmi_version=2 pmi_subversion=0\n")[0][0]
    assert "rc=-1" in st.handle(Client(), "cmd=frobnicate\n")[0][0]
    with pytest.raises(ValueError, match="size=0"):
        PmiState(0)


def test_kvs_put_get_and_process_mapping():
    st = PmiState(2, process_mapping=single_node_mapping(2))
    c = Client(rank=0)
    got = st.handle(c, f"cmd=get kvsname={KVSNAME} key=PMI_process_mapping\n")[0]
    assert got == ["cmd=get_result rc=0 msg=success value=(vector,(0,1,2))\n"]
    missing = st.handle(c, f"cmd=get kvsname={KVSNAME} key=hostname[1]\n")[0][0]
    assert "rc=-1" in missing and "key_not_found" in missing
    st.handle(c, f"cmd=put kvsname={KVSNAME} key=hostname[1] value=vm\n")
    got = st.handle(c, f"cmd=get kvsname={KVSNAME} key=hostname[1]\n")[0]
    assert got == ["cmd=get_result rc=0 msg=success value=vm\n"]
    too_long = st.handle(c, f"cmd=put kvsname={KVSNAME} key=k value={'x' * 2000}\n")[0][0]
    assert "rc=-1" in too_long
    for i in range(max_entries(2)):  # a rank putting without end is cut off
        st.handle(c, f"cmd=put kvsname={KVSNAME} key=k{i} value=v\n")
    full = st.handle(c, f"cmd=put kvsname={KVSNAME} key=one-more value=v\n")[0][0]
    assert "rc=-1 msg=kvs_full" in full and len(st.kvs) == max_entries(2)


def test_barrier_releases_everyone_only_when_all_entered():
    st = PmiState(3)
    a, b, c = Client(rank=0), Client(rank=1), Client(rank=2)
    assert st.handle(a, "cmd=barrier_in\n") == ([], [])
    assert st.handle(b, "cmd=barrier_in\n") == ([], [])
    replies, released = st.handle(c, "cmd=barrier_in\n")
    assert replies == [] and released == [a, b, c]
    assert st.handle(a, "cmd=barrier_in\n") == ([], [])  # the next barrier starts afresh


def test_name_service_abort_finalize():
    logs: list[str] = []
    st = PmiState(1, log=logs.append)
    c = Client(rank=0)
    assert "rc=0" in st.handle(c, "cmd=publish_name service=svc port=p0\n")[0][0]
    assert st.handle(c, "cmd=lookup_name service=svc\n")[0] == ["cmd=lookup_result rc=0 port=p0\n"]
    assert "rc=0" in st.handle(c, "cmd=unpublish_name service=svc\n")[0][0]
    assert "rc=-1" in st.handle(c, "cmd=lookup_name service=svc\n")[0][0]
    assert st.handle(c, "cmd=abort exitcode=3\n") == ([], [])
    assert c.aborted == 3 and "rank 0 called MPI_Abort (exit code 3)" in logs[-1]
    assert st.handle(c, "cmd=finalize\n")[0] == ["cmd=finalize_ack rc=0\n"] and c.finalized


def server(size: int, log=None) -> PmiServer:
    return PmiServer(size, log=log or (lambda m: None), secret=SECRET).start()


def _rank(port: int, rank: int, out: dict[int, list[str]]) -> None:
    """One client as MPICH's simple PMI speaks over the connection Hydra would hand it (PMI_FD):
    init, put, barrier, get, finalize, after cudampi's authentication."""
    with connect(f"127.0.0.1:{port}", rank, SECRET) as s:
        f = s.makefile("rw", encoding="ascii", newline="\n")

        def ask(line: str, n: int = 1) -> list[str]:
            f.write(line + "\n")
            f.flush()
            return [f.readline().strip() for _ in range(n)]

        got = ask("cmd=init pmi_version=1 pmi_subversion=1")
        got += ask(f"cmd=put kvsname={KVSNAME} key=card[{rank}] value=addr{rank}")
        got += ask("cmd=barrier_in")
        for peer in range(3):
            got += ask(f"cmd=get kvsname={KVSNAME} key=card[{peer}]")
        got += ask("cmd=finalize")
        out[rank] = got


def test_server_serves_three_ranks_over_tcp_and_finishes():
    srv = server(3)
    out: dict[int, list[str]] = {}
    threads = [threading.Thread(target=_rank, args=(srv.port, r, out)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert srv.done.wait(10), "the server did not finish after every rank finalized"
    srv.close()
    for r in range(3):
        got = out[r]
        assert got[0] == "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
        assert "cmd=barrier_out rc=0" in got
        for peer in range(3):
            assert f"cmd=get_result rc=0 msg=success value=addr{peer}" in got
        assert got[-1] == "cmd=finalize_ack rc=0"


def test_a_rank_that_vanishes_is_reported():
    logs: list[str] = []
    srv = server(1, logs.append)
    connect(f"127.0.0.1:{srv.port}", 0, SECRET).close()
    assert srv.done.wait(10)
    srv.close()
    assert any("rank 0 closed its PMI connection without MPI_Finalize" in m for m in logs), logs


def test_the_server_process_prints_its_port_and_outlives_its_parent_while_ranks_run():
    """... and when it ends, removes the MPICH segment its killed ranks left (cudampi.shm)."""
    env = mpi_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cudampi.pmi.server", "--size", "2", "--grace", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    proc.stdin.write(SECRET + "\n")
    proc.stdin.flush()
    port = int(proc.stdout.readline())
    with connect(f"127.0.0.1:{port}", 1, SECRET) as s:
        proc.stdin.close()  # the starting rank is gone, rank 1 still runs: keep serving it
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(3)
        s.sendall(b"cmd=init pmi_version=1 pmi_subversion=1\n")
        _recv_until(s, b"rc=0\n")  # the whole of response_to_init, its one line
        s.sendall(b"cmd=get_my_kvsname\n")
        kvsname = parse_command(_recv_until(s, b"rc=0\n").decode())["kvsname"]
        segment = _segment(kvsname)
    t0 = time.monotonic()  # rank 1 gone too: out within --grace (1 s) and a poll
    assert proc.wait(20) == 0
    assert time.monotonic() - t0 < 10
    assert (
        not segment.exists() and f"removed {segment}, left by the job's ranks" in proc.stderr.read()
    )


def _segment(kvsname: str) -> Path:
    """A stand-in for the MPICH segment a killed rank of job ``kvsname`` left on this host."""
    path = Path(SHM_DIR) / f"mpich_shm_{mpich_world_id(kvsname):x}_0"
    path.write_bytes(b"x")
    return path


def test_each_job_has_its_own_key_value_space_name():
    """MPICH names its shared memory after it, and killed jobs leave that behind: one name per
    pid (kvs_<pid>_0, as before) made a later server of a reused pid meet a stale segment."""
    names = {PmiState(2).kvsname for _ in range(20)}
    assert len(names) == 20 and all(n.startswith(f"kvs_{os.getpid()}_") for n in names)


def test_the_server_process_needs_a_secret():
    proc = subprocess.run(
        [sys.executable, "-m", "cudampi.pmi.server", "--size", "2"],
        input="short\n",
        capture_output=True,
        text=True,
        env=mpi_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and "at least 16 characters" in proc.stderr


def _recv_until(s: socket.socket, token: bytes) -> bytes:
    got = b""
    while token not in got:
        chunk = s.recv(200)
        assert chunk, f"connection closed before {token!r}; got {got!r}"
        got += chunk
    return got


def _connect_rank(port: int, rank: int) -> socket.socket:
    return connect(f"127.0.0.1:{port}", rank, SECRET)


def _watcher(port: int, rank: int) -> tuple[threading.Thread, list[tuple[str, int]]]:
    heard: list[tuple[str, int]] = []
    thread = watch(f"127.0.0.1:{port}", rank, lambda why, code: heard.append((why, code)), SECRET)
    return thread, heard


@pytest.mark.parametrize("how", ["abort", "vanish"])
def test_watchers_hear_when_a_rank_aborts_or_dies(how):
    """... and remove the job's MPICH segment on their host (ranks on other hosts than the
    server's leave theirs too when killed)."""
    srv = server(3)
    ranks = [_connect_rank(srv.port, r) for r in range(3)]
    watchers = [_watcher(srv.port, r) for r in range(3)]
    segment = _segment(srv.state.kvsname)
    time.sleep(0.2)  # the watchers are registered before anything fails
    if how == "abort":
        ranks[1].sendall(b"cmd=abort exitcode=7\n")
    else:
        ranks[1].close()  # killed: no finalize
    for r in (0, 2):
        thread, heard = watchers[r]
        thread.join(10)
        want = "called MPI_Abort (exit code 7)" if how == "abort" else "without MPI_Finalize"
        assert len(heard) == 1 and heard[0][0].startswith("rank 1 "), heard
        assert want in heard[0][0] and heard[0][1] == (7 if how == "abort" else 1)
    assert watchers[1][1] == []  # the failing rank is not told about itself
    assert not segment.exists()
    late = _watcher(srv.port, 2)  # a watcher that comes after the failure hears it at once
    late[0].join(10)
    assert late[1] and late[1][0][0].startswith("rank 1 ")
    for s in ranks:
        s.close()
    srv.close()


@pytest.mark.parametrize("how", ["abort", "vanish"])
def test_ranks_left_waiting_in_a_barrier_after_a_failure_are_failed_soon(monkeypatch, how):
    """A rank in MPI_Finalize at interpreter exit has no watcher left to end it (Python runs no
    thread then): it waits in the PMI barrier for the failed rank. The server fails that
    barrier, and later ones at once; its watcher heard of the failure first."""
    monkeypatch.setattr(pmi, "FAIL_AFTER", 0.5)
    logs: list[str] = []
    srv = server(3, logs.append)
    ranks = [_connect_rank(srv.port, r) for r in range(3)]
    watchers = [_watcher(srv.port, r) for r in range(3)]
    time.sleep(0.2)
    ranks[0].sendall(b"cmd=barrier_in\n")  # in MPI_Finalize's barrier
    t0 = time.monotonic()
    if how == "abort":
        ranks[1].sendall(b"cmd=abort exitcode=7\n")
    else:
        ranks[1].close()
    ranks[0].settimeout(10)
    assert _recv_until(ranks[0], b"\n") == b"cmd=barrier_out rc=-1 msg=a_rank_of_the_job_failed\n"
    assert 0.4 < time.monotonic() - t0 < 5
    assert watchers[0][1] and watchers[0][1][0][0].startswith("rank 1 ")  # told first
    said = [m for m in logs if m.startswith("failed the PMI barrier")]
    assert len(said) == 1 and "of ranks 0, still waiting 0.5 s after rank 1's" in said[0], logs
    ranks[2].settimeout(10)  # a barrier entered after the failure fails at once
    ranks[2].sendall(b"cmd=barrier_in\n")
    assert _recv_until(ranks[2], b"\n") == b"cmd=barrier_out rc=-1 msg=a_rank_of_the_job_failed\n"
    assert "failed rank 2's PMI barrier: a rank of the job failed" in logs[-1], logs
    for s in ranks:
        s.close()
    srv.close()


def test_a_barrier_after_the_job_finished_cleanly_is_not_failed(monkeypatch):
    monkeypatch.setattr(pmi, "FAIL_AFTER", 0.2)
    srv = server(2)
    ranks = [_connect_rank(srv.port, r) for r in range(2)]
    for s in ranks:
        s.sendall(b"cmd=barrier_in\n")
    for s in ranks:
        assert _recv_until(s, b"\n") == b"cmd=barrier_out rc=0\n"
        s.sendall(b"cmd=finalize\n")
        _recv_until(s, b"finalize_ack")
        s.close()
    assert srv.done.wait(10)
    time.sleep(0.4)
    assert not srv.state.failed and srv.aborted is None
    srv.close()


def test_watchers_are_released_quietly_when_every_rank_finalizes():
    srv = server(2)
    ranks = [_connect_rank(srv.port, r) for r in range(2)]
    watchers = [_watcher(srv.port, r) for r in range(2)]
    time.sleep(0.2)
    for s in ranks:
        s.sendall(b"cmd=finalize\n")
        _recv_until(s, b"finalize_ack")
        s.close()
    assert srv.done.wait(10)
    for thread, heard in watchers:
        thread.join(10)
        assert not thread.is_alive() and heard == []
    srv.close()


def test_a_watcher_that_loses_the_server_ends():
    srv = server(2)
    thread, heard = _watcher(srv.port, 0)
    time.sleep(0.3)
    assert srv.aborted is None and heard == []
    srv.close()  # the server dies with a rank still running
    thread.join(10)
    assert heard and "PMI server" in heard[0][0] and heard[0][1] == 1


def test_client_env():
    assert client_env(7, 3, 4) == {"PMI_FD": "7", "PMI_RANK": "3", "PMI_SIZE": "4"}


def test_a_watch_line_with_a_bad_rank_is_a_watcher_not_a_rank():
    srv = server(1)
    odd = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    odd.sendall(f"cmd=cudampi_watch secret={SECRET} rank=x\n".encode())
    rank = _connect_rank(srv.port, 0)
    rank.sendall(b"cmd=finalize\n")
    _recv_until(rank, b"finalize_ack")
    rank.close()
    assert srv.done.wait(10)  # the odd watcher neither counted as a rank nor held the job
    assert _recv_until(odd, b"\n").startswith(b"cmd=cudampi_done")
    odd.close()
    srv.close()


# --- nobody but the job's processes can end it, read it or grow it ------------------------

ATTACKS = {
    "abort": b"cmd=abort exitcode=9\n",
    "initack-then-close": b"cmd=initack pmiid=1\n",
    "connect-and-close": b"",
    "wrong-secret": b"cmd=cudampi_auth secret=0000000000000000 rank=1\n",
    "no-secret-watch": b"cmd=cudampi_watch rank=0\n",
    "read-kvs": f"cmd=get kvsname={KVSNAME} key=card[0]\n".encode(),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_stranger_cannot_end_or_read_the_job(attack):
    logs: list[str] = []
    srv = server(2, logs.append)
    ranks = [_connect_rank(srv.port, r) for r in range(2)]
    ranks[0].sendall(f"cmd=put kvsname={KVSNAME} key=card[0] value=secret-addr\n".encode())
    _recv_until(ranks[0], b"put_result")
    watchers = [_watcher(srv.port, r) for r in range(2)]
    stranger = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    stranger.sendall(ATTACKS[attack])
    if attack != "connect-and-close":
        assert stranger.recv(4096) == b""  # closed unheard: no reply, no data
    stranger.close()
    time.sleep(0.3)
    assert srv.aborted is None and all(not heard for _, heard in watchers), srv.aborted
    assert srv.refused == 1 and "refused a connection from 127.0.0.1:" in logs[-1], logs
    for s in ranks:  # the job goes on and ends well
        s.sendall(b"cmd=finalize\n")
        _recv_until(s, b"finalize_ack")
        s.close()
    assert srv.done.wait(10) and srv.aborted is None
    srv.close()


def test_a_rank_cannot_be_taken_twice():
    srv = server(2)
    first = _connect_rank(srv.port, 1)
    with pytest.raises(ConnectionError):
        _connect_rank(srv.port, 1)
    assert srv.aborted is None and srv.refused == 1
    first.close()
    srv.close()


def test_lines_are_bounded_and_a_silent_connection_times_out(monkeypatch):
    """A line that never ends costs the server at most MAX_FIRST_LINE bytes before the
    connection is closed (MAX_LINE for a rank, which then counts as ended)."""
    monkeypatch.setattr(pmi, "AUTH_TIMEOUT", 0.5)
    logs: list[str] = []
    srv = server(2, logs.append)
    endless = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sent = 0
    with pytest.raises(OSError):
        for _ in range(10_000):  # up to 640 MiB: the server must close long before
            endless.sendall(b"x" * 65536)
            sent += 65536
    assert sent < 64 << 20 and "longer than 256 bytes" in " ".join(logs), (sent, logs)
    endless.close()
    silent = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    assert silent.recv(10) == b""  # closed after AUTH_TIMEOUT
    assert "no authentication line in time" in logs[-1]
    silent.close()
    rank = _connect_rank(srv.port, 0)
    watcher = _watcher(srv.port, 1)
    with pytest.raises(OSError):
        for _ in range(10_000):
            rank.sendall(b"y" * 65536)
    watcher[0].join(10)
    assert "rank 0 sent a line longer than 4096 characters" in " ".join(logs)
    assert srv.aborted is not None and srv.aborted[0] == 0  # a rank that misbehaves has ended
    rank.close()
    srv.close()


def test_a_flood_of_idle_connections_cannot_keep_the_ranks_out(monkeypatch):
    """Past MAX_PENDING connections that have not authenticated, the oldest is closed: a flood
    holds at most that many (and their threads), and the job's own ranks still get in."""
    monkeypatch.setattr(pmi, "MAX_PENDING", 4)
    srv = server(1)
    idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(6)]
    for s in idle[:2]:  # the two oldest were closed to make room
        assert s.recv(10) == b""
    rank = _connect_rank(srv.port, 0)  # the job's own rank gets in, the flood still open
    rank.sendall(b"cmd=finalize\n")
    _recv_until(rank, b"finalize_ack")
    assert srv.done.wait(10) and srv.aborted is None
    for s in [*idle, rank]:
        s.close()
    srv.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, True),  # torchrun, one host
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, False),
        # Lightning's own launcher sets no LOCAL_WORLD_SIZE; its store is on loopback
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, True),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "localhost"}, True),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "::1"}, True),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7"}, False),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "node-a"}, False),  # no name lookup
        ({"WORLD_SIZE": "2"}, False),
    ],
)
def test_one_host_reads_torchrun_and_a_loopback_store(env, expected):
    from cudampi.pmi.join import one_host

    assert one_host(env) is expected


def test_a_job_across_hosts_without_a_secret_is_refused_with_the_fix():
    from cudampi.errors import ConfigError
    from cudampi.pmi.join import _job_secret

    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7"}
    with pytest.raises(ConfigError, match="CUDAMPI_PMI_SECRET=") as info:
        _job_secret(None, 0, env, lambda keys: None)
    assert "MASTER_ADDR=10.0.0.7" in str(info.value)


def test_an_init_guard_that_cannot_start_is_said_and_the_rank_goes_on(monkeypatch):
    srv = server(2)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    with pytest.warns(RuntimeWarning, match="rank 0 could not start its MPI_Init guard"):
        guard = InitGuard(f"127.0.0.1:{srv.port}", 0, 2, SECRET)
    with guard:
        pass
    guard.close()  # twice: nothing more
    srv.close()


GUARDED = """
import sys, time
from cudampi.pmi.client import InitGuard
with InitGuard(sys.argv[1], 1, 2, sys.argv[2]):
    print("in MPI_Init", flush=True)
    time.sleep(3)  # MPI_Init of an MPI that does not speak PMI (an Open MPI singleton)
print("through", flush=True)
"""


def test_a_rank_in_mpi_init_outlives_a_server_that_went_away_without_a_failure():
    """Open MPI under torchrun: rank 0 finds itself a singleton and ends the server while rank
    1 is still in MPI_Init, which needs no server; rank 1 must get through and say what is wrong
    itself (its guard killed it at once: seen in CI)."""
    srv = server(2)
    child = subprocess.Popen(
        [sys.executable, "-c", GUARDED, f"127.0.0.1:{srv.port}", SECRET],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=mpi_env(),
        cwd=ROOT,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "in MPI_Init\n"
    srv.close()
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0 and out == "through\n", (child.returncode, out, err)


def _server_process(*args: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cudampi.pmi.server", "--size", "2", "--grace", "1", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=mpi_env(),
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write(SECRET + "\n")
    proc.stdin.flush()
    return proc, int(proc.stdout.readline())


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None and not f.closed:
            f.close()


def test_when_the_launcher_ends_every_rank_is_told_and_the_server_leaves():
    """torchrun killed with SIGKILL ends none of its ranks: the server (--launcher-pid)
    tells each rank's watcher, which ends the rank, and leaves once they are gone."""
    launcher = subprocess.Popen(["sleep", "60"])
    proc, port = _server_process("--launcher-pid", str(launcher.pid))
    try:
        ranks = [_connect_rank(port, r) for r in range(2)]
        watchers = [_watcher(port, r) for r in range(2)]
        time.sleep(0.3)
        launcher.kill()
        launcher.wait()
        for thread, heard in watchers:
            thread.join(10)
            want = f"the launcher sleep (pid {launcher.pid}), which started the job's ranks, ended"
            assert len(heard) == 1 and heard[0] == (f"{want} (exit code 1)", 1), heard
        for s in ranks:
            s.close()  # the told ranks end
        assert proc.wait(15) == 0
    finally:
        _end(proc)


def test_a_rank_0_that_ends_before_mpi_finalize_fails_the_job_for_the_others():
    """Rank 0 started the server and died before its PMI connection was made: the other ranks,
    waiting for it in MPI_Init, are told (their watchers or guards end them)."""
    proc, port = _server_process()
    try:
        rank1 = _connect_rank(port, 1)
        thread, heard = _watcher(port, 1)
        time.sleep(0.3)
        assert proc.stdin is not None
        proc.stdin.close()  # rank 0 is gone
        thread.join(10)
        assert heard and heard[0][0].startswith("rank 0 ended before MPI_Finalize"), heard
        rank1.close()
        assert proc.wait(15) == 0
    finally:
        _end(proc)
