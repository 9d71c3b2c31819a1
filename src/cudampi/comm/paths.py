"""Choosing a call's path: the engines declare themselves, this module only orders them.

Order of precedence: the call's ``path=`` > the Communicator's ``path=`` > CUDAMPI_PATH > auto.
``auto`` asks the engines of :data:`cudampi.comm.engines.KINDS` in their order, each for its
route (:meth:`~cudampi.comm.engines.base.Engine.route`), and the first that takes the call runs
it (the ``last_resort`` engine where none does); a path asked for by name goes to the engine
that declares it (:meth:`~cudampi.comm.engines.base.Engine.forced`), which raises a
:class:`~cudampi.errors.DeviceError` that says why where it cannot run. A device buffer reaches
an MPI call only where the probe (or an explicit ``cuda_aware=yes`` / ``native_collectives=yes``)
says that call works with device memory: on some CUDA-aware stacks MPI's own device Allreduce
segfaults even where device point-to-point is fine.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cudampi.comm.choice import (
    NO_LIMIT,
    Ask,
    DeviceSupport,
    Facts,
    PathChoice,
    Ranks,
    Verdict,
)
from cudampi.config import Config
from cudampi.errors import ConfigError
from cudampi.names import PATHS
from cudampi.probe.capabilities import Capabilities, ProbeOutcome

if TYPE_CHECKING:
    from cudampi.comm.engines.base import Engine

__all__ = [
    "NO_LIMIT",
    "Decisions",
    "DeviceSupport",
    "PathChoice",
    "Ranks",
    "Verdict",
    "check_path",
    "choose",
    "device_support",
    "kinds",
    "mpi_support",
    "unavailable",
    "unprobed_note",
    "verdicts",
]


def kinds() -> Mapping[str, type[Engine]]:
    """The engines in auto's order (the registry, imported on first use: the doctor reads
    verdicts without loading the engines' GPU modules until it asks)."""
    from cudampi.comm.engines import KINDS

    return KINDS


def _owner(path: str) -> type[Engine]:
    for kind in kinds().values():
        if path in kind.paths:
            return kind
    raise ConfigError(f"no engine serves path {path!r}")  # (PATHS and the engines disagree)


def unavailable() -> dict[str, str]:
    """Engine name -> why it cannot run in this process (a library missing), for the engines
    that cannot."""
    out = {}
    for name, kind in kinds().items():
        why = kind.available()
        if why is not None:
            out[name] = why
    return out


def verdicts(
    config: Config,
    caps: Capabilities | None,
    mpi: DeviceSupport,
    mps: bool,
    ranks: Ranks | None = None,
) -> tuple[dict[str, Verdict], str]:
    """Every engine's verdict (may auto take it for device arrays here, why, for which sizes)
    and why auto decides without the probe's word ("" where it has it). ``ranks``: the
    communicator (a verdict may ask its ranks collectively); None: this host, as the doctor
    asks."""
    table = kinds()
    facts = Facts(config, caps, mpi, mps, ranks, lambda name, f: table[name].verdict(f))
    made = {name: facts.verdict(name) for name in table}
    unprobed = ""
    if caps is None:
        unprobed = "there is no valid probe result for this MPI stack on this host"
    else:
        unprobed = next((w for w in (k.unprobed(facts) for k in table.values()) if w), "")
    return made, unprobed


def device_support(
    config: Config, caps: Capabilities | None, note: str = "", ranks: Ranks | None = None
) -> DeviceSupport:
    """What MPI may be given device memory for (the config's yes/no, else what the probe entry
    ``caps`` proved; ``note`` says why there is none) and every engine's verdict: the one
    reader of the probe's verdicts for path choice (:func:`mpi_support` is its pure MPI half,
    which the doctor's CUDA-aware verdict reads)."""
    from cudampi.probe.gpu import mps_active

    mpi = mpi_support(config, caps, note)
    made, unprobed = verdicts(config, caps, mpi, mps_active(), ranks)
    return dataclasses.replace(mpi, verdicts=made, unprobed=unprobed)


def agreed(support: DeviceSupport) -> dict[str, object]:
    """What the ranks of a communicator must share of ``support``: MPI's device verdicts and
    the verdicts of the engines that declare them ``agreed``."""
    out: dict[str, object] = {
        "device p2p": "proven" if support.p2p else "not proven",
        "device collectives": "proven" if support.collectives else "not proven",
    }
    for name, kind in kinds().items():
        if kind.agreed:
            v = support.verdict(name)
            out[f"auto's {name} sizes (bytes)"] = list(v.span) if v.ok else "none"
    return out


def unprobed_note(
    choice: PathChoice, requested: str, on_device: bool, support: DeviceSupport
) -> str:
    """What to tell the user, once, when auto runs a device collective on a path it chose
    without the probe's word ("" when there is nothing to tell): on a fresh machine auto can
    take neither the ipc engine nor gpu-ring, and data-parallel training on CUDA tensors loses
    much of its speed (docs/benchmarks.md)."""
    if not on_device or requested != "auto" or not support.unprobed or choice.engine == "ipc":
        return ""
    return (
        f"device collectives take path {str(choice)!r} here because {support.unprobed}: auto "
        "chooses the ipc engine (GPU kernels, ranks of one node) or gpu-ring only where "
        "`cudampi doctor` proved them on this stack. Run `cudampi doctor` once on each host, "
        "with the job's settings (it caches what it proves), or set CUDAMPI_PATH"
    )


def mpi_support(config: Config, caps: Capabilities | None, note: str = "") -> DeviceSupport:
    """:func:`device_support` without the engines' verdicts (pure: what MPI itself may be given
    device memory for; the doctor's verdict on a stack)."""
    missing = note or "no probe result for this MPI stack (run `cudampi doctor`)"
    p2p = _verdict(
        config.cuda_aware,
        "cuda_aware=",
        "CUDAMPI_CUDA_AWARE",
        " says MPI p2p takes device memory",
        caps.device_p2p if caps is not None else None,
        "device point-to-point",
        missing,
    )
    coll = _verdict(
        config.native_collectives,
        "native_collectives=",
        "CUDAMPI_NATIVE_COLLECTIVES",
        "",
        caps.device_allreduce if caps is not None else None,
        "MPI's device Allreduce",
        missing,
    )
    return DeviceSupport(*p2p, *coll)


def _verdict(
    setting: str,
    name: str,
    var: str,
    says: str,
    probed: ProbeOutcome | None,
    what: str,
    missing: str,
) -> tuple[bool, str]:
    """One yes/no/auto setting against what the probe found, and why."""
    if setting == "yes":
        return True, f"{name}yes ({var}){says}"
    if setting == "no":
        return False, f"{name}no ({var})"
    if probed is None:
        return False, missing
    if probed.ok:
        return True, f"the probe proved {what} correct"
    return False, f"the probe found {what} {probed.status}"


def check_path(path: str | None, where: str) -> str | None:
    if path is None:
        return None
    if path not in PATHS:
        raise ConfigError(f"{where}={path!r} is not a path; use one of {', '.join(PATHS)}")
    return path


def choose(
    call: str,
    requested: str,
    on_device: bool,
    dtype: str,
    nbytes: int,
    support: DeviceSupport,
    *,
    mpi_reduces: bool,
) -> PathChoice:
    """The path for one call (a name of :data:`cudampi.names.CALLS`). ``mpi_reduces``: MPI has
    a datatype and op for this reduction."""
    ask = Ask.of(call, requested, on_device, dtype, nbytes, mpi_reduces)
    if requested == "auto":
        choice = _auto(ask, support)
    else:
        kind = _owner(requested)
        if ask.call.name not in kind.calls:  # e.g. nccl moves collectives: messages stay MPI's
            choice = _auto(dataclasses.replace(ask, requested="auto"), support)
        elif kind.device_only and not on_device:
            host = _auto(dataclasses.replace(ask, requested="auto"), support)
            why = f"requested {requested}, which moves device arrays; {host.reason}"
            choice = PathChoice(str(host), why, host.engine)
        else:
            choice = kind.forced(ask, support)
    choice.stream_ordered = kinds()[choice.engine].stream_ordered
    return choice


def _auto(ask: Ask, support: DeviceSupport) -> PathChoice:
    last = None
    for kind in kinds().values():
        if kind.last_resort:
            last = kind
        if ask.call.name not in kind.calls or (kind.device_only and not ask.on_device):
            continue
        route = kind.route(ask, support)
        if route is not None:
            return route
    assert last is not None, "no engine declares itself the last resort"
    return last.fallback(ask, support)


class Decisions:
    """A communicator's path choices, each made once per call, path asked, memory kind, dtype
    and size (the one cache of path decisions: a training loop repeats a few calls)."""

    def __init__(self, support: DeviceSupport, default: str, rank: int) -> None:
        self.support = support
        self.default = default
        self.rank = rank
        self._made: dict[tuple[str, str | None, bool, str, int], PathChoice] = {}

    def choose(
        self, call: str, path: str | None, on_device: bool, dtype: str, nbytes: int
    ) -> PathChoice:
        """The choice for one call (``path``: what the call asked for; None: the default)."""
        key = (call, path, on_device, dtype, nbytes)
        choice = self._made.get(key)
        if choice is None:
            choice = self._decide(call, path, on_device, dtype, nbytes)
            if len(self._made) >= 4096:  # sizes that keep changing: forget, decide again
                self._made.clear()
            self._made[key] = choice
        return choice

    def _decide(
        self, call: str, path: str | None, on_device: bool, dtype: str, nbytes: int
    ) -> PathChoice:
        from cudampi.comm.engines.mpi import can_reduce

        requested = check_path(path, "path") or self.default
        choice = choose(
            call, requested, on_device, dtype, nbytes, self.support, mpi_reduces=can_reduce(dtype)
        )
        note = unprobed_note(choice, requested, on_device, self.support)
        if note and self.rank == 0 and not _TOLD[0]:
            _TOLD[0] = True
            warnings.warn(f"cudampi: {note}", RuntimeWarning, stacklevel=5)
        return choice


_TOLD = [False]
"""Whether this process already said that auto chose a device path without a probe result."""
