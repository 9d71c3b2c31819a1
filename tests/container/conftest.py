from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.container.podman import REPORT, Built, Podman, build_image, make_base, why_skip
from tests.mpirun import bring_up


@dataclass
class Image:
    """The built image, the podman that holds it, and the generated folder it was built from."""

    podman: Podman
    base: Built
    built: Built
    generated: Path

    @property
    def name(self) -> str:
        return self.built.image

    def up(self) -> None:
        self.base = make_base(self.podman)
        self.built, self.generated = build_image(self.podman, self.base)

    def down(self) -> None:
        self.podman.down()


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    """The image, built once per session (minutes); every container of the tier goes with it."""

    def make() -> Image:
        none = Built("", None, 0)
        return Image(Podman(tmp_path_factory.mktemp("podman")), none, none, Path())

    yield from bring_up(make, why_skip())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.section("container tier")
        for key, value in REPORT.items():
            terminalreporter.write_line(f"{key}: {value}")
