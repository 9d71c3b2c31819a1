"""The GPU suite's session deadline, and the fixture that runs a file's checks as MPI jobs
(tests/gpu/jobs.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gpu.jobs import Jobs, deadline_skip, selected_params


def pytest_runtest_setup(item: pytest.Item) -> None:
    callspec = getattr(item, "callspec", None)
    check = callspec.params.get("check") if callspec is not None else None
    why = deadline_skip(item.module.__name__, check)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def gpu_jobs(request: Any) -> Jobs:
    """The module's checks as jobs: one per rank count and stack, holding every check of the
    module the session runs."""
    checks = [p["check"] for p in selected_params(request, "gpu_jobs") if "check" in p]
    return Jobs(request.module.__name__, checks)
