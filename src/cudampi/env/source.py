"""Where the generated files install cudampi itself from, so that a folder written by
``cudampi env write --out DIR`` works wherever it is moved.

The default (``source = ""`` in the description) bundles *this* cudampi into the folder as a
wheel, ``cudampi-<version>-py3-none-any.whl``: install.sh, the Dockerfile (whose build context is
the folder itself) and environment.yml install that file, so nothing points back at a checkout.
The wheel is built with ``pip wheel`` from the checkout this cudampi runs from, copied from the
wheel it was installed from, or downloaded from the package index it was installed from.

Any other ``source`` is given to pip as it is: a requirement (``cudampi==0.1.0``), a URL, or a
path, which (when relative) is relative to the generated folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

from cudampi._version import __version__
from cudampi.env.spec import EnvSpec
from cudampi.errors import EnvGenError

WHEEL = f"cudampi-{__version__}-py3-none-any.whl"
"""The file name of this cudampi's wheel (pure Python, any platform)."""


def bundled(spec: EnvSpec) -> bool:
    """Does the folder carry cudampi's wheel (the default), or does ``source`` name it?"""
    return not spec.source


def requirement(spec: EnvSpec) -> str:
    """What pip installs for cudampi, as written in the generated files (relative to them)."""
    return f"./{WHEEL}" if bundled(spec) else spec.source


def is_local_path(source: str) -> bool:
    """A path (relative to the generated folder or absolute), not a requirement or a URL."""
    if "://" in source or source.startswith("git+"):
        return False
    return source.startswith((".", "/")) or source.endswith((".whl", ".tar.gz", ".zip"))


def checkout(spec: EnvSpec) -> str | None:
    """The description's source when it is a folder above the generated one (``..``: the
    cudampi checkout that holds it, as this repository's docker/): the image is then built with
    that checkout as its context, from its sources. None for any other source."""
    src = spec.source
    if not src or not is_local_path(src) or src.endswith((".whl", ".tar.gz", ".zip")):
        return None
    rel = src.removeprefix("./").rstrip("/")
    return src if rel == ".." or rel.startswith("../") or src.startswith("/") else None


def folder_in_checkout(spec: EnvSpec, out: Path) -> str:
    """Where the generated folder ``out`` lies in :func:`checkout` (``docker``): the Dockerfile
    names its own files from the build context by this path."""
    root = (out / spec.source).resolve()
    rel = os.path.relpath(out.resolve(), root)
    if rel == "." or rel.startswith(".."):
        raise EnvGenError(
            f"the folder {str(out)!r} is not inside its source {spec.source!r} ({root}), which "
            "is the image's build context: write the files into a folder of the checkout, or "
            "leave source empty to bundle this cudampi's wheel"
        )
    return Path(rel).as_posix()


def bundle_status(spec: EnvSpec, out: Path) -> str:
    """'ok', 'not needed' or 'missing' for the wheel :func:`requirement` names."""
    if not bundled(spec):
        return "not needed"
    return "ok" if (out / WHEEL).is_file() else "missing"


def write_bundle(out: Path, *, timeout: float = 300) -> str:
    """Put this cudampi's wheel into ``out``; returns how it was made (for the report)."""
    target = out / WHEEL
    checkout = _checkout()
    if checkout is not None:
        _pip_wheel(checkout, target, timeout)
        return f"built from {checkout}"
    origin = _installed_from()
    if origin is not None and origin.name == WHEEL and origin.is_file():
        shutil.copyfile(origin, target)
        return f"copied from {origin}"
    if origin is None:
        _pip_download(target, timeout)
        return f"downloaded cudampi=={__version__}"
    raise EnvGenError(
        f"cannot bundle cudampi {__version__}: it was installed from {str(origin)!r}, which is "
        f"not its wheel or no longer there. Give the description a source (--source PATH|URL|"
        f"REQUIREMENT, relative paths from the output folder)"
    )


def _checkout() -> Path | None:
    """The project folder this cudampi's code runs from (an editable install or src/ on the
    path), if it is one."""
    import cudampi

    root = Path(cudampi.__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    try:
        text = pyproject.read_text()
    except OSError:
        return None
    return root if 'name = "cudampi"' in text else None


def _installed_from() -> Path | None:
    """The file or folder pip installed this cudampi from (PEP 610 direct_url.json), or None
    when it came from a package index."""
    from importlib import metadata

    try:
        raw = metadata.distribution("cudampi").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not raw:
        return None
    url = json.loads(raw).get("url", "")
    parsed = urlparse(url)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(url)


def _run(argv: list[str], what: str, timeout: float) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise EnvGenError(f"{what} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise EnvGenError(f"{what} failed (exit {proc.returncode}):\n{tail}")


PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")


def _pip_wheel(project: Path, target: Path, timeout: float) -> None:
    # Built from a copy of what the wheel is made of: setuptools' build/ folder in the checkout
    # would otherwise carry modules deleted since into the wheel.
    with tempfile.TemporaryDirectory(prefix="cudampi-wheel-") as tmp:
        copy, wheels = Path(tmp) / "project", Path(tmp) / "wheels"
        copy.mkdir()
        for name in PROJECT_FILES:
            if (project / name).is_file():
                shutil.copyfile(project / name, copy / name)
        shutil.copytree(
            project / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels)]
        _run([*argv, str(copy)], f"pip wheel {project}", timeout)
        built = wheels / WHEEL
        if not built.is_file():
            found = sorted(p.name for p in wheels.iterdir())
            raise EnvGenError(
                f"pip wheel {project} made {found!r}, not {WHEEL!r}: the checkout's version "
                f"differs from the running cudampi {__version__}; reinstall it (pip install -e)"
            )
        shutil.copyfile(built, target)


def _pip_download(target: Path, timeout: float) -> None:
    with tempfile.TemporaryDirectory(prefix="cudampi-wheel-") as tmp:
        argv = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            tmp,
            f"cudampi=={__version__}",
        ]
        _run(argv, f"pip download cudampi=={__version__}", timeout)
        shutil.copyfile(Path(tmp) / WHEEL, target)
