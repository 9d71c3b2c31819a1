"""The documented settings and check_settings: each rule flags the wrong value, passes the right."""

from __future__ import annotations

import pytest

from cudampi.env.recommended import SETTINGS, mpirun_flags, recommended_env
from cudampi.env.settings import SettingFinding, check_settings, parse_env_file


def names(findings):
    return {(f.name, f.status) for f in findings}


def test_every_setting_is_documented_with_reason_and_source():
    seen = set()
    for s in SETTINGS:
        assert s.reason and len(s.reason) > 40, s.name
        assert "http" in s.source or "tests/fixtures" in s.source or "mpirun(1)" in s.source, s.name
        assert set(s.applies_to) <= {"openmpi4", "openmpi5", "mpich", "ucx", "nccl"}
        assert s.kind in ("env", "mpirun")
        seen.add(s.name)
    for needed in (
        "OMPI_MCA_pml",
        "OMPI_MCA_btl",
        "OMPI_MCA_oob_tcp_listen_mode",
        "OMPI_MCA_plm_rsh_agent",
        "NCCL_SOCKET_IFNAME",
        "UCX_TLS",
        "--bind-to",
        "--map-by",
    ):
        assert needed in seen


@pytest.mark.parametrize(
    "mpi,major,cuda_built",
    [("openmpi", 5, False), ("openmpi", 4, True), ("openmpi", 5, True), ("mpich", None, False)],
)
@pytest.mark.parametrize("multi", [True, False])
def test_recommended_settings_pass_the_check(mpi, major, cuda_built, multi):
    env = recommended_env(mpi, major, multi_node=multi, cuda_built=cuda_built)
    assert (env.get("NCCL_SOCKET_IFNAME") == "^lo,docker") == multi
    assert (
        check_settings(
            env,
            multi_node=multi,
            ompi_major=major,
            built_with_cuda=cuda_built if mpi == "openmpi" else None,
        )
        == []
    )
    if mpi == "openmpi":
        assert env["OMPI_MCA_pml"] == "ucx"
        assert ("OMPI_MCA_opal_cuda_support" in env) == cuda_built
        assert ("OMPI_MCA_oob_tcp_listen_mode" in env) == (major == 4 and multi)
    else:
        assert not any(k.startswith("OMPI_") for k in env)


def test_mpirun_flags_place_one_rank_per_gpu():
    assert mpirun_flags(8) == ["--map-by", "ppr:8:node", "--bind-to", "numa"]
    assert mpirun_flags(4, "mpich") == ["-ppn", "4"]


@pytest.mark.parametrize(
    ("env", "kw", "expected"),
    [
        ({"UCX_TLS": "rc,tcp"}, {}, ("UCX_TLS", "fail")),
        ({"UCX_TLS": "^cuda_ipc"}, {}, ("UCX_TLS", "fail")),
        ({"OMPI_MCA_pml": "ob1"}, {}, ("OMPI_MCA_pml", "fail")),
        ({"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self,smcuda"}, {}, ("OMPI_MCA_pml", "warn")),
        ({"OMPI_MCA_btl": "tcp,vader"}, {}, ("OMPI_MCA_btl", "fail")),
        ({"OMPI_MCA_btl": "^self"}, {}, ("OMPI_MCA_btl", "fail")),
        (
            {"OMPI_MCA_btl": "tcp,self,smcuda"},
            {"btl_components": {"self", "sm", "tcp", "ofi", "uct"}},
            ("OMPI_MCA_btl", "fail"),
        ),
        ({"OMPI_MCA_btl": "openib,self"}, {"ompi_major": 5}, ("OMPI_MCA_btl", "fail")),
        (
            {"OMPI_MCA_btl": "vader,self", "OMPI_MCA_pml": "ucx"},
            {"ompi_major": 5},
            ("OMPI_MCA_btl", "warn"),
        ),
        ({"NCCL_SOCKET_IFNAME": "lo"}, {"multi_node": True}, ("NCCL_SOCKET_IFNAME", "fail")),
        ({"NCCL_SOCKET_IFNAME": "=lo"}, {"multi_node": False}, ("NCCL_SOCKET_IFNAME", "warn")),
        (
            {"NCCL_SOCKET_IFNAME": "lo", "SLURM_JOB_NUM_NODES": "2"},
            {},
            ("NCCL_SOCKET_IFNAME", "fail"),
        ),
        (
            {"NCCL_SOCKET_IFNAME": "lo", "K_MPI_JOB_ROLE": "worker"},
            {},
            ("NCCL_SOCKET_IFNAME", "fail"),
        ),
        (
            {"OMPI_MCA_oob_tcp_listen_mode": "listen_thread"},
            {"ompi_major": 5},
            ("OMPI_MCA_oob_tcp_listen_mode", "warn"),
        ),
        (
            {"OMPI_MCA_plm_ssh_agent": "false"},
            {"multi_node": True},
            ("OMPI_MCA_plm_ssh_agent", "fail"),
        ),
        (
            {"OMPI_MCA_opal_cuda_support": "true"},
            {"built_with_cuda": False},
            ("OMPI_MCA_opal_cuda_support", "fail"),
        ),
        ({"OMPI_MCA_opal_cuda_support": "0"}, {}, ("OMPI_MCA_opal_cuda_support", "warn")),
        ({"OMPI_MCA_pml": "ucx"}, {"gpus": False}, ("OMPI_MCA_pml", "warn")),
        ({"NCCL_P2P_DISABLE": "1"}, {}, ("NCCL_P2P_DISABLE", "warn")),
        ({"MPIR_CVAR_ENABLE_GPU": "0"}, {}, ("MPIR_CVAR_ENABLE_GPU", "warn")),
    ],
)
def test_wrong_settings_are_flagged(env, kw, expected):
    findings = check_settings(env, **kw)
    assert expected in names(findings), findings
    for f in findings:
        assert isinstance(f, SettingFinding)
        assert f.detail and f.fix
        assert f.value == env[f.name]


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"UCX_TLS": "rc,sm,self,cuda_copy,cuda_ipc,gdr_copy"},
        {"UCX_TLS": "rc,cuda"},
        {"UCX_TLS": "all"},
        {"UCX_TLS": "^ud"},
        {"OMPI_MCA_btl": "^openib", "OMPI_MCA_pml": "ucx"},
        {"NCCL_SOCKET_IFNAME": "=eth0"},
        {"NCCL_SOCKET_IFNAME": "^lo,docker"},
        {"OMPI_MCA_oob_tcp_listen_mode": "listen_thread"},
        {"OMPI_MCA_plm_rsh_agent": "ssh"},
        {"OMPI_MCA_opal_cuda_support": "true"},
    ],
)
def test_right_settings_pass(env):
    assert check_settings(env, multi_node=True) == []


def test_multi_node_only_problems_are_warnings_when_the_shape_is_unknown():
    assert names(check_settings({"NCCL_SOCKET_IFNAME": "lo"})) == {("NCCL_SOCKET_IFNAME", "warn")}


def test_finding_status_is_checked():
    with pytest.raises(ValueError, match="'error'"):
        SettingFinding("X", "1", "error", "d", "f")


def test_parse_env_file_reads_exports_and_quotes():
    text = "# c\nexport A='x y'\nB=\"z\"\n  export C=^lo,docker\nnot a line\n"
    assert parse_env_file(text) == {"A": "x y", "B": "z", "C": "^lo,docker"}


def test_ucx_tls_without_cuda_is_flagged():
    """Also without GPUs (a warning then), as the doctor reports it."""
    assert names(check_settings({"UCX_TLS": "tcp,sm,self"}, gpus=True)) == {("UCX_TLS", "fail")}
    assert names(check_settings({"UCX_TLS": "tcp,sm,self"}, gpus=False)) == {("UCX_TLS", "warn")}
    assert check_settings({"UCX_TLS": "sm,self,cuda_copy,cuda_ipc"}, gpus=True) == []
    assert check_settings({"UCX_TLS": "all"}, gpus=True) == []
    assert check_settings({"UCX_TLS": "^ib"}, gpus=True) == []
    assert names(check_settings({"UCX_TLS": "^cuda_ipc,ib"}, gpus=True)) == {("UCX_TLS", "fail")}
    assert names(check_settings({"UCX_TLS": "^gdr_copy"}, gpus=True)) == {("UCX_TLS", "fail")}
    fix = check_settings({"UCX_TLS": "tcp,self"}, gpus=True)[0].fix
    assert "UCX_TLS=tcp,self,cuda_copy,cuda_ipc" in fix


def test_settings_that_take_cuda_away():
    env = {
        "OMPI_MCA_pml": "ob1",
        "OMPI_MCA_opal_cuda_support": "0",
        "UCX_IB_GPU_DIRECT_RDMA": "no",
        "NCCL_P2P_DISABLE": "1",
    }
    assert names(check_settings(env, gpus=True)) == {
        ("OMPI_MCA_pml", "fail"),
        ("OMPI_MCA_opal_cuda_support", "warn"),
        ("UCX_IB_GPU_DIRECT_RDMA", "warn"),
        ("NCCL_P2P_DISABLE", "warn"),
    }
    assert (
        check_settings({"OMPI_MCA_pml": "ucx", "OMPI_MCA_opal_cuda_support": "1"}, gpus=True) == []
    )
    more = {
        "OMPI_MCA_pml": "cm",
        "OMPI_MCA_mpi_cuda_support": "disabled",
        "OMPI_MCA_btl": "^smcuda",
        "MPICH_GPU_SUPPORT_ENABLED": "0",
        "NCCL_IB_DISABLE": "yes",
    }
    assert names(check_settings(more, gpus=True)) == {
        ("OMPI_MCA_pml", "warn"),
        ("OMPI_MCA_mpi_cuda_support", "fail"),
        ("OMPI_MCA_btl", "warn"),
        ("MPICH_GPU_SUPPORT_ENABLED", "warn"),
        ("NCCL_IB_DISABLE", "warn"),
    }


def test_one_rule_per_variable():
    """Each variable is judged by one rule, so two verdicts on one value cannot disagree."""
    from cudampi.env.findings import Facts as _Facts
    from cudampi.env.settings import RULES

    env = {
        "OMPI_MCA_pml": "ob1",
        "OMPI_MCA_btl": "tcp",
        "OMPI_MCA_opal_cuda_support": "0",
        "OMPI_MCA_mpi_cuda_support": "0",
        "OMPI_MCA_oob_tcp_listen_mode": "x",
        "OMPI_MCA_plm_rsh_agent": "false",
        "NCCL_SOCKET_IFNAME": "lo",
        "UCX_TLS": "tcp",
        "UCX_IB_GPU_DIRECT_RDMA": "no",
        "NCCL_P2P_DISABLE": "1",
        "MPIR_CVAR_ENABLE_GPU": "0",
    }
    owner: dict[str, str] = {}
    for gpus in (True, False):
        facts = _Facts(gpus, None, 5, ("self", "sm", "tcp"), False)
        for rule in RULES:
            for finding in rule(env, facts):
                assert owner.setdefault(finding.name, rule.__name__) == rule.__name__, finding
    assert set(owner) == set(env)
