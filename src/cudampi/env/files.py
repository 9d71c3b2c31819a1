"""All generated files of one description, and writing them (or checking they are current)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cudampi.atomic import write_text
from cudampi.env import conda, docker, k8s, pip, slurm
from cudampi.env.recommended import recommended_env
from cudampi.env.spec import EnvSpec, spec_to_toml
from cudampi.errors import EnvGenError

TARGETS = ("spec", "conda", "pip", "docker", "slurm", "k8s")

LOCK = "requirements.lock"


def route_env(spec: EnvSpec, route: str) -> dict[str, str]:
    """The settings each route exports (conda-forge's Open MPI is CUDA-built; the wheel is not)."""
    multi = spec.nodes > 1
    if route == "conda":
        return recommended_env(
            spec.mpi, 5, multi_node=multi, cuda_built=spec.mpi == "openmpi", gpus=spec.gpu
        )
    return recommended_env(
        spec.mpi, spec.ompi_major, multi_node=multi, cuda_built=False, gpus=spec.gpu
    )


def generate(spec: EnvSpec, targets: tuple[str, ...] = TARGETS) -> dict[str, str]:
    """``{file name: text}`` for the chosen targets, except the lock (see :func:`lock_status`)."""
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise EnvGenError(f"unknown target(s) {bad}; known targets are {', '.join(TARGETS)}")
    env = route_env(spec, "pip")
    out: dict[str, str] = {}
    if "spec" in targets:
        out["env.toml"] = spec_to_toml(spec)
    if "conda" in targets:
        out["environment.yml"] = conda.environment_yml(spec, route_env(spec, "conda"))
    if "pip" in targets or "docker" in targets or "slurm" in targets:
        out["requirements.txt"] = pip.requirements_txt(spec)
        out["requirements-cpu.txt"] = pip.requirements_txt(spec, cpu=True)
        out["install.sh"] = pip.install_sh(spec)
        out["cudampi-env.sh"] = pip.env_sh(spec, env)
    if "docker" in targets:
        out["Dockerfile"] = docker.dockerfile(spec, env)
        out["entrypoint.sh"] = docker.entrypoint_sh(spec)
        out["known_hosts.sh"] = docker.known_hosts_sh(spec)
        out["profile.sh"] = docker.profile_sh(spec, env)
        out["sshd_config"] = docker.sshd_config(spec, env)
        out["ssh_config"] = docker.ssh_config(spec)
    if "slurm" in targets:
        out["job.sbatch"] = slurm.sbatch_script(spec, env)
    if "k8s" in targets:
        out["mpijob.yaml"] = k8s.mpijob_yaml(spec, env)
    return out


def lock_status(spec: EnvSpec, text: str | None) -> str:
    """'ok' if ``text`` locks exactly the spec's MPI stack pins, else what differs."""
    if text is None:
        return "missing"
    want = {r.split("==")[0].lower(): r.split("==")[1] for r in pip.mpi_requirements(spec)}
    have = pip.parse_lock(text)
    if have != want:
        return f"stale: locks {have!r}, the description pins {want!r}"
    if text.count("--hash=sha256:") != len(want):
        return "stale: not every entry has a sha256"
    return "ok"


def validate_generated(texts: Mapping[str, str]) -> list[str]:
    """Parse the YAML files of ``texts`` and check them against their schemas.

    Returns the names checked; needs PyYAML and jsonschema (the ``env``/``dev`` extras), and
    checks nothing (returns []) without them.
    """
    try:
        import jsonschema  # noqa: F401
        import yaml
    except ModuleNotFoundError:
        return []
    checked = []
    for name, validate in (
        ("mpijob.yaml", k8s.validate_mpijob),
        ("environment.yml", conda.validate_environment),
    ):
        if name in texts:
            try:
                doc = yaml.safe_load(texts[name])
            except yaml.YAMLError as exc:
                raise EnvGenError(f"{name} is not valid YAML: {exc}") from None
            validate(doc)
            checked.append(name)
    return checked


@dataclass(frozen=True)
class WrittenFile:
    """One file of a write (or of a check, with ``changed`` meaning 'differs')."""

    name: str
    changed: bool
    sha256: str


EXECUTABLE = ("install.sh", "entrypoint.sh", "known_hosts.sh", "job.sbatch")


def write_files(
    files: Mapping[str, str], out_dir: str | Path, *, check: bool = False
) -> list[WrittenFile]:
    """Write ``files`` into ``out_dir``; with ``check`` only compare (nothing is written).
    :class:`EnvGenError` if the folder cannot be made or a file written."""
    out = Path(out_dir)
    results = []
    if out.exists() and not out.is_dir():
        raise EnvGenError(f"{str(out)!r} is a file; the files go into a folder: give another --out")
    for name, text in files.items():
        path = out / name
        try:
            old = path.read_text()
        except OSError:
            old = None
        changed = old != text
        try:
            if not check:
                out.mkdir(parents=True, exist_ok=True)
            if changed and not check:
                write_text(path, text)  # whole or not at all: a full disk leaves the old file
            if not check and name in EXECUTABLE:
                path.chmod(0o755)
        except OSError as exc:
            raise EnvGenError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
        results.append(WrittenFile(name, changed, hashlib.sha256(text.encode()).hexdigest()))
    return results
