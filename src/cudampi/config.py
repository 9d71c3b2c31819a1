"""One frozen Config: keyword/flag > CUDAMPI_* environment > default, written once.

Every CUDAMPI_* variable cudampi reads is a field here; an unknown CUDAMPI_* variable or keyword
is rejected with the list of known ones, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudampi.errors import ConfigError
from cudampi.names import PATHS

ENV_PREFIX = "CUDAMPI_"

PROBE_TIMEOUT = 90.0
"""Seconds a child-process probe may run before it is reported hung (the default of
CUDAMPI_PROBE_TIMEOUT and of the doctor's --timeout)."""


MAX_SECONDS = 365 * 24 * 3600.0
"""The longest timeout any flag or setting takes (a year): longer ones overflow the clocks they
are handed to (threading's, the ipc kernels' nanoseconds)."""

MIN_SECONDS = 0.01
"""The shortest deadline a setting takes: below it no call could be checked in time."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("expected 0/1, true/false, yes/no or on/off")


_UNITS = (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40))


def human_size(n: int) -> str:
    """``4194304`` -> ``4 MiB``; ``1000`` -> ``1000 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def parse_size(text: str | int) -> int:
    """Parse a byte count such as ``4M``, ``64K``, ``1G``, ``1.5M`` or ``4096`` (binary units).

    ``ValueError`` for anything else, a negative, ``nan`` or an infinite size."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError("expected a size like 4096, 64K, 4M or 1G")
    if isinstance(text, int):
        value: float = text
    else:
        s = text.strip().upper().removesuffix("B").removesuffix("I")
        mult = 1
        for suffix, m in _UNITS:
            if s.endswith(suffix):
                s, mult = s[:-1], m
                break
        try:
            value = float(s) * mult
        except ValueError:
            raise ValueError("expected a size like 4096, 64K, 4M or 1G") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite size like 4096, 64K, 4M or 1G")
    if value < 0:
        raise ValueError("a size cannot be negative")
    return int(value)


def _size(low: int, high: int, *, auto: bool = False) -> Callable[[str | int], int]:
    """A size from ``low`` to ``high`` bytes; with ``auto``, also ``auto``/-1 (the engine's
    choice, kept as -1)."""
    span = f"from {human_size(low)} to {human_size(high)}"

    def parse(text: str | int) -> int:
        if auto and str(text).strip().lower() in ("auto", "-1"):
            return -1
        try:
            value = parse_size(text)
        except ValueError:
            value = -1
        if not low <= value <= high:
            extra = " or auto" if auto else ""
            raise ValueError(f"expected a size {span} (4096, 64K, 4M, 1G){extra}")
        return value

    return parse


def _count(low: int, high: int) -> Callable[[str | int], int]:
    """A whole number from ``low`` to ``high``."""

    def parse(text: str | int) -> int:
        try:
            value = int(str(text).strip()) if not isinstance(text, bool) else -1
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise ValueError(f"expected a whole number from {low} to {high}")
        return value

    return parse


def parse_seconds(text: str | float) -> float:
    """A positive, finite number of seconds up to :data:`MAX_SECONDS` (``nan``, ``inf``, 0
    and negatives are refused)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError("expected a number of seconds") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        raise ValueError(
            f"expected a positive, finite number of seconds, at most {MAX_SECONDS:.0f} (a year)"
        )
    return value


def _seconds(text: str | float) -> float:
    """A number of seconds from :data:`MIN_SECONDS` to :data:`MAX_SECONDS`."""
    try:
        value = parse_seconds(text)
    except ValueError:
        value = 0.0
    if value < MIN_SECONDS:
        raise ValueError(
            f"expected a positive, finite number of seconds from {MIN_SECONDS:g} to "
            f"{MAX_SECONDS:.0f} (a year)"
        )
    return value


def seconds_arg(text: str) -> float:
    """:func:`parse_seconds` as an argparse ``type=``: a bad value is a usage error (exit 2)."""
    import argparse

    try:
        return parse_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None


def _choice(
    *choices: str, aliases: Mapping[str, str] | None = None, also: str = ""
) -> Callable[[str], str]:
    """One of ``choices`` in any case, or an ``aliases`` key standing for its value (``also``
    says which words those are)."""
    table = {c: c for c in choices} | dict(aliases or {})

    def parse(text: str) -> str:
        if not isinstance(text, str) or text.strip().lower() not in table:
            raise ValueError(f"expected {', '.join(choices[:-1])} or {choices[-1]}{also}")
        return table[text.strip().lower()]

    return parse


LOG_LEVELS: Mapping[str, str] = {
    **dict.fromkeys(("", "0", "false", "no", "none", "version", "warn", "warning"), "off"),
    **dict.fromkeys(("error", "abort", "critical"), "off"),
    **dict.fromkeys(("1", "true", "yes", "on"), "info"),
    **dict.fromkeys(("2", "trace"), "debug"),
}
"""The names NCCL_DEBUG (VERSION, WARN, INFO, TRACE, ABORT) and Python's logging (WARNING,
ERROR, DEBUG) use for the levels of CUDAMPI_LOG, and the usual on/off words: cudampi's
warnings always reach stderr, so their levels are ``off``."""


def _folder(text: str | os.PathLike[str]) -> str:
    value = os.fspath(text)
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a folder (an empty one would be the current directory)")
    return str(Path(value).expanduser())


def _optional_folder(text: str | os.PathLike[str]) -> str:
    value = os.fspath(text)
    if not isinstance(value, str):
        raise ValueError("expected a folder, or empty for off")
    return value


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
        metadata=_meta(
            _size(1, 1 << 30),
            "pipeline chunk of gpu-ring and staged transfers (one MPI message each)",
            agreed=True,
        ),
    )
    small_bytes: int = field(
        default=256 << 10,
        metadata=_meta(
            _size(0, 1 << 40),
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
            _size(4 << 10, 16 << 30),
            "ipc engine: bytes of each of the two data buffers of a rank's workspace (larger "
            "calls run in several launches); every rank of a node must use the same value",
            agreed=True,
        ),
    )
    ipc_oneshot_bytes: int = field(
        default=-1,
        metadata=_meta(
            _size(0, 1 << 40, auto=True),
            "ipc engine: allreduce up to this size runs one-shot (every rank reads every rank), "
            "above it two-shot (reduce-scatter + all-gather); auto (-1): the switch measured "
            "(docs/ipc.md): 8 MiB / ranks where the node's ranks share one GPU, 512 KiB with a "
            "GPU each",
            agreed=True,
        ),
    )
    ipc_register: bool = field(
        default=True,
        metadata=_meta(
            _parse_bool,
            "ipc engine: register large allreduce buffers with the node's ranks so the kernels "
            "read and write them in place (no staging copies); 0: this rank stages its own "
            "(it still reads and writes the peers' registered buffers in place)",
        ),
    )
    ipc_blocks: int = field(
        default=0,
        metadata=_meta(
            _count(0, 64),
            "ipc engine: thread blocks per launch (0: the GPU's multiprocessors shared among "
            "the ranks on it, at most 64)",
            agreed=True,
        ),
    )
    node_ranks: int = field(
        default=0,
        metadata=_meta(
            _count(0, 1 << 16),
            "treat every this many consecutive ranks of a node as one node (to run the "
            "hierarchical collectives on one machine); 0: the real nodes",
            agreed=True,
        ),
    )
    cache_dir: str = field(
        default=str(Path("~/.cache/cudampi").expanduser()),
        metadata=_meta(_folder, "where probe results (capabilities) are cached"),
    )
    probe_timeout: float = field(
        default=PROBE_TIMEOUT,
        metadata=_meta(
            _seconds, "seconds a child-process probe may run before it is reported hung"
        ),
    )
    timeout: float = field(
        default=300.0,
        metadata=_meta(
            _seconds,
            "seconds a collective or point-to-point call waits for the other ranks before it "
            "raises on every rank that waits (the ipc engine's kernels give up after it too)",
        ),
    )
    log: str = field(
        default="off",
        metadata=_meta(
            _choice(
                "off",
                "info",
                "debug",
                aliases=LOG_LEVELS,
                also=", in any case, or a level of NCCL_DEBUG (VERSION, WARN, INFO, TRACE) or "
                "of Python's logging (WARNING, ERROR, DEBUG), or 0/1",
            ),
            "info: once per new (op, size, dtype), the path chosen and why; debug: every call "
            "with its time (standard logging, logger 'cudampi', lines prefixed with host and "
            "rank); off: nothing. NCCL_DEBUG's names (WARN, INFO, TRACE, ...) and logging's "
            "(WARNING, DEBUG) work too",
        ),
    )
    log_ranks: str = field(
        default="0",
        metadata=_meta(_choice("0", "all"), "which ranks log: rank 0 or every rank"),
    )
    trace: str = field(
        default="",
        metadata=_meta(
            _optional_folder,
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
            _refuse_unknown_env(env)
        for name, f in known.items():
            var = cls.env_name(name)
            if var in env:
                values[name] = _parse_field(f, env[var], var)
        for name, value in (overrides or {}).items():
            if name not in known:
                raise ConfigError(
                    f"unknown setting {name!r}{_did_you_mean(name, known)}; known settings are "
                    f"{', '.join(sorted(known))}"
                )
            if value is not None:
                values[name] = _parse_field(known[name], value, name)
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


def _nearest(name: str, known: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return close[0] if close else None


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    near = _nearest(name, known)
    return f" (did you mean {near!r}?)" if near else ""


def _refuse_unknown_env(env: Mapping[str, str]) -> None:
    """ConfigError for a CUDAMPI_* variable that is neither a setting nor one of cudampi's
    messages (a typo would otherwise silently do nothing), naming the nearest known name."""
    known = known_env()
    unknown = sorted(
        k
        for k in env
        if k.startswith(ENV_PREFIX) and k not in known and not k.startswith(TEST_ENV_PREFIX)
    )
    if not unknown:
        return
    named = ", ".join(
        f"{k} (did you mean {near}?)" if (near := _nearest(k, known)) else k for k in unknown
    )
    raise ConfigError(
        f"unknown environment variable{'s' if len(unknown) > 1 else ''} {named}: cudampi reads no such setting, so it would do nothing. Fix the name or "
        f"unset it. The settings are {', '.join(sorted(Config.env_name(n) for n in Config.fields()))}"
        f"; cudampi's other variables {', '.join(sorted(EXTERNAL_ENV))}"
    )


def _shown(f: dataclasses.Field[Any]) -> str:
    """A field's default as a user writes it."""
    if f.name.endswith("_bytes") and isinstance(f.default, int) and f.default >= 0:
        return human_size(f.default)
    if isinstance(f.default, bool):
        return str(int(f.default))
    if f.default == -1:
        return "auto"
    return repr(f.default) if isinstance(f.default, str) else f"{f.default:g}"


def _parse_field(f: dataclasses.Field[Any], raw: Any, where: str) -> Any:
    """The value of field ``f`` given as ``raw`` (a CUDAMPI_* value or a keyword argument), or
    a ConfigError of one form: the value seen, what is expected, the fix, what it sets."""
    parse = f.metadata["parse"]
    try:
        return parse(raw)
    except (TypeError, ValueError) as exc:
        unset = f"unset {where}" if where.startswith(ENV_PREFIX) else f"leave {where} out"
        raise ConfigError(
            f"{where}={raw!r}: {exc}. Give such a value, or {unset} for the default "
            f"({_shown(f)}). ({where}: {f.metadata['doc']})"
        ) from None
