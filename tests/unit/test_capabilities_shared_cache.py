"""One capabilities cache written by several hosts at once (a home directory on a shared file
system, as `cudampi doctor --hosts` makes every node save its entry at about the same time):
no host's entry may be lost."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from cudampi.probe import capabilities as caps

HOSTS, ENTRIES = 4, 15


def _save_all(args: tuple[str, str]) -> None:
    folder, host = args
    for i in range(ENTRIES):
        caps.save(folder, caps.Capabilities(key=f"key{i}", mpi_library="MPI x", host=host))


def test_hosts_saving_at_once_keep_every_entry(tmp_path: Path):
    folder = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(HOSTS) as pool:
        pool.map(_save_all, [(folder, f"node{h}") for h in range(HOSTS)])
    entries = caps.load_all(folder)
    want = {caps.entry_name(f"key{i}", f"node{h}") for h in range(HOSTS) for i in range(ENTRIES)}
    assert set(entries) == want, f"{len(want - set(entries))} of {len(want)} entries lost"
    assert not list(Path(folder).glob("*.tmp*"))  # no half-written file left behind
