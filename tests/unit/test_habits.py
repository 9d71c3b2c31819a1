"""The checks a developer runs at each commit are the ones CI runs (.pre-commit-config.yaml
against .ci/run), so a commit that passes locally does not fail CI on style or types."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ("ruff check ", "ruff format ", "mypy")


def ci_checks() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip().startswith(CHECKS)]


def test_pre_commit_runs_what_ci_runs():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    entries = [hook["entry"] for hook in hooks]
    assert len(ci_checks()) == 3, ci_checks()  # ruff check, ruff format --check, mypy
    assert entries == ci_checks()
    # the venv's tools on the whole tree, as CI runs them (not a downloaded copy on some files)
    assert all(h["language"] == "system" and h["pass_filenames"] is False for h in hooks)
