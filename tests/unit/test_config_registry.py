"""One registry of every CUDAMPI_* name (cudampi.config): settings, the launcher's messages to
its ranks, and the names the generated environment files export. Every name cudampi writes,
reads or documents must be known to Config, or a user following cudampi's own files gets
"unknown environment variable" from `cudampi doctor`, Communicator() and the torch backend."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cudampi.config import EXTERNAL_ENV, GENERATED_ENV, LAUNCHER_ENV, Config, known_env
from cudampi.env import docker, files
from cudampi.env.spec import DEFAULT
from cudampi.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bCUDAMPI_[A-Z0-9_]*[A-Z0-9]\b")

NOT_VARIABLES = {
    # Line markers the probe children print on stdout and Python constants: not variables.
    "CUDAMPI_PROBE": "src/cudampi/probe/worker.py",
    "CUDAMPI_STAGE": "src/cudampi/probe/worker.py",
    "CUDAMPI_PYGPU": "src/cudampi/probe/gpu.py",
    "CUDAMPI_LIBRARY": "src/cudampi/probe/mpi_library.py",
    "CUDAMPI_NODE": "src/cudampi/doctor/node.py",
    "CUDAMPI_NODE_HELLO": "src/cudampi/doctor/node.py",
    "CUDAMPI_LINK": "src/cudampi/probe/links.py",
}

SPECS = [
    DEFAULT,
    dataclasses.replace(DEFAULT, mpi="mpich", cuda="12.8", nodes=1, extras=("cupy",)),
    dataclasses.replace(DEFAULT, mpi_version="4.1.8", source="cudampi==0.1.0"),
]


def names_in(text: str) -> set[str]:
    return set(NAME.findall(text)) - set(NOT_VARIABLES)


def test_every_name_the_generated_files_write_is_known_to_config():
    written: set[str] = set()
    for spec in SPECS:
        for text in files.generate(spec).values():
            written |= names_in(text)
    assert written >= {"CUDAMPI_UCX_PRELOAD", "CUDAMPI_PYTHON", "CUDAMPI_VENV", "CUDAMPI_ENV_SH"}
    assert written <= set(known_env()), written - set(known_env())
    # ... and Config accepts all of them at once (what `. cudampi-env.sh` + srun hand a rank).
    Config.load(
        env={name: "/x" for name in written - {Config.env_name(f) for f in Config.fields()}}
    )


def test_the_image_environment_passes_config():
    env = docker.image_env(DEFAULT, files.route_env(DEFAULT, "pip"))
    assert "CUDAMPI_UCX_PRELOAD" in env
    Config.load(env=env)  # the HEALTHCHECK's doctor and every rank start with this


def test_every_name_in_the_code_and_docs_is_known():
    known = set(known_env()) | set(NOT_VARIABLES)
    where: dict[str, str] = {}
    for base in ("src", "docs", "docker", "examples", "tools"):
        for path in (ROOT / base).rglob("*"):
            if (
                path.suffix in {".py", ".md", ".sh", ".sbatch", ".toml", ".yml", ".yaml", ""}
                and path.is_file()
            ):
                try:
                    text = path.read_text()
                except (UnicodeDecodeError, OSError):
                    continue
                for name in NAME.findall(text):
                    where.setdefault(name, str(path.relative_to(ROOT)))
    for path in (ROOT / "README.md",):
        for name in NAME.findall(path.read_text()):
            where.setdefault(name, "README.md")
    unknown = {
        n: w for n, w in where.items() if n not in known and not n.startswith("CUDAMPI_TEST_")
    }
    assert not unknown, f"CUDAMPI_* names not in cudampi.config's registry: {unknown}"


def test_the_registry_has_one_entry_per_name_and_a_doc_for_each():
    settings = {Config.env_name(f) for f in Config.fields()}
    assert not settings & EXTERNAL_ENV
    assert not set(LAUNCHER_ENV) & set(GENERATED_ENV)
    assert all(doc.strip() for doc in known_env().values())


def test_an_unknown_name_is_still_refused_with_the_list():
    with pytest.raises(ConfigError, match="CUDAMPI_UCX_PRELAOD") as err:
        Config.load(env={"CUDAMPI_UCX_PRELAOD": "x"})
    assert "CUDAMPI_UCX_PRELOAD" in str(err.value)
