"""accelerate and the transformers Trainer given ``backend="cudampi"`` by name, on a GPU.

On the CPU accelerate refuses the name (its CPU path picks ``mpi`` or ``gloo`` itself:
tests/mpi/test_torch_clients.py shows it, docs/torch.md gives the recipe, the group made first).
On a GPU with LOCAL_RANK set (``cudampi launch``, torchrun) its GPU path passes the name through
to ``init_process_group``: this checks that it does, and that a CUDA all_reduce runs on cudampi.

Run on the GPU machine (2 ranks may share one GPU):

    python -m pytest -m gpu tests/gpu/test_accelerate_gpu.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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


@pytest.mark.parametrize("launcher", ["cudampi-launch", "torchrun"])
@pytest.mark.parametrize("lib", ["accelerate", "transformers"])
def test_the_backend_name_passes_through_on_a_gpu(tmp_path, lib, launcher):
    pytest.importorskip(lib)
    script = tmp_path / "by_name.py"
    script.write_text(textwrap.dedent(_BY_NAME[lib]) + textwrap.dedent(_CHECK))
    if launcher == "torchrun":
        from tests.mpi.test_torch_torchrun import torchrun_env

        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "2", str(script)]
        env = torchrun_env("default")
    else:
        argv = [sys.executable, "-m", "cudampi", "launch", "-n", "2", str(script)]
        env = mpi_env()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert "by name: cudampi 2" in proc.stdout, proc.stdout
