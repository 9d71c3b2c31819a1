"""The container route's generator, piece by piece (tests/container builds and runs the image):
the ssh client checks host keys against the job's key only, login shells and
ssh sessions get the image's environment, and the CPU flavour."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
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


ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"


def _tracked() -> set[str]:
    """What a clean clone of this repository holds."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: what a clean clone holds is unknown")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split("\0")) - {""}


def test_the_checked_in_docker_folder_builds_from_a_clean_clone():
    from dockerfile_parse import DockerfileParser

    text = (DOCKER_DIR / "Dockerfile").read_text()
    # The build command the Dockerfile gives: with -f it is typed where that path leads to this
    # Dockerfile (the checkout), without it in this folder.
    (command,) = re.findall(r"^#\s+docker build (.+)$", text, re.M)
    argv = shlex.split(command)
    where = DOCKER_DIR
    if "-f" in argv:
        named = Path(argv[argv.index("-f") + 1])
        where = Path(*(DOCKER_DIR / "Dockerfile").parts[: -len(named.parts)])
        assert where / named == DOCKER_DIR / "Dockerfile", command
    context = (where / argv[-1]).resolve()
    tracked = _tracked()
    parser = DockerfileParser(path=str(DOCKER_DIR / "Dockerfile"))
    for instruction in parser.structure:
        if instruction["instruction"] != "COPY" or "--from=" in instruction["value"]:
            continue
        sources = [a for a in shlex.split(instruction["value"]) if not a.startswith("--")][:-1]
        for src in sources:
            rel = (context / src).resolve().relative_to(ROOT).as_posix()
            assert rel in tracked or any(t.startswith(rel + "/") for t in tracked), (
                f"COPY {src}: {rel} is not in a clean clone (git ls-files), so `docker build "
                f"{command}` fails there"
            )
    # The default command runs what the image has: a module of an installed package, or a
    # file the Dockerfile puts in the working folder (it makes that folder empty).
    cmd = json.loads(parser.cmd if parser.cmd.startswith("[") else json.dumps(parser.cmd.split()))
    if "-m" in cmd:
        module = cmd[cmd.index("-m") + 1]
        assert module.split(".")[0] == "cudampi" and importlib.util.find_spec(module), cmd
    scripts = [a for a in cmd[1:] if a.endswith(".py")]
    assert not scripts, f"CMD {cmd} runs {scripts}, which the image does not have"


def _health(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "healthcheck.sh"
    script.write_text(files.generate(DEFAULT, ("docker",))["healthcheck.sh"])
    # Only python on PATH (no cudampi command, no mpiexec): a check that starts the doctor or an
    # MPI job cannot pass here.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    return subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        env={"PATH": path, "PYTHONPATH": str(ROOT / "src"), **env},
        timeout=60,
    )


def test_the_healthcheck_is_cheap_and_asks_what_the_mode_serves(tmp_path: Path):
    texts = files.generate(DEFAULT, ("docker",))
    assert f'CMD ["{docker.HEALTHCHECK}"]' in texts["Dockerfile"]
    assert f"COPY --chmod=0755 healthcheck.sh {docker.HEALTHCHECK}" in texts["Dockerfile"]
    train = _health(tmp_path, MODE="train")
    assert train.returncode == 0, train.stderr  # the MPI stack loads; no job ran
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        down = _health(tmp_path, MODE="ssh", SSH_PORT=str(port))
        assert down.returncode != 0  # nothing listens yet
        s.listen()
        up = _health(tmp_path, MODE="ssh", SSH_PORT=str(port))
        assert up.returncode == 0, up.stderr


def test_install_sh_says_how_to_use_the_venv_it_made(tmp_path: Path):
    # The line install.sh ends with, run as a user would paste it (its doctor aside): the venv
    # must be active, so that cudampi-env.sh's python3 is the venv's (it finds the CUDA UCX).
    text = files.generate(DEFAULT, ("pip",))["install.sh"]
    (echo,) = [ln for ln in text.splitlines() if ln.startswith('echo "next: ')]
    venv, here = tmp_path / "venv", tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    here.mkdir()
    (here / "cudampi-env.sh").write_text(files.generate(DEFAULT, ("pip",))["cudampi-env.sh"])
    said = subprocess.run(
        ["sh", "-c", f'venv="{venv}"; here="{here}"; {echo}'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    line = said.removeprefix("next: ")
    assert line.endswith(" && cudampi doctor"), line
    steps = line.removesuffix(" && cudampi doctor")
    run = subprocess.run(
        ["sh", "-c", f'{steps} && echo "python3=$(command -v python3)"'],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert f"python3={venv}/bin/python3" in run.stdout, run.stdout + run.stderr
