"""The container route's generator, piece by piece (tests/container builds and runs the image):
the ssh client checks host keys against the job's key only (issue 16, item 17), login shells and
ssh sessions get the image's environment, and the CPU flavour."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cudampi.config import UCX_PRELOAD
from cudampi.env import docker, files
from cudampi.env.recommended import recommended_env
from cudampi.env.spec import DEFAULT, SpecError
from tests.conftest import cudampi_cli

CPU = dataclasses.replace(DEFAULT, cuda="cpu", torch="2.13.0")


def test_the_cpu_image_has_no_gpu_settings():
    env = docker.image_env(CPU, files.route_env(CPU, "pip"))
    # pml ucx cannot start on a host with neither GPUs nor InfiniBand
    gpu_only = {
        "OMPI_MCA_pml",
        "OMPI_MCA_osc",
        UCX_PRELOAD,
        "UCX_MODULE_DIR",
        "NVIDIA_VISIBLE_DEVICES",
    }
    assert not gpu_only & set(env)
    assert env["OMPI_MCA_plm_rsh_agent"] == "ssh"
    gpu = recommended_env("openmpi", 5)
    assert gpu["OMPI_MCA_pml"] == "ucx" and "OMPI_MCA_pml" not in recommended_env(gpus=False)
    texts = files.generate(CPU)
    assert "torch==2.13.0+cpu" in texts["requirements.txt"]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in texts["requirements.txt"]
    assert "libucx" not in texts["requirements.txt"] + texts["Dockerfile"]
    assert "--gpus all" not in texts["Dockerfile"]


def test_the_cpu_spec(tmp_path: Path):
    assert (CPU.gpu, CPU.cuda_tag, CPU.ranks_per_node_resolved) == (False, "cpu", 1)
    with pytest.raises(SpecError, match="cupy needs CUDA"):
        dataclasses.replace(CPU, extras=("cupy",))
    with pytest.raises(SpecError, match="or 'cpu' for none"):
        dataclasses.replace(DEFAULT, cuda="11.8")
    shown = cudampi_cli("env", "show", "--cuda", "cpu", "--json")
    assert shown.returncode == 0, shown.stderr


@pytest.fixture()
def keyed_home(tmp_path: Path) -> Path:
    if shutil.which("ssh-keygen") is None:
        pytest.skip("needs ssh-keygen (openssh-client)")
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "job", "-f", str(ssh / "id_rsa")],
        check=True,
        timeout=30,
    )
    return tmp_path


def test_known_hosts_vouches_for_the_job_key_only(tmp_path: Path, keyed_home: Path):
    script = tmp_path / "known_hosts.sh"
    script.write_text(files.generate(DEFAULT, ("docker",))["known_hosts.sh"])

    def known(home: Path, host: str = "[worker-1]:2222") -> str:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
        p = subprocess.run(["sh", str(script), host], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        return p.stdout

    kind, key, _ = (keyed_home / ".ssh" / "id_rsa.pub").read_text().split()
    assert known(keyed_home) == f"[worker-1]:2222 {kind} {key}\n"
    (keyed_home / ".ssh" / "id_rsa.pub").unlink()  # derived from the private key then
    assert known(keyed_home, "b") == f"b {kind} {key}\n"
    assert known(tmp_path / "nobody") == ""  # no job key: nothing known, the host is refused


def test_the_ssh_client_checks_host_keys(tmp_path: Path):
    if shutil.which("ssh") is None:
        pytest.skip("needs ssh (openssh-client)")
    texts = files.generate(DEFAULT, ("docker",))
    assert "StrictHostKeyChecking no" not in texts["ssh_config"]
    assert "/dev/null" not in texts["ssh_config"]
    (tmp_path / "ssh_config").write_text(texts["ssh_config"])
    dump = subprocess.run(
        ["ssh", "-G", "-F", str(tmp_path / "ssh_config"), "worker-1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    opts = dict(line.split(" ", 1) for line in dump.stdout.splitlines() if " " in line)
    assert opts["stricthostkeychecking"] == "true"
    assert opts["knownhostscommand"] == f"{docker.KNOWN_HOSTS} %H"
    # the entrypoint serves the job's key pair as sshd's host key: the key the client trusts
    entry = texts["entrypoint.sh"]
    assert 'host_key="${SSH_HOST_KEY:-$ssh_dir/id_rsa}"' in entry
    assert f"COPY --chmod=0755 known_hosts.sh {docker.KNOWN_HOSTS}" in texts["Dockerfile"]


def test_login_shells_and_ssh_sessions_get_the_image_environment(tmp_path: Path):
    settings = files.route_env(DEFAULT, "pip")
    texts = files.generate(DEFAULT, ("docker",))
    profile = tmp_path / "profile.sh"
    profile.write_text(texts["profile.sh"])
    # /etc/profile has reset PATH; sourcing twice does not add the venv twice
    shown = subprocess.run(
        ["sh", "-c", f'. {profile}; . {profile}; echo "$PATH"; echo "$OMPI_MCA_plm_rsh_agent"'],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert shown.stdout.splitlines() == ["/opt/venv/bin:/usr/bin:/bin", "ssh"]
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists() or shutil.which("ssh-keygen") is None:
        pytest.skip("OpenSSH is not installed (.ci/run installs openssh-server/-client)")
    if os.geteuid() == 0:  # sshd -T insists on its privilege separation folder, which the
        os.makedirs("/run/sshd", exist_ok=True)  # sshd service makes: a fresh /run lacks it
    (tmp_path / "sshd_config").write_text(texts["sshd_config"])
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")], check=True
    )
    dump = subprocess.run(
        [sshd, "-T", "-f", str(tmp_path / "sshd_config"), "-h", str(tmp_path / "k")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    setenv = [
        line.split(" ", 1)[1] for line in dump.stdout.splitlines() if line.startswith("setenv ")
    ]
    assert setenv == [f"{k}={v}" for k, v in docker.session_env(DEFAULT, settings).items()]
    assert "authenticationmethods publickey" in dump.stdout.splitlines()
