"""What mpirun, Hydra and torchrun users type, through the real `cudampi launch` on the PyPI
Open MPI here: any command (this python, a compiled MPI program, `cudampi bench`), -np/-H,
torchrun's --nproc-per-node/--nnodes, --tag-output, --json to stderr or a file, and ranks bound
to cores where no GPU decides (said so in --dry-run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudampi.launch.detect import query_gpus, query_physical_cores
from tests.mpi.test_launch_real import HOST, MPICH_PY, TARGET, launch

pytestmark = pytest.mark.mpi

CHECK = (TARGET, "check", "2", "--flag", "a b")

HELLO_C = r"""
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
int main(int argc, char **argv) {
  int rank, size, one, sum = 0;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  one = rank + 1;
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  printf("c rank %d of %d sum %d env-rank %s\n", rank, size, sum, getenv("RANK"));
  fflush(stdout);
  if (argc > 1 && rank == atoi(argv[1])) return 3;
  MPI_Finalize();
  return 0;
}
"""


@pytest.fixture(scope="module")
def a_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A C MPI program built with the wheel's own mpicc (needs a C compiler)."""
    mpicc = Path(sys.executable).parent / "mpicc"
    if not mpicc.exists() or shutil.which("cc") is None:
        pytest.skip("needs the MPI wheel's mpicc and a C compiler (apt-get install gcc)")
    d = tmp_path_factory.mktemp("cprog")
    (d / "hello.c").write_text(HELLO_C)
    build = subprocess.run(
        [str(mpicc), "-o", str(d / "a.out"), str(d / "hello.c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if build.returncode != 0:
        pytest.skip(f"mpicc could not build a test program here: {build.stderr[-500:]}")
    return d / "a.out"


def test_this_python_and_np(tmp_path):
    p = launch("-np", "2", sys.executable, *CHECK)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout


def test_a_compiled_mpi_program_runs_with_the_rank_environment(a_out: Path):
    p = launch("-n", "2", str(a_out))
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(2):
        assert f"c rank {r} of 2 sum 3 env-rank {r}" in p.stdout, p.stdout
    bad = launch("-n", "2", str(a_out), "1")
    assert bad.returncode == 3, bad.stdout + bad.stderr
    summary = bad.stderr[bad.stderr.index("cudampi launch: the job failed") :]
    # Open MPI's own message names the rank and the code (not the host) of a program that is
    # not Python: that is what the summary can say.
    assert "rank 1" in summary and "exited with code 3" in summary, summary


def test_cudampi_bench_under_launch():
    argv = ("cudampi", "bench", "allreduce", "--paths", "gpu-ring,mpi", "-b", "8", "-e", "64")
    p = launch("-n", "2", *argv, "-n", "2", "-w", "1")  # bench's own -n: its iterations
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ranks 2 (nodes 1, 2 per node)" in p.stdout and "Verdict: OK" in p.stdout


def test_torchrun_flags():
    p = launch("--nproc-per-node", "2", "--nnodes", "1", *CHECK)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout
    bad = launch("--nproc-per-node", "2", "--nnodes", "2", *CHECK)
    assert bad.returncode == 2 and "needs the hosts" in bad.stderr


def test_host_list_as_mpirun_spells_it():
    p = launch("-np", "2", "-H", f"{HOST}:2", *CHECK)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout


def test_tag_output_prefixes_each_line_with_its_rank():
    p = launch(
        "-n",
        "2",
        "--tag-output",
        sys.executable,
        "-c",
        "import os; print('hi', os.environ['RANK'])",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[1,0]<stdout>: hi 0" in p.stdout and "[1,1]<stdout>: hi 1" in p.stdout


def test_json_goes_to_stderr_or_a_file_never_to_stdout(tmp_path):
    p = launch("-n", "2", "--json", *CHECK)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "{" not in p.stdout and "OK 2" in p.stdout
    assert json.loads(p.stderr[p.stderr.index("{") :])["ok"] is True
    out = tmp_path / "result.json"
    p = launch("-n", "2", "--json-file", str(out), *CHECK)
    assert p.returncode == 0 and "{" not in p.stdout + p.stderr
    assert json.loads(out.read_text())["exit_code"] == 0


AFFINITY = (
    "import os; print('aff', os.environ['RANK'], sorted(os.sched_getaffinity(0)), flush=True)"
)


def test_without_a_gpu_ranks_are_bound_to_cores():
    if query_gpus():
        pytest.skip("a GPU here decides the ranks' cores")
    if query_physical_cores() < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to bind 2 ranks")
    dry = launch("-n", "2", "--dry-run", TARGET)
    assert "# --bind-to core: no GPU here decides the ranks' cores" in dry.stdout, dry.stdout
    assert "--bind-to core" in dry.stdout.splitlines()[-1]
    p = launch("-n", "2", sys.executable, "-c", AFFINITY)
    assert p.returncode == 0, p.stdout + p.stderr
    sets = [ln.split(" ", 2)[2] for ln in p.stdout.splitlines() if ln.startswith("aff ")]
    assert len(sets) == 2 and len(set(sets)) == 2, p.stdout  # one core each, not the same one
    loose = launch("-n", "2", "--bind-to", "none", sys.executable, "-c", AFFINITY)
    assert all(
        len(json.loads(ln.split(" ", 2)[2])) == len(os.sched_getaffinity(0))
        for ln in loose.stdout.splitlines()
        if ln.startswith("aff ")
    ), loose.stdout


@pytest.mark.skipif(
    not Path(MPICH_PY).exists(),
    reason=f"no MPICH python at {MPICH_PY} (set CUDAMPI_TEST_MPICH_PYTHON to a "
    "venv with the mpich and mpi4py wheels)",
)
def test_hydra_hostfile_and_ppn(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{HOST}:2\n")
    p = launch("-f", str(hosts), "-ppn", "2", "--tag-output", *CHECK, python=MPICH_PY)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[0] rank 0 ok" in p.stdout and "OK 2" in p.stdout


# ------------------------------------------------- more flags people type from habit


@pytest.mark.parametrize(
    "flags",
    [["--np", "2"], ["-N", "2"], ["--npernode", "2"], ["--map-by", "ppr:2:node"]],
    ids=["np", "N", "npernode", "map-by"],
)
def test_mpirun_spellings_of_ranks_and_ranks_per_node(flags):
    """``--np 2`` was "ambiguous option"; ``-N``/``--map-by`` the top-level usage and no hint."""
    p = launch(*flags, *CHECK)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout


def test_standalone_is_this_machine():
    p = launch("--standalone", "--nproc-per-node", "2", *CHECK)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 2" in p.stdout
    bad = launch("--standalone", "-H", f"{HOST}:2", *CHECK)
    assert bad.returncode == 2 and "--standalone runs every rank on this machine" in bad.stderr


@pytest.mark.parametrize(
    ("flags", "hint"),
    [
        (["--report-bindings"], "-- --report-bindings"),
        (["--mca", "btl", "tcp,self"], "-- --mca [their values]"),
        (["--map-by", "slot"], "-- --map-by slot"),
    ],
    ids=["report-bindings", "mca", "map-by-slot"],
)
def test_a_launchers_own_flag_before_the_command_says_where_it_goes(flags, hint):
    p = launch("-n", "2", *flags, *CHECK)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "usage: cudampi launch" in p.stderr and "COMMAND ..." not in p.stderr, p.stderr
    assert hint in p.stderr, p.stderr
    assert "OK" not in p.stdout


def test_more_ranks_than_the_hosts_slots_is_refused_as_mpirun_does():
    """``-n 3 -H host:2`` ran 3 ranks on 2 slots without a word; mpirun refuses it."""
    p = launch("-n", "3", "-H", f"{HOST}:2", TARGET, "check", "3", "--flag", "a b")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"-n 3 is more than the 2 slots of the hosts ({HOST}:2)" in p.stderr
    assert "--oversubscribe" in p.stderr and "OK" not in p.stdout
    ok = launch(
        "-n", "3", "-H", f"{HOST}:2", "--oversubscribe", TARGET, "check", "3", "--flag", "a b"
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK 3" in ok.stdout


def test_a_dry_run_looks_up_no_host(tmp_path):
    """A dry run prints the command for hosts this machine cannot resolve (yet)."""
    env = {"TMPDIR": str(tmp_path)}  # where the dry run keeps its hostfile
    p = launch("--dry-run", "-H", "nodea.invalid:1,nodeb.invalid:1", TARGET, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "#   nodea.invalid slots=1" in p.stdout and "#   nodeb.invalid slots=1" in p.stdout
    assert "# dry run: host names were not looked up" in p.stdout
    assert "--hostfile" in p.stdout.splitlines()[-1]
