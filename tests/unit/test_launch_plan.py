"""LaunchPlan -> argv, per launcher: pure, exact."""

from __future__ import annotations

import pytest

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch.argv import build_command
from cudampi.launch.hosts import (
    Host,
    hostfile_text,
    parse_hostfile,
    parse_hosts,
    parse_slot_lines,
)
from cudampi.launch.plan import (
    Allocation,
    Launcher,
    LaunchPlan,
    Machine,
    PlanRequest,
    UcxRecipe,
    make_plan,
)

OMPI = Launcher("openmpi", "/v/bin/mpiexec", "5.0.11", "Open MPI")
MPICH = Launcher("mpich", "/m/bin/mpiexec", "5.0.2", "MPICH")
SRUN = Launcher("slurm", "/usr/bin/srun", "23.02.5", "Slurm")
CMD = ("/v/bin/python", "-m", "cudampi.launch.rank", "/w/train.py", "--lr", "0.1")
U = "/v/lib/python3.12/site-packages/libucx"
UCX = UcxRecipe(
    tuple(f"{U}/lib/{n}" for n in ("libucs.so.0", "libucm.so.0", "libuct.so.0", "libucp.so.0")),
    f"{U}/lib/ucx",
)


def job(*nodes: str) -> Allocation:
    """A Slurm allocation of ``nodes``, as srun's family reads it."""
    return Allocation("slurm", "77", nodes=nodes)


def plan(launcher=OMPI, machine=None, mpi="openmpi", **kw):
    req = PlanRequest(command=CMD, master_port=29500, **kw)
    return make_plan(req, launcher, machine or Machine(cores=8), mpi)


def test_parse_hosts_and_hostfiles_in_both_formats():
    assert parse_hosts("h1:4,h2:4") == (Host("h1", 4), Host("h2", 4))
    assert parse_hosts("a, b") == (Host("a"), Host("b"))
    ompi = "# comment\nnode1 slots=4\nnode2 slots=2 max_slots=8\n\n"
    mpich = "node1:4\nnode2:2  # two\n"
    want = (Host("node1", 4), Host("node2", 2))
    assert parse_hostfile(ompi) == want
    assert parse_hostfile(mpich) == want
    assert parse_hostfile("n1\nn1\nn2 slots=3\n") == (Host("n1", 2), Host("n2", 3))
    assert hostfile_text(want, "openmpi") == "node1 slots=4\nnode2 slots=2\n"
    assert hostfile_text(want, "mpich") == "node1:4\nnode2:2\n"
    with pytest.raises(ConfigError, match="cannot read 'cpus=4'"):
        parse_hostfile("n1 cpus=4\n")
    with pytest.raises(ConfigError, match="names no host"):
        parse_hosts(",")
    with pytest.raises(ConfigError, match="at least 1"):
        parse_hosts("h1:0")
    with pytest.raises(ConfigError, match="more than a launcher can count"):
        parse_hosts(f"h1:{2**31}")
    with pytest.raises(ConfigError, match="more than a launcher can count"):
        parse_hostfile(f"h1 slots={2**31}\n")
    with pytest.raises(ConfigError, match="'h1:²' is not a host name"):
        parse_hosts("h1:²")  # a digit to str.isdigit, not to int()
    assert parse_slot_lines("a\nb\na\n\n") == (Host("a", 2), Host("b", 1))


def test_expand_slurm_nodelist():
    from cudampi.launch.launchers.slurm import expand_nodelist

    outside = {"PATH": "/nonexistent"}  # no scontrol, no allocation: python-hostlist
    assert expand_nodelist("gpu[01-03,7],login1", outside) == [
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu7",
        "login1",
    ]
    assert expand_nodelist("n1", outside) == ["n1"]
    assert expand_nodelist("a[8-10]-ib", outside) == ["a8-ib", "a9-ib", "a10-ib"]
    # two bracket groups: 4 names (the hand-written parser gave 2, feeding -N and MASTER_ADDR)
    assert expand_nodelist("rack[1-2]-node[01-02]", outside) == [
        "rack1-node01",
        "rack1-node02",
        "rack2-node01",
        "rack2-node02",
    ]
    with pytest.raises(LaunchError, match="cannot read the Slurm node list 'n\\[1-'"):
        expand_nodelist("n[1-", outside)


def test_openmpi_single_host_argv_is_exact():
    p = plan(nprocs=2, machine=Machine(cores=8, is_root=True))
    cmd = build_command(p)
    assert cmd.argv == (
        "/v/bin/mpiexec",
        "-n",
        "2",
        "--bind-to",
        "core",  # no GPU here decides the ranks' cores
        "-x",
        "CUDAMPI_LAUNCHER=openmpi",
        "-x",
        "CUDAMPI_BIND_GPU=local",
        "-x",
        "CUDAMPI_BIND_CPU=none",
        "-x",
        "MASTER_ADDR=127.0.0.1",
        "-x",
        "MASTER_PORT=29500",
        *CMD,
    )
    assert dict(cmd.env) == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in cmd.shell()
    assert build_command(plan(nprocs=2)).env == ()  # not root: nothing added


def test_openmpi_oversubscribes_only_beyond_the_cores_and_says_so():
    assert not plan(nprocs=2, machine=Machine(cores=2)).oversubscribe
    p = plan(nprocs=4, machine=Machine(cores=2))
    assert p.oversubscribe and any("--oversubscribe: 4 ranks" in n for n in p.notes)
    assert "--oversubscribe" in build_command(p).argv
    gp = plan(gpus_per_node=4, machine=Machine(cores=2))
    argv = build_command(gp).argv
    assert gp.nprocs == 4
    assert argv[argv.index("--map-by") + 1] == "ppr:4:node:OVERSUBSCRIBE"
    assert "--oversubscribe" not in argv


def test_openmpi_multi_host_uses_hostfile_tcp_network_and_forwards_env():
    m = Machine(cores=2, local_names=frozenset({"10.0.0.1"}), subnet="10.0.0.0/24", ifname="eth1")
    p = plan(
        hosts=(Host("10.0.0.1", 2), Host("10.0.0.2", 2)),
        machine=m,
        rsh_agent=("ssh", "-i", "/k/id", "-o", "StrictHostKeyChecking=no"),
        gpus_per_node=2,
        extra=("--tag-output",),
    )
    cmd = build_command(p, "/tmp/x/hostfile")
    argv = list(cmd.argv)
    assert p.nprocs == 4 and p.multi_host
    assert cmd.hostfile_text == "10.0.0.1 slots=2\n10.0.0.2 slots=2\n"
    assert argv[argv.index("--hostfile") + 1] == "/tmp/x/hostfile"
    assert argv[argv.index("--map-by") + 1] == "ppr:2:node"
    assert argv[argv.index("plm_rsh_agent") - 1 : argv.index("plm_rsh_agent") + 2] == [
        "--mca",
        "plm_rsh_agent",
        "ssh -i /k/id -o StrictHostKeyChecking=no",
    ]
    assert argv[argv.index("btl_tcp_if_include") - 1 : argv.index("btl_tcp_if_include") + 2] == [
        "--mca",
        "btl_tcp_if_include",
        "10.0.0.0/24",
    ]
    assert "oob_tcp_if_include" in argv
    assert "MASTER_ADDR=10.0.0.1" in argv
    for name in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH"):
        assert argv[argv.index(name) - 1] == "-x"
    # raw flags go right before the rank command
    assert argv[-len(CMD) - 1 :] == ["--tag-output", *CMD]
    # without a hostfile path, --host carries the slots
    assert "--host" in build_command(p).argv and "10.0.0.1:2,10.0.0.2:2" in build_command(p).argv


def test_too_many_ranks_for_the_hosts_slots_is_a_usage_error():
    m = Machine(cores=2, local_names=frozenset({"a"}))
    with pytest.raises(ConfigError, match="more than the 4 slots"):
        plan(nprocs=8, hosts=(Host("a", 2), Host("b", 2)), machine=m)
    assert plan(
        nprocs=8, hosts=(Host("a", 2), Host("b", 2)), machine=m, oversubscribe=True
    ).oversubscribe
    with pytest.raises(ConfigError, match="more than --gpus-per-node 2"):
        plan(nprocs=3, gpus_per_node=2)


@pytest.mark.parametrize("launcher", [OMPI, MPICH, SRUN], ids=["openmpi", "mpich", "srun"])
def test_more_ranks_than_slots_on_one_host_is_refused_unless_asked(launcher):
    """mpirun refuses ``-n 3 -H localhost:2``; every launcher of cudampi does, the same way."""
    m = Machine(cores=8, local_names=frozenset({"localhost"}))
    with pytest.raises(ConfigError, match=r"-n 3 is more than the 2 slots .*--oversubscribe"):
        plan(launcher, m, nprocs=3, hosts=(Host("localhost", 2),))
    assert (
        plan(launcher, m, nprocs=3, hosts=(Host("localhost", 2),), oversubscribe=True).nprocs == 3
    )
    assert not plan(launcher, m, nprocs=3, hosts=(Host("localhost"),)).oversubscribe


def test_cuda_aware_wheel_recipe_is_exactly_the_device_wheels_one():
    p = plan(nprocs=2, machine=Machine(cores=8, gpus=2, ucx=UCX))
    argv = list(build_command(p).argv)
    preload = ":".join(
        f"{U}/lib/{n}" for n in ("libucs.so.0", "libucm.so.0", "libuct.so.0", "libucp.so.0")
    )
    assert f"LD_PRELOAD={preload}" in argv
    assert f"UCX_MODULE_DIR={U}/lib/ucx" in argv
    assert argv[argv.index("pml") - 1 : argv.index("pml") + 2] == ["--mca", "pml", "ucx"]
    # auto without a GPU: nothing; yes without libucx: an error naming the fix
    assert "pml" not in build_command(plan(nprocs=2, machine=Machine(cores=8, ucx=UCX))).argv
    with pytest.raises(ConfigError, match="pip install libucx-cu12"):
        plan(nprocs=2, cuda_aware="yes")
    with pytest.raises(ConfigError, match="for Open MPI"):
        plan(launcher=MPICH, mpi="mpich", nprocs=2, cuda_aware="yes")
    gpu_no_ucx = plan(nprocs=2, machine=Machine(cores=8, gpus=1))
    assert any("libucx is not installed" in n for n in gpu_no_ucx.notes)


def test_mpich_argv_is_exact():
    m = Machine(cores=8, local_names=frozenset({"n1"}), ifname="ib0")
    p = plan(
        launcher=MPICH,
        mpi="mpich",
        hosts=(Host("n1", 4), Host("n2", 4)),
        machine=m,
        gpus_per_node=4,
        bind="core",
        rsh_agent=("ssh", "-p", "2222"),
    )
    cmd = build_command(p, "/t/hostfile")
    assert cmd.hostfile_text == "n1:4\nn2:4\n"
    assert cmd.argv[:14] == (
        "/m/bin/mpiexec",
        "-n",
        "8",
        "-f",
        "/t/hostfile",
        "-ppn",
        "4",
        "-bind-to",
        "core",
        "-launcher",
        "ssh",
        "-launcher-exec",
        "ssh -p 2222",
        "-iface",
    )
    assert cmd.argv[14] == "ib0"
    assert cmd.argv[15:18] == ("-genv", "CUDAMPI_LAUNCHER", "mpich")
    assert "-genvlist" in cmd.argv and cmd.argv[-len(CMD) :] == CMD
    assert cmd.env == ()  # Hydra has no root check


def test_srun_argv_puts_the_rank_env_in_srun_environment():
    m = Machine(cores=8, gpus=4, ucx=UCX, is_root=True, allocation=job("gpu01", "gpu02"))
    p = plan(launcher=SRUN, machine=m, gpus_per_node=4)
    cmd = build_command(p)
    assert p.nprocs == 8
    assert cmd.argv == (
        "/usr/bin/srun",
        "-n",
        "8",
        "--ntasks-per-node=4",
        "--cpu-bind=none",
        "--kill-on-bad-exit=1",
        "--mpi=pmix",
        *CMD,
    )
    env = dict(cmd.env)
    assert env["MASTER_ADDR"] == "gpu01"
    assert env["OMPI_MCA_pml"] == "ucx" and env["UCX_MODULE_DIR"] == f"{U}/lib/ucx"
    assert env["CUDAMPI_LAUNCHER"] == "slurm" and env["CUDAMPI_GPUS_PER_NODE"] == "4"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    mp = plan(launcher=SRUN, mpi="mpich", nprocs=2, bind="numa")
    assert "--mpi=pmi2" in build_command(mp).argv and "--cpu-bind=ldoms" in build_command(mp).argv


def test_ifname_flag_sets_nccl_gloo_and_mpi_tcp():
    m = Machine(cores=2, local_names=frozenset({"a"}))
    p = plan(nprocs=2, hosts=(Host("a", 1), Host("b", 1)), machine=m, ifname="eth7")
    env = dict(p.env)
    assert env["NCCL_SOCKET_IFNAME"] == "eth7" and env["GLOO_SOCKET_IFNAME"] == "eth7"
    assert ("btl_tcp_if_include", "eth7") in p.mca


def test_plan_validation_and_json():
    with pytest.raises(ConfigError, match="at least 1"):
        LaunchPlan(OMPI, CMD, 0)
    with pytest.raises(ConfigError, match="--bind-to"):
        plan(nprocs=1, bind="hwthread")
    with pytest.raises(ConfigError, match="flavour"):
        Launcher("lam", "/x")
    d = plan(nprocs=2).to_json()
    assert d["nprocs"] == 2 and d["launcher"]["flavour"] == "openmpi"


def test_nccl_settings_of_this_host_reach_remote_ranks():
    """NCCL reads NCCL_SOCKET_IFNAME, NCCL_IB_* in every rank: those set here are forwarded to
    the other hosts (Open MPI's mpirun forwards nothing by itself); --ifname's own value wins."""
    names = frozenset({"PATH", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "GLOO_X"})
    m = Machine(cores=2, local_names=frozenset({"a"}), env_names=names)
    hosts = (Host("a", 1), Host("b", 1))
    argv = list(build_command(plan(hosts=hosts, machine=m)).argv)
    for name in ("NCCL_DEBUG", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"):
        assert argv[argv.index(name) - 1] == "-x", name
    assert "GLOO_X" not in argv
    p = plan(hosts=hosts, machine=m, ifname="ib0")
    argv = list(build_command(p).argv)
    assert "NCCL_SOCKET_IFNAME=ib0" in argv and "NCCL_SOCKET_IFNAME" not in argv
    assert "forwarded to every host: NCCL_DEBUG, NCCL_IB_HCA" in p.notes
    hydra = list(build_command(plan(MPICH, hosts=hosts, machine=m, mpi="mpich")).argv)
    assert hydra[hydra.index("-genvlist") + 1] == "PATH,NCCL_DEBUG,NCCL_IB_HCA,NCCL_SOCKET_IFNAME"
    # one host: the ranks inherit this environment, nothing to forward
    assert "NCCL_IB_HCA" not in build_command(plan(machine=m)).argv


# ----------------------------------------------------------------------- the field's habits


@pytest.mark.parametrize(
    ("launcher", "flag"),
    [(OMPI, "--bind-to core"), (MPICH, "-bind-to core"), (SRUN, "--cpu-bind=cores")],
)
def test_without_a_gpu_ranks_are_bound_to_cores_and_the_plan_says_why(launcher, flag):
    mpi = "mpich" if launcher is MPICH else "openmpi"
    p = plan(launcher, Machine(cores=8), mpi, nprocs=4)
    assert p.bind == "core" and dict(p.env)["CUDAMPI_BIND_CPU"] == "none"
    assert flag in " ".join(build_command(p).argv)
    assert any(n.startswith("--bind-to core: no GPU here decides") for n in p.notes), p.notes


def test_binding_without_a_gpu_backs_off_where_cores_cannot_be_had():
    over = plan(machine=Machine(cores=2), nprocs=4)
    assert over.bind == "none" and over.oversubscribe
    assert any("4 ranks cannot each have one of this host's 2 core(s)" in n for n in over.notes)
    remote = plan(
        machine=Machine(cores=8, local_names=frozenset({"me"})),
        nprocs=2,
        hosts=(Host("h1", 1), Host("h2", 1)),
    )
    assert remote.bind == "gpu"  # the other hosts' ranks bind to their own GPUs
    with_gpu = plan(machine=Machine(cores=8, gpus=2), nprocs=2)
    assert with_gpu.bind == "gpu" and "--bind-to none" in " ".join(build_command(with_gpu).argv)
    explicit = plan(machine=Machine(cores=8), nprocs=2, bind="none")
    assert explicit.bind == "none"


@pytest.mark.parametrize(
    ("launcher", "flag"), [(OMPI, "--tag-output"), (MPICH, "-l"), (SRUN, "--label")]
)
def test_tag_output_is_each_launchers_own_flag(launcher, flag):
    mpi = "mpich" if launcher is MPICH else "openmpi"
    argv = build_command(plan(launcher, None, mpi, nprocs=2, tag_output=True)).argv
    assert flag in argv and argv.index(flag) < argv.index(CMD[0])
    assert flag not in build_command(plan(launcher, None, mpi, nprocs=2)).argv


def test_torchrun_nnodes_and_nproc_per_node():
    hosts = (Host("h1"), Host("h2"))
    p = plan(machine=Machine(cores=8), gpus_per_node=4, nnodes=2, hosts=hosts)
    assert p.nprocs == 8 and "-n 8: 4 GPU(s) per node x 2 node(s)" in p.notes
    with pytest.raises(ConfigError, match="--nnodes 3 but the hosts name 2 node"):
        plan(gpus_per_node=4, nnodes=3, hosts=hosts)
    with pytest.raises(ConfigError, match="needs the hosts"):
        plan(gpus_per_node=4, nnodes=2)
    one = plan(gpus_per_node=2, nnodes=1)
    assert one.nprocs == 2
    srun = plan(SRUN, Machine(cores=8, allocation=job("a", "b", "c")), gpus_per_node=2, nnodes=2)
    assert srun.nprocs == 4 and "-N 2" in " ".join(build_command(srun).argv)
    with pytest.raises(ConfigError, match="allocation has 3 node"):
        plan(SRUN, Machine(cores=8, allocation=job("a", "b", "c")), gpus_per_node=2, nnodes=4)
