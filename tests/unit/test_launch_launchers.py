"""The launcher families: one module each, found by name, and nothing outside them that asks
which launcher it is.

PBS and LSF are proven on their real formats (a PBS_NODEFILE as OpenPBS writes it for
``select=2:ncpus=4:mpiprocs=2``; LSB_MCPU_HOSTS and LSB_DJOB_HOSTFILE as LSF writes them on a CSM
cluster, the launch node first with one slot): no PBS or LSF daemon can be installed here, so
their jobs are the variables and files those daemons give a job. The real mpirun under a PBS job's
variables is tests/mpi/test_launch_jobs.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch import launchers
from cudampi.launch.argv import build_command
from cudampi.launch.hosts import Host
from cudampi.launch.launchers.lsf import parse_host_counts
from cudampi.launch.plan import Launcher, Machine, PlanRequest, make_plan
from cudampi.names import JOB_SYSTEMS, LAUNCH_FAMILIES, LAUNCHERS, RANK_VARS
from cudampi.rankenv import RankEnv, job_env, rank_env

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "cudampi"
FAMILIES = SRC / "launch" / "launchers"

OMPI = Launcher("openmpi", "/v/bin/mpiexec", "5.0.11", "Open MPI")
HYDRA = Launcher("mpich", "/m/bin/mpiexec", "5.0.2", "MPICH")
JSRUN = Launcher("lsf", "/opt/ibm/jsm/bin/jsrun", "", "IBM jsrun")
CMD = ("/v/bin/python", "-m", "cudampi.launch.rank", "/w/train.py")

# OpenPBS, qsub -l select=2:ncpus=4:mpiprocs=2: each chunk's host once per MPI process
PBS_NODEFILE = "cn-0101.cluster\ncn-0101.cluster\ncn-0102.cluster\ncn-0102.cluster\n"
# LSF on a CSM cluster (jsrun's): the launch node first with one slot, then 42 per compute node
LSF_MCPU = "batch3 1 a01n01 42 a01n02 42"


def plan(launcher: Launcher, machine: Machine, **kw: object):
    return make_plan(
        PlanRequest(command=CMD, master_port=29500, **kw), launcher, machine, "openmpi"
    )


def pbs_env(tmp_path: Path, text: str = PBS_NODEFILE) -> dict[str, str]:
    """What OpenPBS gives job 4242's script (its nodefile under PBS_HOME/aux)."""
    nodefile = tmp_path / "aux" / "4242.pbs01"
    nodefile.parent.mkdir(exist_ok=True)
    nodefile.write_text(text)
    return {
        "PBS_JOBID": "4242.pbs01",
        "PBS_NODEFILE": str(nodefile),
        "PBS_ENVIRONMENT": "PBS_BATCH",
        "PBS_O_WORKDIR": "/home/u/run",
        "PBS_JOBNAME": "train",
    }


def test_every_family_is_one_module_found_by_its_name():
    modules = {p.stem for p in FAMILIES.glob("*.py")} - {"__init__", "base"}
    assert modules == set(LAUNCH_FAMILIES), "a family module needs its name in names.py"
    assert [f.name for f in launchers.families()] == list(LAUNCH_FAMILIES)
    assert set(JOB_SYSTEMS) <= set(LAUNCH_FAMILIES)
    assert launchers.choices() == ("auto", "mpirun", "mpiexec", "srun", "jsrun")
    with pytest.raises(ConfigError, match="no launcher family 'flux'"):
        launchers.family("flux")


def test_a_pbs_job_gives_its_hosts_and_slots_to_mpirun(tmp_path):
    env = pbs_env(tmp_path)
    job = job_env(env)
    assert job is not None and (job.system, job.job_id) == ("pbs", "4242.pbs01")
    alloc = launchers.allocation(env, OMPI)
    assert alloc is not None and alloc.system == "pbs"
    assert alloc.hosts == (Host("cn-0101.cluster", 2), Host("cn-0102.cluster", 2))
    p = plan(OMPI, Machine(cores=8, local_names=frozenset({"cn-0101.cluster"}), allocation=alloc))
    assert p.nprocs == 4 and p.multi_host
    assert f"hosts: the PBS/OpenPBS job's (PBS_NODEFILE {env['PBS_NODEFILE']})" in p.notes
    assert "-n 4: the hosts' slots" in p.notes
    cmd = build_command(p, "/tmp/w/hostfile")
    assert cmd.hostfile_text == "cn-0101.cluster slots=2\ncn-0102.cluster slots=2\n"
    assert cmd.argv[:5] == ("/v/bin/mpiexec", "-n", "4", "--hostfile", "/tmp/w/hostfile")
    hydra = build_command(plan(HYDRA, Machine(cores=8, allocation=alloc)), "/tmp/w/hostfile")
    assert hydra.hostfile_text == "cn-0101.cluster:2\ncn-0102.cluster:2\n"
    assert hydra.argv[3:5] == ("-f", "/tmp/w/hostfile")
    # hosts given on the command line win over the job's
    mine = plan(OMPI, Machine(cores=8, allocation=alloc), hosts=(Host("cn-0102.cluster", 1),))
    assert mine.hosts == (Host("cn-0102.cluster", 1),) and mine.nprocs == 1
    with pytest.raises(ConfigError, match=r"the PBS/OpenPBS job has 2 node.*ask qsub for 3"):
        plan(OMPI, Machine(cores=8, allocation=alloc), nnodes=3, gpus_per_node=1)


def test_a_pbs_job_without_its_nodefile_says_so(tmp_path):
    env = pbs_env(tmp_path)
    del env["PBS_NODEFILE"]
    with pytest.raises(LaunchError, match=r"PBS job '4242\.pbs01' but PBS_NODEFILE is not set"):
        launchers.allocation(env, OMPI)
    env = pbs_env(tmp_path, "\n\n")
    with pytest.raises(ConfigError, match="names no host"):
        launchers.allocation(env, OMPI)


def test_an_lsf_job_under_mpirun_and_under_jsrun(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("batch3\n" + "a01n01\n" * 42 + "a01n02\n" * 42)
    csm = {"LSB_JOBID": "99", "LSB_MCPU_HOSTS": LSF_MCPU, "LSB_DJOB_HOSTFILE": str(hostfile)}
    mpirun = launchers.allocation(csm, OMPI)
    assert mpirun is not None and mpirun.hosts == (
        Host("batch3", 1),
        Host("a01n01", 42),
        Host("a01n02", 42),
    )
    assert mpirun.hosts_from == f"LSB_DJOB_HOSTFILE {hostfile}"
    # jsrun places tasks itself, never on the launch node
    jobs = launchers.allocation(csm, JSRUN)
    assert jobs is not None and jobs.nodes == ("a01n01", "a01n02") and jobs.hosts == ()
    p = plan(JSRUN, Machine(cores=64, allocation=jobs), gpus_per_node=6)
    assert p.nprocs == 12
    cmd = build_command(p)
    assert cmd.argv[:11] == (
        "/opt/ibm/jsm/bin/jsrun",
        "--nrs",
        "12",
        "--tasks_per_rs",
        "1",
        "--gpu_per_rs",
        "1",
        "--rs_per_host",
        "6",
        "--bind",
        "packed:1",  # no GPU here decides the cores: one core per rank, as mpirun's core
    )
    assert cmd.argv[11:13] == ("-E", "CUDAMPI_LAUNCHER=lsf") and cmd.argv[-len(CMD) :] == CMD
    assert "MASTER_ADDR=a01n01" in cmd.argv  # rank 0 is on the first compute node
    assert "--stdio_mode" in build_command(plan(JSRUN, Machine(cores=8), tag_output=True)).argv
    # a plain LSF cluster: LSB_MCPU_HOSTS alone
    plain = launchers.allocation({"LSB_JOBID": "7", "LSB_MCPU_HOSTS": "hostA 4 hostB 4"}, OMPI)
    assert plain is not None and plain.hosts == (Host("hostA", 4), Host("hostB", 4))
    with pytest.raises(ConfigError, match="'x' is not a count"):
        parse_host_counts("hostA x")
    with pytest.raises(LaunchError, match="neither LSB_DJOB_HOSTFILE nor LSB_MCPU_HOSTS"):
        launchers.allocation({"LSB_JOBID": "7"}, OMPI)


def test_a_jsrun_task_knows_its_place():
    jsm = {
        "LSB_JOBID": "1234",
        "JSM_NAMESPACE_SIZE": "4",
        "JSM_NAMESPACE_RANK": "3",
        "JSM_NAMESPACE_LOCAL_RANK": "1",
        "JSM_NAMESPACE_LOCAL_SIZE": "2",
    }
    assert rank_env(jsm) == RankEnv(3, 4, 1, 2, "lsf")
    assert rank_env({k: v for k, v in jsm.items() if k != "LSB_JOBID"}).launcher == "none"


def test_auto_takes_the_batch_jobs_own_launcher_from_path(tmp_path):
    """Inside an LSF job with jsrun on PATH, ``--launcher auto`` is jsrun (as srun in a Slurm
    job); outside one, or without jsrun, it is not. (jsrun itself cannot run here: the stand-in
    on PATH is only found, never run.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    jsrun = bin_dir / "jsrun"
    jsrun.write_text("#!/bin/sh\nexit 99\n")
    jsrun.chmod(0o755)
    env = {"PATH": str(bin_dir), "LSB_JOBID": "5", "LSB_MCPU_HOSTS": "h 1"}
    found = launchers.find_launcher("auto", env)
    assert found == Launcher("lsf", str(jsrun), "", "IBM jsrun")
    assert launchers.find_launcher("auto", {"PATH": str(bin_dir)}) is None
    assert launchers.identify(str(jsrun)) == found
    with pytest.raises(LaunchError, match="jsrun is not on PATH"):
        launchers.find_launcher("jsrun", {"PATH": str(tmp_path)})


# ------------------------------------------------------------ one place for each launcher

ALLOWED = ("launch/launchers/", "names.py", "rankenv.py")
"""Where launchers are named: their own modules, the names, the one reader of their variables."""

ELSEWHERE = {
    "env/files.py": "the generated files' targets: 'slurm' is job.sbatch's, named after its system",
    "env/cli.py": "the same targets, as `cudampi env --only` takes them",
    "env/slurm.py": "writes the Slurm job script (its srun line), a file, not a launch cudampi runs",
}

BATCH_WORDS = {"slurm", "pbs", "lsf", "srun", "jsrun"}
JOB_VARIABLE = re.compile(r"(SLURM|PBS|LSB|JSM)_[A-Z0-9_]+")
LAUNCHER_NAMES = (set(LAUNCHERS) | set(LAUNCH_FAMILIES)) - {"none"}
READ_VARIABLE = re.compile(r"(OMPI_COMM_WORLD|PMIX?|MPI_LOCAL|HYDI|SLURM|PBS|LSB|JSM)_[A-Z0-9_]*")


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _launcher_specific(tree: ast.AST) -> list[tuple[int, str]]:
    """What in ``tree`` names a particular launcher: a batch system's name or variable, a
    comparison of a launcher with a launcher's name, a read of a launcher's variable."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in BATCH_WORDS or JOB_VARIABLE.fullmatch(node.value):
                found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = [s for o in operands for s in _strings(o)]
            others = " ".join(ast.unparse(o) for o in operands if not _strings(o))
            if set(named) & LAUNCHER_NAMES and re.search("launcher", others, re.I):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Call, ast.Subscript)):
            key = (
                (node.args[0] if node.args else None) if isinstance(node, ast.Call) else node.slice
            )
            reads = isinstance(node, ast.Subscript) or (
                isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv")
            )
            if reads and key is not None and any(READ_VARIABLE.fullmatch(s) for s in _strings(key)):
                found.append((node.lineno, ast.unparse(node)))
    return found


def launcher_specific_code(src: Path = SRC) -> list[str]:
    out = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel.startswith(ALLOWED) or rel.startswith(tuple(ELSEWHERE)):
            continue
        out += [
            f"{rel}:{line}: {what}"
            for line, what in _launcher_specific(ast.parse(path.read_text()))
        ]
    return out


def test_no_launcher_is_named_outside_its_module():
    """A new launcher is its module in launch/launchers/ plus its name and variables in
    names.py: code elsewhere asks the family (``launchers.family(flavour).X``) or rankenv,
    never compares a launcher with a name or reads a launcher's variable itself."""
    assert launcher_specific_code() == []


def test_the_check_finds_what_it_forbids(tmp_path):
    """The rule above, on the kinds of code it replaced."""
    (tmp_path / "bad.py").write_text(
        "import os\n"
        "def f(launcher, env, re_):\n"
        "    if launcher.flavour == 'slurm':\n"
        "        return env.get('SLURM_JOB_NODELIST')\n"
        "    if re_.launcher in ('openmpi', 'mpich'):\n"
        "        return os.environ.get('OMPI_COMM_WORLD_LOCAL_RANK')\n"
        "    return os.environ['PMI_RANK']\n"
    )
    found = launcher_specific_code(tmp_path)
    assert sorted(int(f.split(":")[1]) for f in found) == [3, 3, 4, 4, 5, 6, 7], found
    assert all(n in RANK_VARS for n in ("openmpi", "mpich", "slurm", "lsf"))
