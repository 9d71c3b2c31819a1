"""cudampi.atomic: a file is replaced whole or not at all, keeps its permissions, and a target
that is not a regular file (a device, a pipe) is written in place, never replaced."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from cudampi.atomic import write_text


def test_a_new_file_gets_the_umask_and_a_replaced_one_keeps_its_mode(tmp_path):
    path = tmp_path / "r.json"
    old = os.umask(0o027)
    try:
        write_text(path, "one")
    finally:
        os.umask(old)
    assert path.read_text() == "one" and stat.S_IMODE(path.stat().st_mode) == 0o640
    path.chmod(0o600)
    write_text(path, "two")
    assert path.read_text() == "two" and stat.S_IMODE(path.stat().st_mode) == 0o600
    write_text(path, "three", mode=0o644)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_a_symlink_is_written_through_unless_asked_not_to(tmp_path):
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    assert write_text(link, "new") == real
    assert real.read_text() == "new" and link.is_symlink()
    write_text(link, "own", follow_symlinks=False)
    assert not link.is_symlink() and link.read_text() == "own" and real.read_text() == "new"


def test_a_device_is_written_in_place_not_replaced(tmp_path):
    write_text("/dev/null", "nothing")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen([sys.executable, "-c", f"print(open({str(fifo)!r}).read())"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    write_text(fifo, "through the pipe")
    assert reader.communicate(timeout=30)[0].strip() == "through the pipe"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")
    with pytest.raises(TypeError):  # fails mid-write (a full disk: tests/mpi/test_full_disk.py)
        write_text(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    with pytest.raises(FileNotFoundError):
        write_text(tmp_path / "no" / "r.json", "x")
