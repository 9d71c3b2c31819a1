"""pyproject.toml says only what is true: the license file it declares exists and is the
BSD-3-Clause text, no placeholder URL, package data that exists, one version, and the extras
named by CUDA major."""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import cudampi

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the 3.10 tier
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_matches_the_declared_license():
    p = PROJECT["project"]
    assert p["license"] == "BSD-3-Clause" and p["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "Neither the name of the copyright holder nor the names of its" in text


def test_no_placeholder_urls_and_package_data_that_exists():
    assert "urls" not in PROJECT["project"] or all(
        "example" not in u for u in PROJECT["project"]["urls"].values()
    )
    for pattern in PROJECT["tool"]["setuptools"]["package-data"]["cudampi"]:
        assert glob.glob(str(ROOT / "src" / "cudampi" / pattern)), pattern


def test_one_version():
    assert "version" not in PROJECT["project"] and PROJECT["project"]["dynamic"] == ["version"]
    dyn = PROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert dyn == {"attr": "cudampi._version.__version__"}
    from importlib import metadata

    assert metadata.version("cudampi") == cudampi.__version__


def test_extras_by_cuda_major_and_what_needs_what():
    extras = PROJECT["project"]["optional-dependencies"]
    assert {"cu12", "cu13", "all", "torch", "plot", "env", "dev"} <= set(extras)
    assert not {"ucx", "ucx13", "cupy", "cupy13"} & set(extras)
    assert any(r.startswith("libucx-cu12") for r in extras["cu12"])
    assert any(r.startswith("cupy-cuda13x") for r in extras["cu13"])
    assert any(r.startswith("jsonschema") for r in extras["env"])  # validate_generated needs it
    assert extras["all"] == ["cudampi[torch,cu13,plot,env]"]
    deps = PROJECT["project"]["dependencies"]
    for name in ("nvidia-ml-py", "python-hostlist", "tomli-w"):
        assert any(d.startswith(name) for d in deps), name
    assert "tomli>=1.1; python_version < '3.11'" in deps
