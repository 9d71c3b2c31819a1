"""Open MPI's ``ompi_info``: what was this Open MPI built with?

:func:`parse_ompi_info` reads both the plain format (``ompi_info``) and the machine format
(``ompi_info --parsable --all``); :func:`query_ompi_info` runs the tool of one installation.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cudampi.errors import ProbeError


@dataclass(frozen=True)
class OmpiInfo:
    """The facts of one Open MPI build that decide whether it can touch device memory."""

    version: str | None = None
    package: str | None = None
    prefix: str | None = None
    configure: str | None = None
    built_with_cuda: bool | None = None
    """``mpi_built_with_cuda_support`` (4.x) / ``opal_built_with_cuda_support`` (5.x); None: not
    in the output (the plain format does not print it)."""
    cuda_support_enabled: bool | None = None
    """``opal_cuda_support`` (runtime switch, only meaningful when built with CUDA)."""
    components: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """MCA framework -> component names, e.g. ``{"pml": ("ob1", "ucx"), "accelerator": ("null",)}``."""
    extensions: tuple[str, ...] = ()

    @property
    def major(self) -> int | None:
        """The major version (4, 5), or None when the version is unknown."""
        head = (self.version or "").split(".")[0]
        return int(head) if head.isdigit() else None

    @property
    def accelerators(self) -> tuple[str, ...]:
        """Accelerator components (5.x): ``cuda`` means a CUDA build, ``null`` a CPU-only one."""
        return self.components.get("accelerator", ())

    @property
    def pml(self) -> tuple[str, ...]:
        return self.components.get("pml", ())

    @property
    def btl(self) -> tuple[str, ...]:
        return self.components.get("btl", ())

    @property
    def configured_without_cuda(self) -> bool:
        return bool(self.configure and re.search(r"--without-cuda\b", self.configure))

    @property
    def configured_with_cuda(self) -> bool:
        return bool(
            self.configure and re.search(r"--with-cuda(?:=(?!no\b)\S+)?(?=['\s]|$)", self.configure)
        )

    @property
    def cuda_build(self) -> bool | None:
        """Best single answer to "was this built with CUDA?" from every signal present."""
        if self.built_with_cuda is not None:
            return self.built_with_cuda
        if "cuda" in self.accelerators or "smcuda" in self.btl:
            return True
        if self.accelerators or self.configured_without_cuda:
            return False
        if self.configured_with_cuda:
            return True
        return None


_PLAIN_KEYS = {
    "Open MPI": "version",
    "Package": "package",
    "Prefix": "prefix",
    "Configure command line": "configure",
    "MPI extensions": "extensions",
}
_PARSABLE_KEYS = {
    "ompi:version:full": "version",
    "package": "package",
    "path:prefix": "prefix",
    "config:cli": "configure",
    "options:mpi_ext": "extensions",
}
_BOOL = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
_CUDA_BUILT = (
    "mca:mpi:base:param:mpi_built_with_cuda_support:value",
    "mca:opal:base:param:opal_built_with_cuda_support:value",
)
_CUDA_ENABLED = (
    "mca:opal:base:param:opal_cuda_support:value",
    "mca:mpi:base:param:mpi_cuda_support:value",
)
_MCA_PLAIN = re.compile(r"^\s*MCA ([\w-]+):\s+([\w-]+)\s+\(")
_MCA_PARSABLE = re.compile(r"^mca:([\w-]+):([\w-]+):version:")


def parse_ompi_info(text: str) -> OmpiInfo:
    """Parse ``ompi_info`` output in either format (or a grep of it).

    Lines that are not understood are ignored, so partial output still yields what it shows.
    """
    values: dict[str, str] = {}
    components: dict[str, list[str]] = {}
    built: bool | None = None
    enabled: bool | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        m = _MCA_PLAIN.match(line) or _MCA_PARSABLE.match(line)
        if m:
            framework, name = m.group(1), m.group(2)
            if name != "base":
                names = components.setdefault(framework, [])
                if name not in names:
                    names.append(name)
            continue
        if line.startswith("mca:"):
            key, _, value = line.rpartition(":")
            if key in _CUDA_BUILT and value.lower() in _BOOL:
                built = _BOOL[value.lower()]
            elif key in _CUDA_ENABLED and value.lower() in _BOOL and enabled is None:
                enabled = _BOOL[value.lower()]
            continue
        matched = False
        for key, name in _PARSABLE_KEYS.items():
            if line.startswith(key + ":"):
                values.setdefault(name, line[len(key) + 1 :].strip())
                matched = True
                break
        if matched:
            continue
        head, sep, tail = line.partition(":")
        if sep and head.strip() in _PLAIN_KEYS:
            values.setdefault(_PLAIN_KEYS[head.strip()], tail.strip())
    ext = values.get("extensions", "")
    return OmpiInfo(
        version=values.get("version") or None,
        package=values.get("package") or None,
        prefix=values.get("prefix") or None,
        configure=values.get("configure") or None,
        built_with_cuda=built,
        cuda_support_enabled=enabled,
        components={k: tuple(v) for k, v in components.items()},
        extensions=tuple(e.strip() for e in ext.split(",") if e.strip()),
    )


_SETTING_PREFIXES = ("OMPI_MCA_", "OPAL_MCA_", "PRTE_MCA_", "PMIX_MCA_")


def query_ompi_info(
    ompi_info: str | Path, timeout: float = 60.0, env: Mapping[str, str] | None = None
) -> OmpiInfo:
    """Run ``ompi_info --parsable --all`` of one installation and parse it.

    A setting the library cannot honour stops ``ompi_info`` too
    (``OMPI_MCA_opal_cuda_support=true`` on a build without CUDA), yet the build facts do not
    depend on the settings: when it fails, it runs once more without the ``*_MCA_*`` variables,
    so the settings check can say which one is wrong for this build.
    """
    base = dict(os.environ if env is None else env)
    bare = {k: v for k, v in base.items() if not k.startswith(_SETTING_PREFIXES)}
    argv = [str(ompi_info), "--parsable", "--all"]
    for run_env in (base, bare):
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=run_env
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ProbeError(f"could not run {argv!r}: {exc}") from None
        if proc.returncode == 0 or run_env == bare:
            break
    if proc.returncode != 0:
        raise ProbeError(
            f"{argv!r} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]!r}"
        )
    return parse_ompi_info(proc.stdout)
