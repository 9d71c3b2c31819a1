"""The GPU suite's session deadline, and the fixture that runs a file's checks as MPI jobs
(tests/gpu/jobs.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gpu.jobs import TIME_RAN_OUT, Jobs, deadline_left, selected_params

MIN_LEFT = 10.0
"""A test starts only with this many seconds left before the session's deadline."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    left = deadline_left()
    if left is not None and left < MIN_LEFT:
        pytest.skip(
            f"{TIME_RAN_OUT}: {max(0.0, left):.0f} s were left before the session's deadline "
            "(CUDAMPI_TEST_DEADLINE)"
        )


@pytest.fixture(scope="module")
def gpu_jobs(request: Any) -> Jobs:
    """The module's checks as jobs: one per rank count and stack, holding every check of the
    module the session runs."""
    checks = [p["check"] for p in selected_params(request, "gpu_jobs") if "check" in p]
    return Jobs(request.module.__name__, checks)
