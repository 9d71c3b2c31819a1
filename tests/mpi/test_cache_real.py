"""The capabilities cache in real jobs: a corrupt file is named (path, what is wrong, the fix)
and never stops a Communicator, torch's init_process_group or the doctor (a deeply nested one
was a RecursionError in all three); a cache folder linked into /etc or writable by others is
neither written nor believed."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.conftest import HAS_CUDA, cudampi_cli
from tests.mpirun import only_when_asked, run_mpi

pytestmark = pytest.mark.mpi

CORRUPT = {
    "nested": ("[" * 200000, "its JSON nests too deeply"),
    "truncated": (
        '{"abc@vm": {"key": "abc", "mpi_li',
        "is not valid JSON (truncated or corrupted?)",
    ),
}


def rank_with_a_cache_of_this_stack(comm, words, expect_entry, with_torch="0"):
    """A Communicator (and with ``with_torch``, torch's process group) in a job whose cache is
    what the test made: they work; rank 0 says what it found (one warning naming ``words``, or
    the entry)."""
    import warnings

    import numpy as np

    from cudampi.comm import Communicator

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Communicator(comm) as c:
            assert (c.capabilities is not None) == (expect_entry == "1"), c.capabilities
            got = c.allreduce(np.full(8, comm.rank + 1.0))
            assert got.tolist() == [comm.size * (comm.size + 1) / 2] * 8
            why = c.device_support.p2p_why
    said = [str(w.message) for w in seen if words in str(w.message)]
    assert len(said) == (1 if comm.rank == 0 and expect_entry != "1" else 0), (said, why)
    if said:
        print(f"rank 0 warned: {said[0]}", flush=True)
    if with_torch != "1":
        return
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return
    import cudampi.torch  # noqa: F401

    dist.init_process_group("cudampi")
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [float(comm.size)] * 4
    dist.destroy_process_group()
    if comm.rank == 0:
        print("torch ran", flush=True)


def _check(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


@pytest.mark.parametrize("kind", ["nested", pytest.param("truncated", marks=only_when_asked())])
def test_a_corrupt_cache_is_named_and_stops_nothing(tmp_path, kind):
    text, words = CORRUPT[kind]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "capabilities.json").write_text(text)
    env = {"CUDAMPI_CACHE_DIR": str(cache)}
    torch = kind == "nested" and importlib.util.find_spec("torch") is not None
    proc = run_mpi(
        2, __file__, "rank_with_a_cache_of_this_stack", words, "0", str(int(torch)), env=env
    )
    warned = next(ln for ln in proc.stdout.splitlines() if ln.startswith("rank 0 warned: "))
    assert f"the capabilities cache was not read: {cache / 'capabilities.json'} " in warned
    assert "`cudampi doctor` on this host replaces the file (or remove it)" in warned
    assert ("torch ran" in proc.stdout) == torch, proc.stdout
    if kind == "nested":
        if HAS_CUDA:
            return  # the doctor's device probes make the rest long on a GPU machine
        doctor = cudampi_cli("doctor", "--json", env=env, timeout=240)
        assert "Traceback" not in doctor.stderr, doctor.stderr[-3000:]
        saved = _check(json.loads(doctor.stdout), "capabilities cache")
        assert saved["status"] == "ok", saved  # the doctor replaced the corrupt file
        json.loads((cache / "capabilities.json").read_text())


@pytest.mark.skipif(HAS_CUDA, reason="the device probes make this run long on a GPU machine")
def test_the_doctor_writes_no_cache_through_a_link_into_etc(tmp_path):
    link = tmp_path / "cache"
    link.symlink_to("/etc")
    before = os.path.exists("/etc/capabilities.json")
    try:
        proc = cudampi_cli("doctor", "--json", env={"CUDAMPI_CACHE_DIR": str(link)}, timeout=240)
        assert os.path.exists("/etc/capabilities.json") == before
    finally:
        if not before and os.path.exists("/etc/capabilities.json"):
            os.unlink("/etc/capabilities.json")  # what the doctor, as root, wrote there
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    cache = _check(json.loads(proc.stdout), "capabilities cache")
    assert cache["status"] == "warn", cache
    assert (
        f"the cache folder {link} leads to the system folder /etc through a symlink"
        in (cache["detail"])
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="an entry of another user is made with chown")
def test_an_entry_in_a_world_writable_folder_is_not_believed(tmp_path):
    """The entry is a good one for this very stack, but anyone could have put it there."""
    cache = tmp_path / "cache"
    env = {"CUDAMPI_CACHE_DIR": str(cache)}
    run_mpi(1, __file__, "rank_saves_an_entry_of_this_stack", str(cache), env=env)
    words = "can be written by other users (mode 0777, no sticky bit)"
    cache.chmod(0o777)
    os.chown(cache / "capabilities.json", 65534, -1)
    proc = run_mpi(2, __file__, "rank_with_a_cache_of_this_stack", words, "0", env=env)
    assert f"the cache folder {cache} {words}" in proc.stdout, proc.stdout
    cache.chmod(0o700)  # made safe again, the entry is still of another user
    os.chown(cache / "capabilities.json", 65534, -1)
    words = f"the cache file {cache / 'capabilities.json'} belongs to uid 65534"
    proc = run_mpi(2, __file__, "rank_with_a_cache_of_this_stack", words, "0", env=env)
    assert words in proc.stdout, proc.stdout


def rank_saves_an_entry_of_this_stack(comm, cache_dir):
    import socket

    from mpi4py import MPI

    from cudampi.probe import capabilities as capmod

    lib = MPI.Get_library_version()
    capmod.save(
        cache_dir,
        capmod.Capabilities(
            key=capmod.stack_key(lib, os.environ),
            mpi_library=lib,
            host_staged=capmod.ProbeOutcome("ok"),
            host=socket.gethostname(),
            env=capmod.stack_env(os.environ),
        ),
    )
