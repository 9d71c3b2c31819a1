"""``cudampi launch`` inside a real Slurm allocation: a throwaway slurmctld + slurmd (+ munged)
on this host, then ``salloc -n N cudampi launch ...`` must pick srun, run N ranks with PMIx and
the torch variables, and summarize a failing rank.

Needs root and Debian's slurmctld, slurmd, slurm-client, munge and libpmix-dev (see .ci/run);
skipped with the reason when they are missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudampi.launch.detect import query_gpus
from cudampi.net import free_port
from tests.mpirun import bring_up

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[2]
TARGET = str(Path(__file__).with_name("_launch_target.py"))
TOOLS = ("munged", "slurmctld", "slurmd", "salloc", "srun", "sinfo")


def _free_port() -> int:
    return free_port("127.0.0.1")  # not bind-0's pick: an outgoing connection could take it


def _why_skip() -> str | None:
    if os.geteuid() != 0:
        return "needs root (runs slurmd)"
    missing = [
        t for t in TOOLS if shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin") is None
    ]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmd slurmctld slurm-client munge libpmix-dev"
    if not Path("/usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so").exists() and not any(
        Path("/usr/lib").glob("*/pmix2/lib/libpmix.so")
    ):
        return "Slurm's mpi/pmix plugin needs libpmix.so: apt-get install libpmix-dev"
    return None


class Slurm:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.conf = tmp / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": os.environ.get("PATH", "") + ":/usr/sbin",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        }
        for k in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[k]

    def up(self) -> None:
        t = self.tmp
        for d in ("state", "spool", "munge"):
            (t / d).mkdir()
        key = t / "munge" / "key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        sock = t / "munge" / "socket"
        self.run(
            "munged",
            "--force",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={t / 'munge' / 'pid'}",
            f"--log-file={t / 'munge' / 'log'}",
            f"--seed-file={t / 'munge' / 'seed'}",
        )
        self.conf.write_text(
            f"ClusterName=cudampitest\nSlurmctldHost={self.host}(127.0.0.1)\n"
            "SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
            f"AuthInfo=socket={sock}\nStateSaveLocation={t / 'state'}\n"
            f"SlurmdSpoolDir={t / 'spool'}\nSlurmctldPidFile={t / 'ctld.pid'}\n"
            f"SlurmdPidFile={t / 'd.pid'}\nSlurmctldPort={_free_port()}\n"
            f"SlurmdPort={_free_port()}\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\nSelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core\nMpiDefault=none\nReturnToService=2\n"
            "SlurmdParameters=config_overrides\n"
            f"SlurmctldLogFile={t / 'ctld.log'}\nSlurmdLogFile={t / 'd.log'}\n"
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN\n"
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE\n"
        )
        # PMIx's per-step folders in this test's own folder: every fresh slurmctld numbers its
        # jobs from 1, so a folder another run left in /tmp (spmix_appdir_0_1.0) breaks step 1.0
        (t / "pmix").mkdir()
        (t / "mpi.conf").write_text(f"PMIxCliTmpDirBase={t / 'pmix'}\n")
        self.run("slurmctld", "-i")
        self.run("slurmd")
        deadline = time.monotonic() + 60
        while True:
            state = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"slurm node state {state!r}:\n{self.logs()}")
            time.sleep(0.3)

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}\n{(self.tmp / n).read_text()[-3000:]}"
            for n in ("ctld.log", "d.log")
            if (self.tmp / n).exists()
        )

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            list(argv), capture_output=True, text=True, env=self.env, timeout=timeout, cwd=ROOT
        )
        if check and p.returncode != 0:
            raise AssertionError(f"{argv} exited {p.returncode}: {p.stdout}{p.stderr}")
        return p

    def down(self) -> None:
        for pidfile in ("d.pid", "ctld.pid", "munge/pid"):
            try:
                pid = int((self.tmp / pidfile).read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass

    def salloc(self, n: int, *launch: str) -> subprocess.CompletedProcess[str]:
        return self.run(
            "salloc",
            "-Q",
            "-n",
            str(n),
            "--immediate=60",
            sys.executable,
            "-m",
            "cudampi",
            "launch",
            *launch,
            check=False,
            timeout=180,
        )


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    yield from bring_up(lambda: Slurm(tmp_path_factory.mktemp("slurm")), _why_skip())


@pytest.mark.parametrize("n", [1, 2, 4])
def test_srun_inside_an_allocation_runs_n_ranks(slurm: Slurm, n: int):
    p = slurm.salloc(n, TARGET, "check", str(n), "--flag", "a b")  # -n from SLURM_NTASKS
    assert p.returncode == 0, p.stdout + p.stderr + slurm.logs()
    assert f"OK {n}" in p.stdout
    for r in range(n):
        assert f"rank {r} ok on" in p.stdout


def test_dry_run_inside_an_allocation_is_srun(slurm: Slurm):
    p = slurm.salloc(2, "--dry-run", TARGET)
    assert p.returncode == 0, p.stderr
    line = p.stdout.strip().splitlines()[-1]
    assert "CUDAMPI_LAUNCHER=slurm" in line and f"MASTER_ADDR={slurm.host}" in line
    # No GPU here decides the ranks' cores: Slurm binds each task to cores.
    bind = "none" if query_gpus() else "cores"
    assert f"srun -n 2 --cpu-bind={bind} --kill-on-bad-exit=1 --mpi=pmix" in line
    assert "-n 2: the allocation's tasks (SLURM_NTASKS)" in p.stdout


def test_standalone_inside_an_allocation_runs_on_this_machine(slurm: Slurm):
    """torchrun's --standalone: this machine's ranks, so the MPI's mpiexec, not srun."""
    p = slurm.salloc(2, "--standalone", "-n", "2", "--dry-run", TARGET)
    assert p.returncode == 0, p.stdout + p.stderr
    line = p.stdout.strip().splitlines()[-1]
    assert "srun" not in line and "mpiexec -n 2" in line, line


def test_a_failing_rank_under_srun_is_named(slurm: Slurm):
    p = slurm.salloc(2, TARGET, "raise", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    summary = p.stderr[p.stderr.index("cudampi launch: the job failed") :]
    assert "rank 1 on host" in summary and "ValueError: planted failure on rank 1" in summary
    assert "rank 0" not in summary  # srun terminated it because rank 1 failed
    p = slurm.salloc(2, TARGET, "kill", "0")
    assert p.returncode == 137, p.stdout + p.stderr
    assert "rank 0 on host" in p.stderr and "killed by signal 9 (SIGKILL)" in p.stderr


INIT = (
    "import os, cudampi; i = cudampi.init(); "
    "print('INIT', i.rank, i.world_size, i.local_rank, i.launcher, os.environ['RANK'], "
    "os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], flush=True)"
)


def test_init_under_plain_srun(slurm: Slurm):
    p = slurm.run(
        "salloc",
        "-Q",
        "-n",
        "2",
        "--immediate=60",
        "srun",
        "--mpi=none",
        sys.executable,
        "-c",
        INIT,
        check=False,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = sorted(ln.split() for ln in p.stdout.splitlines() if ln.startswith("INIT"))
    assert [ln[1:6] for ln in lines] == [
        ["0", "2", "0", "slurm", "0"],
        ["1", "2", "1", "slurm", "1"],
    ]
    assert len({(ln[6], ln[7]) for ln in lines}) == 1  # one MASTER_ADDR:PORT for the job


def test_nodelists_are_read_by_scontrol_inside_an_allocation(slurm: Slurm, tmp_path: Path):
    # python-hostlist made unimportable: the names must come from `scontrol show hostnames`.
    (tmp_path / "hostlist.py").write_text("raise ImportError('not here: scontrol must answer')\n")
    code = (
        "from cudampi.launch.launchers.slurm import expand_nodelist; "
        "print('NAMES', ' '.join(expand_nodelist('rack[1-2]-node[01-02],login1')))"
    )
    env = dict(slurm.env)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    p = subprocess.run(
        ["salloc", "-Q", "-n", "1", "--immediate=60", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "NAMES rack1-node01 rack1-node02 rack2-node01 rack2-node02 login1" in p.stdout
