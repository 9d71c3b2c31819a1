"""The documentation as a product: the site builds as CI builds it (`mkdocs build --strict`,
the API reference generated from the docstrings), the results pages stay current and short,
README's table quotes them, and no page points outside the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = ("h200.md", "h100.md", "cpu.md")


def test_the_site_builds_strict_with_the_api_reference(tmp_path: Path):
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"{exc}: the docs site needs the dev extra (pip install -e '.[dev]')")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    comm = (site / "reference" / "comm" / "index.html").read_text()
    assert "Collectives and point-to-point over an mpi4py communicator" in comm  # a docstring
    assert ":func:" not in comm and ":meth:" not in comm  # Sphinx roles read as code
    # a link from a guide to a repository file outside docs/ reads as that file's path
    torch_page = (site / "torch" / "index.html").read_text()
    assert "<code>examples/lightning_train.py</code>" in torch_page
    for page in RESULTS:
        assert (site / "benchmarks" / page.removesuffix(".md") / "index.html").is_file()


def test_the_results_pages_are_one_per_machine_kind_and_short():
    pages = [DOCS / "benchmarks.md", *(DOCS / "benchmarks" / p for p in RESULTS)]
    lines = sum(len(p.read_text().splitlines()) for p in pages)
    assert lines <= 500, f"{lines} lines: keep the current figures, history lives in git"
    for page in pages[1:]:
        text = page.read_text()
        # every table of figures follows the command that produced it
        blocks = re.split(r"^## ", text, flags=re.M)[1:]
        for block in blocks:
            if re.search(r"^\|.*\d", block, re.M):
                assert "cudampi" in block or "mpirun" in block or "mpiexec" in block, (
                    f"{page.name}: the section {block.splitlines()[0]!r} has figures but no command"
                )
        assert not re.search(r"\b(first|second|third|fourth|fifth|sixth|seventh) round\b", text)


def test_readme_figures_are_the_results_pages_figures():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Where it stands") : readme.index("## What is in it")]
    results = "\n".join((DOCS / "benchmarks" / p).read_text() for p in RESULTS)
    figures = re.findall(r"\d+\.\d+x?|\d{3,}", table)
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", results)]
    assert figures and not missing, f"README quotes {missing} that no results page has"
    assert not re.search(r"\bround\b", readme), "README names a dated round: quote a results page"


def _links(text: str) -> list[str]:
    return re.findall(r"(?<!!)\[[^\]\n]+\]\(([^)\s#]+)", text)


@pytest.mark.parametrize(
    "page", [*sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md")), "README.md"]
)
def test_no_page_points_outside_the_repository(page: str):
    text = (ROOT / page).read_text()
    assert not re.search(r"/work/|\.\./shared\b|\bshared/tools\b", text), (
        f"{page} names a path outside this repository"
    )
    for target in _links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        where = ((ROOT / page).parent / target).resolve()
        assert where.is_relative_to(ROOT) and where.exists(), f"{page}: link {target!r} is broken"
