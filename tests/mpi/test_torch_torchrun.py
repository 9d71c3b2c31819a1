"""The cudampi backend under torchrun: real ``torch.distributed.run`` jobs, no MPI launcher.

torchrun starts plain processes; ``init_process_group("cudampi")`` makes them one MPI job
through cudampi's PMI-1 server (cudampi.pmi.join). With an MPICH-family MPI (the PyPI
``mpich`` wheel, loaded by mpi4py through MPI4PY_LIBMPI) the same checks as under mpiexec must
pass: every collective against gloo at 2 and 4 ranks, DDP/FSDP parameters equal to gloo's, the
example script, and a rank that raises ends the job fast. With Open MPI 5 (PMIx only) every
rank must raise the error that names the fixes, not hang.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cudampi.pmi import mpich
from tests.mpi.test_torch_init import _RAISES  # the same script as under mpiexec
from tests.mpirun import MPICH_SKIP, ROOT, mpi_env, mpich_venv

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

MAIN = str(ROOT / "tests" / "_torchrun_main.py")
HERE = Path(__file__).resolve().parent


def torchrun_env(mpi: str) -> dict[str, str]:
    """torchrun's environment: ``default`` as a user has it (cudampi picks its own MPICH),
    ``mpich`` an MPICH named by MPI4PY_LIBMPI, ``openmpi`` the embedded Open MPI named so."""
    env = mpi_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    for var in list(env):  # this pytest may itself run under a launcher: the workers must not
        if var.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC")):
            env.pop(var)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "MPI4PY_LIBMPI"):
        env.pop(var, None)
    if mpi == "default" and not os.path.exists(mpich.library()):
        pytest.skip(f"cudampi's MPICH is not installed: {mpich.INSTALL} (README command 2 does)")
    if mpi == "mpich":
        venv = mpich_venv()
        if venv is None:
            pytest.skip(MPICH_SKIP)
        env["MPI4PY_LIBMPI"] = str(venv / "lib" / "libmpi.so.12")
    if mpi == "openmpi":
        env["MPI4PY_LIBMPI"] = str(Path(sys.prefix) / "lib" / "libmpi.so.40")
    return env


def torchrun(n: int, argv: list[str], mpi: str = "default", timeout: float = 300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(n), *argv]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=torchrun_env(mpi), cwd=ROOT
    )


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_matches_gloo_under_torchrun(n):
    proc = ok(torchrun(n, [MAIN, str(HERE / "test_torch_backend.py"), "rank_collectives", str(n)]))
    assert "against gloo" in proc.stdout


def test_ddp_and_fsdp_match_gloo_under_torchrun():
    variants = "default,small-buckets-views,builtin-fp16-hook,no-sync-accumulate"
    argv = [MAIN, str(HERE / "test_torch_ddp.py"), "rank_ddp_fsdp", variants]
    proc = ok(torchrun(2, argv))
    assert "match gloo" in proc.stdout


_WHO = """
import os
import torch, torch.distributed as dist
import cudampi.torch

dist.init_process_group("cudampi")
from mpi4py import MPI  # after init: MPI started inside it, as one job

w = MPI.COMM_WORLD
assert (w.rank, w.size) == (dist.get_rank(), dist.get_world_size()), (w.rank, w.size)
assert "PMI_PORT" not in os.environ and "PMI_ID" not in os.environ
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
if dist.get_rank() == 0:
    print(MPI.Get_library_version().split()[0], "world", w.size, "sum", t.item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mpi", ["default", "mpich"])
def test_mpi_world_is_torch_world_and_the_pmi_variables_are_gone(tmp_path, mpi):
    script = tmp_path / "who.py"
    script.write_text(textwrap.dedent(_WHO))
    proc = ok(torchrun(3, [str(script)], mpi=mpi))
    assert "MPICH world 3 sum 3.0" in proc.stdout, proc.stdout


def test_the_example_trains_under_torchrun_with_no_flags():
    """What a user types after the README's install: no MPI4PY_LIBMPI, no launcher flags."""
    proc = ok(torchrun(2, [str(ROOT / "examples" / "ddp_train.py"), "--json", "--steps", "5"]))
    assert '"world_size": 2' in proc.stdout and '"backend": "cudampi"' in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_raising_rank_ends_the_torchrun_job_fast(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(_RAISES))
    t0 = time.monotonic()
    proc = torchrun(2, [str(script)], timeout=90)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "ValueError: planted failure" in proc.stderr, proc.stderr[-3000:]
    assert "cudampi: rank 1 of 2" in proc.stderr
    assert elapsed < 90, f"took {elapsed:.0f} s"


def test_open_mpi_under_torchrun_names_the_fix_on_every_rank(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(
        "import torch.distributed as dist, cudampi.torch\ndist.init_process_group('cudampi')\n"
    )
    t0 = time.monotonic()
    proc = torchrun(2, [str(script)], mpi="openmpi", timeout=200)
    assert proc.returncode != 0
    err = proc.stderr
    assert err.count("does not speak PMI-1") >= 2, err[-4000:]
    assert "cudampi launch -n 2 script.py" in err and "MPI4PY_LIBMPI" in err
    assert mpich.INSTALL in err
    assert "Sorry!" not in err and "help-" not in err  # no Open MPI banner: said before MPI_Init
    assert time.monotonic() - t0 < 90


_ATTACKED = """
import json, os, sys, time
import torch, torch.distributed as dist
import cudampi.torch
import cudampi.pmi.join as join

dist.init_process_group("cudampi")
rank, folder = dist.get_rank(), sys.argv[1]


def listening_port(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                return int(f[1].rsplit(":", 1)[1], 16)


if rank == 0:
    server = join._SERVER[0].pid
    where = {"host": join._server_host(os.environ)[1], "port": listening_port(server)}
    with open(f"{folder}/pmi.tmp", "w") as f:
        json.dump({**where, "pid": server}, f)
    os.rename(f"{folder}/pmi.tmp", f"{folder}/pmi.json")
t = torch.ones(1)
while True:  # collectives while the test attacks the PMI server; rank 0 says when to stop
    go = torch.tensor([float(os.path.exists(f"{folder}/go"))])
    dist.broadcast(go, 0)
    dist.all_reduce(t)
    t.fill_(1.0)
    if go.item():
        break
    time.sleep(0.05)
dist.barrier()
if rank == 0:
    print("survived the attacks", flush=True)
dist.destroy_process_group()
"""


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_the_pmi_server_admits_only_its_own_job(tmp_path):
    """A stranger on the host connects to the running job's PMI server and
    sends cmd=abort, connects and closes, poses as rank 1 and leaves, reads the key-value space,
    and sends a line that never ends. The job must go on and end well, and the server must not
    grow."""
    import json
    import socket

    script = tmp_path / "attacked.py"
    script.write_text(textwrap.dedent(_ATTACKED))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = subprocess.Popen(
        [*cmd, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=torchrun_env("default"),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pmi.json").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        pmi = json.loads((tmp_path / "pmi.json").read_text())
        where = (pmi["host"], pmi["port"])
        before = _rss_kib(pmi["pid"])
        replies = []
        for line in (
            b"cmd=abort exitcode=9\n",
            b"",
            b"cmd=initack pmiid=1\n",
            b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=get kvsname=kvs_1_0 key=x\n",
        ):
            with socket.create_connection(where, timeout=10) as s:
                s.sendall(line)
                s.settimeout(2)
                try:
                    replies.append(s.recv(4096))
                except (TimeoutError, OSError):
                    replies.append(b"(no reply)")
            time.sleep(1)
            assert job.poll() is None, f"the job ended after a stranger sent {line!r}"
        endless = socket.create_connection(where, timeout=10)
        sent = 0
        try:
            while sent < 300 << 20:
                endless.sendall(b"x" * (1 << 20))
                sent += 1 << 20
        except OSError:
            pass
        endless.close()
        time.sleep(1)
        grown = _rss_kib(pmi["pid"]) - before
        assert job.poll() is None, "the job ended under the attack: " + job.communicate()[1][-3000:]
        (tmp_path / "go").write_text("")
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0 and "survived the attacks" in out, err[-3000:]
    assert all(r in (b"", b"(no reply)") for r in replies), replies  # nothing read
    assert grown < 20 << 10, f"the PMI server grew by {grown} KiB ({sent >> 20} MiB sent)"


_LOOPS = """
import os, sys, time
import torch, torch.distributed as dist
import cudampi.torch
import cudampi.pmi.join as join

dist.init_process_group("cudampi")
folder = sys.argv[1]
if dist.get_rank() == 0:
    with open(f"{folder}/pids.tmp", "w") as f:
        f.write(f"{join._SERVER[0].pid} {os.getpid()}")
    os.rename(f"{folder}/pids.tmp", f"{folder}/pids")
else:
    with open(f"{folder}/rank1", "w") as f:
        f.write(str(os.getpid()))
t = torch.ones(1)
while True:  # until the job is ended from outside
    dist.all_reduce(t)
    time.sleep(0.05)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_torchrun_ends_the_pmi_server_and_every_rank_with_the_reason(tmp_path):
    """torchrun killed with SIGKILL ends none of its ranks; cudampi's PMI server, which rank 0
    started, sees the launcher go, tells every rank (which ends saying why), and leaves."""
    import signal

    script = tmp_path / "loops.py"
    script.write_text(textwrap.dedent(_LOOPS))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = subprocess.Popen(
        [*cmd, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=torchrun_env("default"),
        cwd=ROOT,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not ((tmp_path / "pids").exists() and (tmp_path / "rank1").exists()):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        pids = [*map(int, (tmp_path / "pids").read_text().split())]
        pids.append(int((tmp_path / "rank1").read_text()))
        time.sleep(1)
        job.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while any(map(_alive, pids)) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        _, err = job.communicate(timeout=30)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert not left, f"still running 30 s after torchrun's SIGKILL: {left} (server, rank 0, 1)"
    said = f"the launcher torchrun (pid {job.pid}), which started the job's ranks, ended"
    assert err.count(said) == 2, err[-3000:]  # each rank says why it ends
