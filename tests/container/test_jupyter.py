"""MODE=jupyter: JupyterLab behind its token. Another container of the image on the same private
bridge plays the browser (tests/container/_jupyter_client.py: the REST API and its WebSockets):
without the token, or with a wrong one, the server answers 403; with it, a kernel runs a cell
that imports cudampi and does a 1-rank Communicator allreduce, and a terminal runs
``cudampi doctor``, which must pass there too (a login shell: the venv on PATH again)."""

from __future__ import annotations

import json
import secrets
import time

import pytest

from tests.container.conftest import Image
from tests.container.podman import JOB_DIR, note

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_jupyter_token_kernel_and_terminal(image: Image):
    p = image.podman
    net = p.network(f"{p.tag}-jnet")
    server, client = f"{p.tag}-jupyter", f"{p.tag}-browser"
    token = secrets.token_hex(24)
    common = ("--network", net.name, "--health-interval", "disable")
    try:
        start = time.monotonic()
        p(
            "run",
            "--detach",
            "--name",
            server,
            "--ip",
            net.address(1),
            *common,
            "--env",
            "MODE=jupyter",
            "--env",
            f"JUPYTER_TOKEN={token}",
            image.name,
        )
        run = p(
            "run",
            "--rm",
            "--name",
            client,
            *common,
            "--volume",
            f"{JOB_DIR}:/workspace/job:ro",
            image.name,
            "python",
            "job/_jupyter_client.py",
            f"http://{net.address(1)}:8888",
            token,
            timeout=400,
        )
        took = time.monotonic() - start
        seen = json.loads(run.stdout.strip().splitlines()[-1])
        log = p("logs", server).stderr
    finally:
        p.remove(server, client)
        p("network", "rm", "--force", net.name, check=False)
    assert "MODE=jupyter" not in log and "No such file" not in log, log[-3000:]
    assert seen["status"] == {"no token": 403, "wrong token": 403, "token": 200}, seen["status"]
    cell = seen["cell"]
    assert cell.get("status") == "ok", cell
    assert "cell: cudampi 0.1.0 ranks 1 allreduce [0.0, 1.0, 2.0, 3.0]" in cell["output"], cell
    terminal = seen["terminal"]
    assert terminal["exit"] == 0, terminal["output"][-3000:]
    assert "doctor passed" in terminal["output"], terminal["output"][-3000:]
    note(
        "MODE=jupyter",
        f"server up in {seen['ready after']:.1f} s; 403 without the token, kernel cell and "
        f"terminal doctor done in {took:.0f} s in all",
    )
