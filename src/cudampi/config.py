"""One frozen Config: keyword/flag > CUDAMPI_* environment > default, written once.

Every CUDAMPI_* variable cudampi reads is a field here; an unknown CUDAMPI_* variable or keyword
is rejected with the list of known ones, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudampi.errors import ConfigError
from cudampi.names import PATHS

ENV_PREFIX = "CUDAMPI_"

PROBE_TIMEOUT = 90.0
"""Seconds a child-process probe may run before it is reported hung (the default of
CUDAMPI_PROBE_TIMEOUT and of the doctor's --timeout)."""


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1, true/false, yes/no or on/off, got {text!r}")


def parse_size(text: str | int) -> int:
    """Parse a byte count such as ``4M``, ``64K``, ``1G``, ``1.5M`` or ``4096`` (binary units)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text!r}")
        return text
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"expected a size like 4096, 64K, 4M or 1G, got {text!r}") from None
    if value < 0:
        raise ValueError(f"a size cannot be negative, got {text!r}")
    return int(value * mult)


def _size_or_auto(text: str | int) -> int:
    """A size (:func:`parse_size`), or ``auto`` / -1: chosen by the engine (-1)."""
    if text in ("auto", "-1", -1):
        return -1
    return parse_size(text)


def parse_seconds(text: str | float) -> float:
    """A positive, finite number of seconds (``nan``, ``inf``, 0 and negatives are refused)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def seconds_arg(text: str) -> float:
    """:func:`parse_seconds` as an argparse ``type=``: a bad value is a usage error (exit 2)."""
    import argparse

    try:
        return parse_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def _meta(parse: Callable[[str], Any], doc: str, *, agreed: bool = False) -> dict[str, Any]:
    """``agreed``: the setting changes what a rank sends, so every rank of a communicator must
    have the same value (checked once when the communicator is made)."""
    return {"parse": parse, "doc": doc, "agreed": agreed}


@dataclass(frozen=True)
class Config:
    """cudampi's settings. Build with :meth:`Config.load`; never mutate (use :meth:`replace`)."""

    path: str = field(
        default="auto",
        metadata=_meta(
            _choice(*PATHS),
            "collective path: auto, ipc, nccl, gpu-ring, staged, native or host",
            agreed=True,
        ),
    )
    cuda_aware: str = field(
        default="auto",
        metadata=_meta(
            _choice("auto", "yes", "no"),
            "is MPI point-to-point CUDA-aware? auto reads the probe cache written by "
            "`cudampi doctor`; yes/no override it",
        ),
    )
    native_collectives: str = field(
        default="auto",
        metadata=_meta(
            _choice("auto", "yes", "no"),
            "may MPI's own collectives take device buffers? auto trusts only a passed probe",
        ),
    )
    debug: bool = field(
        default=False,
        metadata=_meta(
            _parse_bool, "full cross-rank argument check before every collective", agreed=True
        ),
    )
    chunk_bytes: int = field(
        default=4 << 20,
        metadata=_meta(parse_size, "pipeline chunk of gpu-ring and staged transfers", agreed=True),
    )
    small_bytes: int = field(
        default=256 << 10,
        metadata=_meta(
            parse_size,
            "messages at or below this use latency-optimal algorithms (recursive doubling)",
            agreed=True,
        ),
    )
    algorithm: str = field(
        default="auto",
        metadata=_meta(
            _choice("auto", "ring", "direct"),
            "large-message reduce-scatter/allgather of cudampi's own collectives: ring (any "
            "topology) or direct (all pairs at once, best on one node's NVLink/NVSwitch); auto: "
            "direct for device arrays when every rank is on one node, else ring",
            agreed=True,
        ),
    )
    ipc_bytes: int = field(
        default=32 << 20,
        metadata=_meta(
            parse_size,
            "ipc engine: bytes of each of the two data buffers of a rank's workspace (larger "
            "calls run in several launches); every rank of a node must use the same value",
            agreed=True,
        ),
    )
    ipc_oneshot_bytes: int = field(
        default=-1,
        metadata=_meta(
            _size_or_auto,
            "ipc engine: allreduce up to this size runs one-shot (every rank reads every rank), "
            "above it two-shot (reduce-scatter + all-gather); auto (-1): the switch measured on "
            "the H200 (docs/ipc.md): 32 MiB / ranks where the node's ranks share one GPU, "
            "512 KiB with a GPU each",
            agreed=True,
        ),
    )
    ipc_register: bool = field(
        default=True,
        metadata=_meta(
            _parse_bool,
            "ipc engine: register large allreduce buffers with the node's ranks so the kernels "
            "read and write them in place (no staging copies); 0 always stages",
        ),
    )
    ipc_blocks: int = field(
        default=0,
        metadata=_meta(
            int,
            "ipc engine: thread blocks per launch (0: the GPU's multiprocessors shared among "
            "the ranks on it, at most 64)",
            agreed=True,
        ),
    )
    node_ranks: int = field(
        default=0,
        metadata=_meta(
            int,
            "treat every this many consecutive ranks of a node as one node (to run the "
            "hierarchical collectives on one machine); 0: the real nodes",
            agreed=True,
        ),
    )
    cache_dir: str = field(
        default=str(Path("~/.cache/cudampi").expanduser()),
        metadata=_meta(str, "where probe results (capabilities) are cached"),
    )
    probe_timeout: float = field(
        default=PROBE_TIMEOUT,
        metadata=_meta(
            parse_seconds, "seconds a child-process probe may run before it is reported hung"
        ),
    )
    timeout: float = field(
        default=300.0,
        metadata=_meta(
            parse_seconds,
            "seconds a collective or point-to-point call waits for the other ranks before it "
            "raises on every rank that waits (the ipc engine's kernels give up after it too)",
        ),
    )
    log: str = field(
        default="",
        metadata=_meta(
            _choice("", "off", "info", "debug"),
            "info: once per new (op, size, dtype), the path chosen and why; debug: every call "
            "with its time (standard logging, logger 'cudampi', lines prefixed with host and "
            "rank); empty or off: nothing",
        ),
    )
    log_ranks: str = field(
        default="0",
        metadata=_meta(_choice("0", "all"), "which ranks log: rank 0 or every rank"),
    )
    trace: str = field(
        default="",
        metadata=_meta(
            str,
            "a folder: every rank writes its calls there as a Chrome-trace timeline "
            "(cudampi-trace-rank<R>.json; `cudampi trace merge` joins them); empty: off",
        ),
    )

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field[Any]]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def env_name(cls, name: str) -> str:
        return ENV_PREFIX + name.upper()

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        strict_env: bool = True,
    ) -> Config:
        """Resolve every field: ``overrides`` (flags, keyword arguments) > CUDAMPI_* env > default.

        ``None`` in ``overrides`` means "not given". Unknown keys are a :class:`ConfigError`.
        """
        env = os.environ if env is None else env
        known = cls.fields()
        values: dict[str, Any] = {}
        if strict_env:
            unknown_env = sorted(
                k
                for k in env
                if k.startswith(ENV_PREFIX)
                and k[len(ENV_PREFIX) :].lower() not in known
                and k not in EXTERNAL_ENV
                and not k.startswith(TEST_ENV_PREFIX)
            )
            if unknown_env:
                raise ConfigError(
                    f"unknown environment variable(s) {', '.join(unknown_env)}; cudampi knows "
                    f"{', '.join(sorted(cls.env_name(n) for n in known))} "
                    f"(and {', '.join(sorted(EXTERNAL_ENV))}, which are not settings). "
                    "Fix the name or unset it."
                )
        for name, f in known.items():
            var = cls.env_name(name)
            if var in env:
                values[name] = _parse_field(f, env[var], var)
        for name, value in (overrides or {}).items():
            if name not in known:
                raise ConfigError(
                    f"unknown setting {name!r}; known settings are {', '.join(sorted(known))}"
                )
            if value is None:
                continue
            values[name] = (
                _parse_field(known[name], value, name) if isinstance(value, str) else value
            )
        return cls(**values)

    def agreed(self) -> dict[str, Any]:
        """The settings every rank of a communicator must share (they change what a rank
        sends: chunking, algorithms, checks, the path), by name."""
        return {n: getattr(self, n) for n, f in self.fields().items() if f.metadata["agreed"]}

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied, validated like :meth:`load` (``None`` = unchanged)."""
        checked = Config.load(changes, env={}, strict_env=False)
        given = {k: getattr(checked, k) for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# The registry of every CUDAMPI_* environment variable name. Settings are the Config fields above
# (CUDAMPI_<FIELD>); the names below are not settings but messages between cudampi's own parts.
# Code that writes or reads one of them uses these constants; tests/unit/test_config_registry.py
# checks that every CUDAMPI_* name in src/, docs/ and the files `cudampi env` writes is known here.

# From `cudampi launch` to the ranks it starts (read by the rank bootstrap and cudampi.init()).
LAUNCHER = "CUDAMPI_LAUNCHER"
GPUS_PER_NODE = "CUDAMPI_GPUS_PER_NODE"
BIND_GPU = "CUDAMPI_BIND_GPU"
BIND_CPU = "CUDAMPI_BIND_CPU"
DEVICE = "CUDAMPI_DEVICE"
REPORT_DIR = "CUDAMPI_REPORT_DIR"
REPORT_TOKEN = "CUDAMPI_REPORT_TOKEN"

LAUNCHER_ENV: Mapping[str, str] = {
    LAUNCHER: "the launcher flavour that started the ranks (openmpi, mpich, slurm)",
    GPUS_PER_NODE: "--gpus-per-node of the launch",
    BIND_GPU: "how a rank gets its GPU: local, visible or none (--gpu-bind)",
    BIND_CPU: "gpu: the rank binds itself to its GPU's NUMA cores; none: the launcher decides",
    DEVICE: "the CUDA ordinal the bootstrap chose for the rank (cudampi.init() selects it)",
    REPORT_DIR: "where ranks write fault reports for the launch supervisor",
    REPORT_TOKEN: "the job's secret that marks its ranks' fault reports (the bootstrap takes it "
    "out of the environment before the user's code runs)",
}
"""CUDAMPI_* variables that `cudampi launch` sets for its ranks."""

# Written or read by the files `cudampi env write` generates (cudampi-env.sh, job.sbatch, the
# Dockerfile and its entrypoint, the MPIJob); the ranks and the image inherit them.
UCX_PRELOAD = "CUDAMPI_UCX_PRELOAD"
PYTHON = "CUDAMPI_PYTHON"
VENV = "CUDAMPI_VENV"
ENV_SH = "CUDAMPI_ENV_SH"

GENERATED_ENV: Mapping[str, str] = {
    UCX_PRELOAD: "the LD_PRELOAD value of the CUDA-enabled libucx wheel (cudampi-env.sh and the "
    "image export it; the job files pass it to the ranks only)",
    PYTHON: "the python whose libucx cudampi-env.sh looks for (job.sbatch sets the venv's)",
    VENV: "the venv job.sbatch activates (default ~/.venvs/<name>)",
    ENV_SH: "the cudampi-env.sh job.sbatch sources (default: the one beside the job script)",
}
"""CUDAMPI_* variables of the generated environment files."""

# Set by the user in torchrun's environment (the same on every host); read by the torch backend's
# join of torchrun's processes (cudampi.pmi.join), never shown in a report.
PMI_SECRET = "CUDAMPI_PMI_SECRET"

JOB_ENV: Mapping[str, str] = {
    PMI_SECRET: "the job's secret for cudampi's PMI server under torchrun (needed when the job "
    "spans hosts: the same random value on every host)",
}
"""CUDAMPI_* variables a user sets for a job that are not settings."""

EXTERNAL_ENV = frozenset(LAUNCHER_ENV) | frozenset(GENERATED_ENV) | frozenset(JOB_ENV)
"""Every CUDAMPI_* variable that is not a setting (Config accepts them and reads none)."""

TEST_ENV_PREFIX = "CUDAMPI_TEST_"
"""The test suite's own variables (which mpiexec or interpreter to use); ranks inherit them."""


def known_env() -> dict[str, str]:
    """Every CUDAMPI_* name cudampi knows, with what it is: settings, launcher and generated."""
    out = {Config.env_name(name): f.metadata["doc"] for name, f in Config.fields().items()}
    out.update(LAUNCHER_ENV)
    out.update(GENERATED_ENV)
    out.update(JOB_ENV)
    return out


def _parse_field(f: dataclasses.Field[Any], raw: str, where: str) -> Any:
    parse = f.metadata["parse"]
    try:
        return parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{where}={raw!r}: {exc} ({f.metadata['doc']})") from None
