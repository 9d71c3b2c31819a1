"""Launcher environment: settings that take CUDA away, NCCL_SOCKET_IFNAME matching,
CUDA_VISIBLE_DEVICES, launcher detection from variables (the real ones are in
tests/mpi/test_doctor_cli.py, seen by real ranks)."""

from __future__ import annotations

from cudampi.probe.launcher import (
    check_cuda_settings,
    detect_launcher,
    gpu_for_local_rank,
    nccl_ifname_matches,
    visible_devices,
)


def _vars(issues):
    return {(i.var, i.severity) for i in issues}


def test_ucx_tls_without_cuda_is_flagged():
    assert _vars(check_cuda_settings({"UCX_TLS": "tcp,sm,self"}, gpus_present=True)) == {
        ("UCX_TLS", "fail")
    }
    assert _vars(check_cuda_settings({"UCX_TLS": "tcp,sm,self"}, gpus_present=False)) == {
        ("UCX_TLS", "warn")
    }
    assert check_cuda_settings({"UCX_TLS": "sm,self,cuda_copy,cuda_ipc"}, True) == []
    assert check_cuda_settings({"UCX_TLS": "all"}, True) == []
    assert check_cuda_settings({"UCX_TLS": "^ib"}, True) == []
    assert _vars(check_cuda_settings({"UCX_TLS": "^cuda_ipc,ib"}, True)) == {("UCX_TLS", "fail")}
    fix = check_cuda_settings({"UCX_TLS": "tcp,self"}, True)[0].fix
    assert "UCX_TLS=tcp,self,cuda_copy,cuda_ipc" in fix


def test_other_settings():
    env = {
        "OMPI_MCA_pml": "ob1",
        "OMPI_MCA_opal_cuda_support": "0",
        "UCX_IB_GPU_DIRECT_RDMA": "no",
        "NCCL_P2P_DISABLE": "1",
    }
    got = _vars(check_cuda_settings(env, gpus_present=True))
    assert got == {
        ("OMPI_MCA_pml", "warn"),
        ("OMPI_MCA_opal_cuda_support", "fail"),
        ("UCX_IB_GPU_DIRECT_RDMA", "warn"),
        ("NCCL_P2P_DISABLE", "warn"),
    }
    assert (
        check_cuda_settings({"OMPI_MCA_pml": "ucx", "OMPI_MCA_opal_cuda_support": "1"}, True) == []
    )


def test_nccl_socket_ifname_syntax():
    names = ["lo", "eth0", "eth1", "ib0", "docker0"]
    assert nccl_ifname_matches("eth", names) == ["eth0", "eth1"]
    assert nccl_ifname_matches("=eth0", names) == ["eth0"]
    assert nccl_ifname_matches("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert nccl_ifname_matches("ens", names) == []


def test_cuda_visible_devices():
    assert visible_devices({}, 2) == ["0", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "1"}, 2) == ["1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}, 2) == []
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,7,1"}, 2) == ["0"]  # stops at invalid 7
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}, 2) == ["GPU-abc", "GPU-def"]
    assert gpu_for_local_rank(3, ["0", "1"]) == "1"
    assert gpu_for_local_rank(0, []) is None


def test_launcher_detection_order():
    assert detect_launcher({}).name == "none"
    tr = detect_launcher(
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    )
    assert (tr.name, tr.rank, tr.local_rank, tr.size) == ("torchrun", 3, 1, 4)
    # srun inside an allocation: a job step
    s = detect_launcher(
        {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
    )
    assert (s.name, s.rank, s.local_rank) == ("slurm", 2, 0)
    # an allocation without a step is not a launcher
    assert detect_launcher({"SLURM_JOB_ID": "9"}).name == "none"
    # mpirun under srun: the MPI launcher wins
    both = detect_launcher({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "5"})
    assert both.name == "openmpi" and both.rank == 5
