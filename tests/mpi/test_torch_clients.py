"""Training libraries on the cudampi backend, as their users run them.

Each example in examples/ runs on real ranks twice, on cudampi and on gloo, and must end with the
same parameters, replicas in sync, and its checkpoint round trip exact:

- Lightning (``DDPStrategy(process_group_backend=...)``) under mpiexec; under Lightning's own
  launcher (``python train.py``, devices=2) every rank fails fast with the fix
  (``plugins=[LightningEnvironment()]``), and with that fix it trains (on the default install:
  cudampi's own MPICH);
- ``accelerate launch`` (torchrun inside) with the group made first, on the default install;
- accelerate and the transformers Trainer with the group created first; their own
  ``backend="cudampi"`` / ``ddp_backend="cudampi"`` is refused by accelerate's CPU path (shown,
  so the docs' workaround stays needed and true).

lightning and accelerate come from the ``[integrations]`` extra (CI installs it: ~70 MB, ~11 s);
transformers (~160 MB) is not in CI: its tests are marked slow and skip without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cudampi.pmi import mpich
from tests.mpi.test_torch_torchrun import torchrun_env
from tests.mpirun import ROOT, mpi_env, mpiexec_argv, run_launched

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

EXAMPLES = ROOT / "examples"


def _example(n, script, *args, tmp_path, env=None, launcher=True, timeout=240):
    argv = [sys.executable, str(EXAMPLES / script), "--json", "--out", str(tmp_path / "out"), *args]
    if launcher:
        argv = [*mpiexec_argv(n), *argv]
    full = mpi_env({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **(env or {})})
    return run_launched(argv, full, timeout, script, cwd=tmp_path)


def _result(proc):
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"backend"')]
    assert len(lines) == 1, proc.stdout[-3000:]  # only rank 0 prints
    return json.loads(lines[0])


def _same_as_gloo(script, tmp_path, n=2):
    ours = _result(_example(n, script, "--backend", "cudampi", tmp_path=tmp_path / "c"))
    theirs = _result(_example(n, script, "--backend", "gloo", tmp_path=tmp_path / "g"))
    assert ours["backend"] == "cudampi" and theirs["backend"] == "gloo"
    assert ours["world_size"] == theirs["world_size"] == n
    assert ours["replicas_in_sync"] and theirs["replicas_in_sync"]
    assert ours["params"] == theirs["params"]
    return ours


@pytest.mark.slow  # ~35 s on an idle 2-core machine: Lightning's import and two Trainers per job
def test_lightning_ddp_strategy_matches_gloo(tmp_path):
    pytest.importorskip("lightning")
    for d in ("c", "g"):
        (tmp_path / d).mkdir()
    ours = _same_as_gloo("lightning_train.py", tmp_path)
    assert ours["global_step"] == 8  # 6 steps, a checkpoint, resumed for 2 more


def test_lightning_own_launcher_fails_fast_with_the_fix(tmp_path):
    """``python train.py`` with devices=2: Lightning's MPIEnvironment detection starts MPI in
    each process (a singleton), so cudampi cannot join them: every rank says what to pass."""
    pytest.importorskip("lightning")
    proc = _example(
        2, "lightning_train.py", "--devices", "2", tmp_path=tmp_path, launcher=False, timeout=150
    )
    assert proc.returncode != 0
    assert "MPI singleton" in proc.stderr, proc.stderr[-4000:]
    assert "plugins=[LightningEnvironment()]" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.slow
def test_lightning_own_launcher_with_lightning_environment(tmp_path):
    """The fix: ``plugins=[LightningEnvironment()]``; MPI starts in the cudampi group, which joins
    the processes through its PMI-1 server (MPICH-family MPI, as under torchrun)."""
    pytest.importorskip("lightning")
    if not os.path.exists(mpich.library()):
        pytest.skip(f"cudampi's MPICH is not installed: {mpich.INSTALL} (README command 2 does)")
    env = {"MPI4PY_LIBMPI": ""}  # the default install: cudampi's MPICH, nothing named
    proc = _example(
        2,
        "lightning_train.py",
        "--devices",
        "2",
        "--lightning-env",
        tmp_path=tmp_path,
        env=env,
        launcher=False,
        timeout=180,
    )
    got = _result(proc)
    assert got["backend"] == "cudampi" and got["world_size"] == 2 and got["replicas_in_sync"]


def test_accelerate_launch_runs_the_example_on_the_default_install(tmp_path):
    """``accelerate launch`` starts the ranks itself (torchrun inside): the example's group,
    made first, joins them through cudampi's PMI server and its own MPICH, with no flags."""
    pytest.importorskip("accelerate")
    if not os.path.exists(mpich.library()):
        pytest.skip(f"cudampi's MPICH is not installed: {mpich.INSTALL} (README command 2 does)")
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"]
    argv += ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    argv += ["--dynamo_backend", "no", str(EXAMPLES / "accelerate_train.py")]
    argv += ["--json", "--steps", "4", "--out", str(tmp_path / "out")]
    env = torchrun_env("default")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    got = _result(proc)
    assert got["backend"] == "cudampi" and got["world_size"] == 2
    assert got["replicas_in_sync"] and got["load_state_repeats"]


def test_accelerate_with_the_group_first_matches_gloo(tmp_path):
    pytest.importorskip("accelerate")
    for d in ("c", "g"):
        (tmp_path / d).mkdir()
    ours = _same_as_gloo("accelerate_train.py", tmp_path)
    assert ours["load_state_repeats"]
    assert ours["accelerate_backend_label"] == "gloo"  # the label accelerate's CPU path sets


@pytest.mark.slow
def test_transformers_trainer_with_the_group_first_matches_gloo(tmp_path):
    """Not in CI's venv (transformers adds ~160 MB): `pip install transformers` to run it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    for d in ("c", "g"):
        (tmp_path / d).mkdir()
    ours = _same_as_gloo("transformers_train.py", tmp_path)
    assert ours["resume_repeats"]


_REFUSED = {
    "accelerate": """
from accelerate import PartialState

try:
    PartialState(cpu=True, backend="cudampi")
except ValueError as exc:
    print("accelerate:", exc, flush=True)
""",
    "transformers": """
from transformers import TrainingArguments

try:
    TrainingArguments(output_dir="out", use_cpu=True, ddp_backend="cudampi", report_to=[]).device
except ValueError as exc:
    print("transformers:", exc, flush=True)
""",
}


def _refused(lib, tmp_path):
    script = tmp_path / "refused.py"
    script.write_text(textwrap.dedent(_REFUSED[lib]))
    argv = [*mpiexec_argv(2), sys.executable, str(script)]
    proc = run_launched(argv, mpi_env({"OMP_NUM_THREADS": "1"}), 180, lib, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # accelerate's CPU path swaps the name for gloo (or mpi) on every rank.
    want = f"{lib}: Your assigned backend cudampi is not available, please use gloo"
    assert proc.stdout.count(want) == 2, proc.stdout


def test_accelerate_refuses_its_own_backend_name_on_cpu(tmp_path):
    """What the docs work around: InitProcessGroupKwargs(backend="cudampi") on a CPU machine."""
    pytest.importorskip("accelerate")
    _refused("accelerate", tmp_path)


@pytest.mark.slow
def test_transformers_refuses_its_own_backend_name_on_cpu(tmp_path):
    """TrainingArguments(ddp_backend="cudampi") goes through the same accelerate check."""
    pytest.importorskip("transformers")
    _refused("transformers", tmp_path)


def test_examples_document_their_command_lines():
    for name in ("lightning_train.py", "accelerate_train.py", "transformers_train.py"):
        text = (EXAMPLES / name).read_text()
        assert f"cudampi launch -n 2 examples/{name}" in text, name
        assert os.path.exists(EXAMPLES / name)
