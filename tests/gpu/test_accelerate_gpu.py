"""accelerate and the transformers Trainer given ``backend="cudampi"`` by name, on a GPU.

On the CPU accelerate refuses the name (its CPU path picks ``mpi`` or ``gloo`` itself:
tests/mpi/test_torch_clients.py shows it, docs/torch.md gives the recipe, the group made first).
On a GPU with LOCAL_RANK set (``cudampi launch``, torchrun) its GPU path passes the name through
to ``init_process_group``: this checks that it does, and that a CUDA all_reduce runs on cudampi.

The four runs (each library under each launcher) start together (the ``runs`` fixture): each
spends its time importing and starting ranks, the GPU mostly idle. Run on the GPU machine (2
ranks may share one GPU):

    python -m pytest -m gpu tests/gpu/test_accelerate_gpu.py
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.gpu.jobs import Background, selected_params
from tests.mpirun import mpi_env

pytestmark = [pytest.mark.gpu, pytest.mark.mpi, pytest.mark.torch]

_BY_NAME = {
    "accelerate": """
        import torch, torch.distributed as dist
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="cudampi")])
        """,
    "transformers": """
        import torch, torch.distributed as dist
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir="out", ddp_backend="cudampi", report_to=[])
        args.device  # creates the group
        """,
}
_CHECK = """
    t = torch.full((1 << 20,), float(dist.get_rank() + 1), device="cuda")
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert t[0].item() == n * (n + 1) / 2, t[0].item()
    if dist.get_rank() == 0:
        print("by name:", dist.get_backend(), n, flush=True)
    dist.destroy_process_group()
"""


_NOT_INSTALLED = (
    "cudampi is on the path but not installed (no torch.backends entry point): torch knows the "
    "name 'cudampi' only through the installed entry point (pip install -e .)"
)


def _command(lib: str, launcher: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    script = tmp / "by_name.py"
    script.write_text(textwrap.dedent(_BY_NAME[lib]) + textwrap.dedent(_CHECK))
    if launcher == "torchrun":
        from tests.mpi.test_torch_torchrun import torchrun_env

        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "2", str(script)]
        return argv, torchrun_env("default")
    return [sys.executable, "-m", "cudampi", "launch", "-n", "2", str(script)], mpi_env()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The run of each test the session selects, started together."""
    bg = Background()
    for p in selected_params(request, "runs"):
        key = f"{p['lib']}-{p['launcher']}"
        if importlib.util.find_spec(p["lib"]) is None:
            continue  # the test skips
        if not any(e.name == "cudampi" for e in entry_points(group="torch.backends")):
            bg.skip(key, _NOT_INSTALLED)
            continue
        tmp = tmp_path_factory.mktemp(key)
        try:
            argv, env = _command(p["lib"], p["launcher"], tmp)
        except pytest.skip.Exception as exc:
            bg.skip(key, str(exc))
            continue
        bg.start(key, argv, env=env, timeout=300, cwd=tmp)
    yield bg
    bg.close()


@pytest.mark.parametrize("launcher", ["cudampi-launch", "torchrun"])
@pytest.mark.parametrize("lib", ["accelerate", "transformers"])
def test_the_backend_name_passes_through_on_a_gpu(runs, lib, launcher):
    pytest.importorskip(lib)
    proc = runs.result(f"{lib}-{launcher}")
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "by name: cudampi 2" in proc.stdout, proc.stdout
