"""Run a real command with one folder on a full file system: a small tmpfs mounted over the folder
in a private mount namespace (``unshare --mount``; an unprivileged user namespace where root is
not there to make one), filled but for ``free`` bytes. Nothing outside the namespace sees it.

``run_on_full_disk(argv, folder, free=0, seed={"old.json": "..."})`` returns the completed
process and what the folder held afterwards (name -> text), read inside the namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

SIZE = 256 << 10

_INSIDE = r"""
import json, os, subprocess, sys
folder, size, free, seed, listing = sys.argv[1:6]
argv = sys.argv[6:]
os.makedirs(folder, exist_ok=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "cudampi-full", folder], check=True)
for name, text in json.loads(seed).items():
    os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)
fill = os.path.join(folder, ".fill")
with open(fill, "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"\0" * 4096)
    except OSError:
        pass
if int(free):
    os.truncate(fill, max(0, os.path.getsize(fill) - int(free)))
rc = subprocess.call(argv)
os.unlink(fill)
found = {}
for root, _dirs, files in os.walk(folder):
    for name in files:
        path = os.path.join(root, name)
        with open(path, errors="replace") as f:
            found[os.path.relpath(path, folder)] = f.read()
with open(listing, "w") as f:
    json.dump(found, f)
sys.exit(rc)
"""


def _prefix() -> list[str]:
    if os.geteuid() == 0:
        return ["unshare", "--mount"]
    return ["unshare", "--user", "--map-root-user", "--mount"]


@cache
def why_no_full_disk() -> str | None:
    """Why a full file system cannot be made here (None: it can)."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux's unshare(1) to mount a private tmpfs"
    probe = subprocess.run(
        [*_prefix(), "sh", "-c", "mount -t tmpfs -o size=4k none /mnt || mount -t tmpfs none /tmp"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()[:200]}"
    return None


def run_on_full_disk(
    argv: list[str],
    folder: Path,
    *,
    free: int = 0,
    seed: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    **kw: Any,
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """Run ``argv`` with ``folder`` full but for ``free`` bytes (``seed``: files put there
    first); the process and the folder's files afterwards (the filler excluded)."""
    listing = folder.parent / f"{folder.name}.listing.json"
    inside = [sys.executable, "-c", _INSIDE, str(folder), str(SIZE), str(free)]
    proc = subprocess.run(
        [*_prefix(), *inside, json.dumps(seed or {}), str(listing), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kw,
    )
    try:
        found = json.loads(listing.read_text())
    except (OSError, ValueError):
        raise AssertionError(
            f"the full-disk run left no listing (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        ) from None
    return proc, found
