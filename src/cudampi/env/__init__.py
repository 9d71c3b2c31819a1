"""``cudampi env``: one description (:class:`EnvSpec`) -> files that rebuild the same CUDA-aware
stack with pip, conda, a container, Slurm or Kubernetes; plus the documented Open MPI / UCX /
NCCL settings and :func:`check_settings`, which ``cudampi doctor`` runs on the environment.

Nothing here imports mpi4py, torch or CuPy.
"""

from __future__ import annotations

from cudampi.env.files import TARGETS, generate, write_files
from cudampi.env.recommended import SETTINGS, Setting, recommended_env
from cudampi.env.settings import SettingFinding, check_settings
from cudampi.env.spec import DEFAULT, EnvSpec, SpecError, load_spec

__all__ = [
    "DEFAULT",
    "SETTINGS",
    "TARGETS",
    "EnvSpec",
    "Setting",
    "SettingFinding",
    "SpecError",
    "check_settings",
    "generate",
    "load_spec",
    "recommended_env",
    "write_files",
]
