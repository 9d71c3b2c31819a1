"""Launcher environment: NCCL_SOCKET_IFNAME matching, CUDA_VISIBLE_DEVICES, launcher detection
from variables (the real ones are in tests/mpi/test_doctor_cli.py, seen by real ranks). The
settings that take CUDA away are tests/unit/test_env_settings.py's."""

from __future__ import annotations

from cudampi.probe.gpu import gpu_for_local_rank, visible_devices
from cudampi.probe.interfaces import nccl_ifname_matches
from cudampi.rankenv import launched_by


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
    assert launched_by({}).name == "none"
    tr = launched_by(
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    )
    assert (tr.name, tr.rank, tr.local_rank, tr.size) == ("torchrun", 3, 1, 4)
    # srun inside an allocation: a job step
    s = launched_by(
        {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}
    )
    assert (s.name, s.rank, s.local_rank) == ("slurm", 2, 0)
    # an allocation without a step is not a launcher
    assert launched_by({"SLURM_JOB_ID": "9"}).name == "none"
    # mpirun under srun: the MPI launcher wins
    both = launched_by({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "OMPI_COMM_WORLD_RANK": "5"})
    assert both.name == "openmpi" and both.rank == 5
