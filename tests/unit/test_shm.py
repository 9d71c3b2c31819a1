"""cudampi.shm: which MPICH segments belong to a job, and which a failed job left (the naming itself
is checked on real MPICH in tests/mpi/test_pmi_init.py)."""

from __future__ import annotations

import mmap
import time

from cudampi.shm import (
    main,
    mpich_segments,
    mpich_world_id,
    orphaned_mpich_segments,
    remove,
    remove_mpich_segments,
    shm_state,
    stale_segments,
    unique_kvsname,
)


def test_a_jobs_segments_are_found_by_its_name_only(tmp_path):
    kvs, other = unique_kvsname(), unique_kvsname()
    mine = [f"mpich_shm_{mpich_world_id(kvs):x}_0", f"mpich_vci_{mpich_world_id(kvs):x}_1"]
    for name in [*mine, f"mpich_shm_{mpich_world_id(other):x}_0", "sm_segment.vm.0.1.0"]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f"mpich_shm_{mpich_world_id(kvs):x}_0x").write_bytes(b"x")  # not MPICH's form
    assert mpich_segments(kvs, str(tmp_path)) == sorted(str(tmp_path / n) for n in mine)
    assert remove_mpich_segments(kvs, str(tmp_path)) == sorted(str(tmp_path / n) for n in mine)
    assert mpich_segments(kvs, str(tmp_path)) == [] and len(list(tmp_path.iterdir())) == 3
    assert mpich_segments(kvs, str(tmp_path / "absent")) == []


def test_world_id_is_fnv1a():
    assert mpich_world_id("") == 0x811C9DC5  # the FNV offset basis
    assert mpich_world_id("a") == 0xE40C292C  # FNV-1a's published value for "a"


def test_orphans_are_made_since_the_job_began_and_mapped_by_nobody(tmp_path):
    old = tmp_path / "mpich_shm_1_0"
    old.write_bytes(b"x" * 4096)
    time.sleep(0.05)
    since = time.time() - 0.01
    orphan, live = tmp_path / "mpich_shm_2_0", tmp_path / "mpich_vci_3_0"
    for path in (orphan, live, tmp_path / "other_file"):
        path.write_bytes(b"x" * 4096)
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        found = orphaned_mpich_segments(since, str(tmp_path))
    assert found == [str(orphan)]
    assert remove([*found, str(tmp_path / "gone")]) == [str(orphan)]
    assert not orphan.exists() and old.exists() and live.exists()


def test_stale_segments_are_unmapped_mpi_files_and_the_command_removes_them(tmp_path, capsys):
    stale, live = tmp_path / "sm_segment.vm.0.1a2b0000.0", tmp_path / "mpich_shm_2_0"
    for path in (stale, live, tmp_path / "psm_1", tmp_path / "torch_123"):
        path.write_bytes(b"x" * 4096)
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert stale_segments(str(tmp_path)) == [str(stale)]
        state = shm_state(str(tmp_path))
        assert state is not None and state.stale == (str(stale),)
        assert state.stale_bytes >= 4096 and state.size >= state.free > 0
        assert main(["--folder", str(tmp_path)]) == 0 and stale.exists()
        assert capsys.readouterr().out == f"{stale}\n"
        assert main(["--folder", str(tmp_path), "--remove"]) == 0
    assert not stale.exists() and live.exists() and (tmp_path / "psm_1").exists()
    assert shm_state(str(tmp_path / "absent")) is None
