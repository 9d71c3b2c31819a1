"""The capabilities cache: an entry is believed only if it passes the schema and describes this
very stack (library, settings, host, and for a device claim a GPU of its model here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudampi.comm.paths import device_support
from cudampi.config import Config
from cudampi.probe import capabilities as cap
from cudampi.probe.gpu import driver_gpus, parse_driver_information

LIB = "Open MPI v5.0.11, package: Open MPI runner@host Distribution, ident: 5.0.11\nmore"
ENV = {"OMPI_MCA_pml": "ucx"}
HOST = "node1"
H200 = ("NVIDIA H200",)


def entry(**changes):
    caps = cap.Capabilities(
        key=cap.stack_key(LIB, ENV),
        mpi_library=LIB,
        device_p2p=cap.ProbeOutcome("ok", "correct", 880.5),
        device_allreduce=cap.ProbeOutcome("crash", "SIGSEGV in coll"),
        host_staged=cap.ProbeOutcome("ok"),
        gpu="NVIDIA H200",
        host=HOST,
        env=dict(ENV),
    ).to_json()
    caps.update(changes)
    return caps


def find(tmp_path, data, *, gpus=H200, host=HOST, env=ENV, lib=LIB):
    (tmp_path / "capabilities.json").write_text(json.dumps(data))
    return cap.lookup(tmp_path, lib, env, host=host, gpus=lambda: gpus)


def named(data):
    """``data`` filed where this stack's entry on HOST is looked up."""
    return {cap.entry_name(cap.stack_key(LIB, ENV), HOST): data}


def test_a_saved_entry_of_this_stack_is_believed(tmp_path):
    caps = cap.Capabilities.from_json(entry())
    cap.save(tmp_path, caps)
    found = cap.lookup(tmp_path, LIB, ENV, host=HOST, gpus=lambda: H200)
    assert found.entry == caps and not found.ignored
    support = device_support(Config.load(env={}), found.entry, found.note)
    assert support.p2p and "the probe proved" in support.p2p_why


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("device_p2p", "ok", "'device_p2p' must be an object"),
        ("device_p2p", None, "'device_p2p' must be an object"),
        ("device_p2p", {"status": "great"}, "device_p2p.status must be one of"),
        ("device_allreduce", {"status": "ok", "gbps": "fast"}, "device_allreduce.gbps"),
        ("host_copy_gbps", "12", "'host_copy_gbps' must be int or float or null"),
        ("silent_staging", 1, "'silent_staging' must be bool or null"),
        ("gpu", 7, "'gpu' must be str or null"),
        ("env", {"UCX_TLS": 3}, "'env' must map names to strings"),
        ("probed_at", True, "'probed_at' must be int or float"),
        ("key", None, "'key' must be str"),
    ],
)
def test_a_wrong_typed_field_is_ignored_and_said(tmp_path, field, value, words):
    found = find(tmp_path, named(entry(**{field: value})))
    assert found.entry is None and found.ignored
    assert words in found.note and "Run `cudampi doctor` on this host" in found.note
    support = device_support(Config.load(env={}), found.entry, found.note)
    assert not support.p2p and words in support.p2p_why


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"mpi_library": "MPICH Version: 5.0.2"}, "it was probed with 'MPICH Version: 5.0.2'"),
        ({"host": "node2"}, "it was probed on host 'node2', this is 'node1'"),
        ({"env": {}}, "it was probed with settings {}"),
        ({"gpu": None}, "claims device support but names no GPU"),
        ({"gpu": "NVIDIA A100"}, "on a NVIDIA A100, but this host has NVIDIA H200"),
        ({"key": "0" * 16}, "names key '0000000000000000'"),
    ],
)
def test_an_entry_of_another_stack_is_ignored(tmp_path, change, words):
    found = find(tmp_path, named(entry(**change)))
    assert found.entry is None and found.ignored and words in found.note, found.note


def test_a_device_claim_needs_a_gpu_the_driver_shows(tmp_path):
    found = find(tmp_path, named(entry()), gpus=None)  # no NVIDIA driver here
    assert found.entry is None and "the NVIDIA driver shows no GPU here" in found.note
    # an entry that claims nothing about device memory needs no GPU
    host_only = entry(device_p2p={"status": "skipped"}, gpu=None)
    found = find(tmp_path, named(host_only), gpus=None)
    assert found.entry is not None and not found.entry.claims_device


def test_no_entry_and_unreadable_files_are_not_errors(tmp_path):
    found = cap.lookup(tmp_path, LIB, ENV, host=HOST, gpus=lambda: H200)
    assert found.entry is None and not found.ignored and "run `cudampi doctor`" in found.note
    (tmp_path / "capabilities.json").write_text("{not json")
    assert cap.lookup(tmp_path, LIB, ENV, host=HOST, gpus=lambda: H200).entry is None
    # an entry of the format before hosts were recorded is not found (probe again)
    (tmp_path / "capabilities.json").write_text(json.dumps({entry()["key"]: entry()}))
    assert cap.lookup(tmp_path, LIB, ENV, host=HOST, gpus=lambda: H200).entry is None


def test_no_entry_for_these_settings_names_the_settings_the_probe_had(tmp_path):
    """A process whose settings differ from the probe's (the test suite's OMPI_MCA_btl=^ofi
    against a doctor run without it) finds no entry; the note says which settings differ, on
    both sides, instead of only "run cudampi doctor" (which the user just did)."""
    cap.save(tmp_path, cap.Capabilities.from_json(entry()))
    job = {**ENV, "OMPI_MCA_btl": "^ofi", "UNRELATED": "x"}
    found = cap.lookup(tmp_path, LIB, job, host=HOST, gpus=lambda: H200)
    assert found.entry is None and not found.ignored
    assert "probed on this host with other settings" in found.note, found.note
    assert "OMPI_MCA_btl=^ofi here, (unset) when probed" in found.note, found.note
    assert "OMPI_MCA_pml" not in found.note and "UNRELATED" not in found.note, found.note
    # another host's or another library's entry says nothing about this stack
    for other in ({"host": "node2"}, {"mpi_library": "MPICH Version: 5.0.2"}):
        filed = {cap.entry_name("0" * 16, other.get("host", HOST)): entry(**other)}
        (tmp_path / "capabilities.json").write_text(json.dumps(filed))
        found = cap.lookup(tmp_path, LIB, job, host=HOST, gpus=lambda: H200)
        assert (
            found.note == "no probe result for this MPI stack on this host (run `cudampi doctor`)"
        )


def test_entries_of_several_hosts_share_one_file(tmp_path):
    for host in ("a", "b"):
        cap.save(tmp_path, cap.Capabilities.from_json(entry(host=host)))
    for host in ("a", "b"):
        got = cap.lookup(tmp_path, LIB, ENV, host=host, gpus=lambda: H200).entry
        assert got is not None and got.host == host


def test_save_into_a_folder_that_cannot_be_made_raises_oserror(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        cap.save(tmp_path / "file" / "cache", cap.Capabilities.from_json(entry()))


def test_driver_information_gives_the_model(tmp_path):
    text = (
        "Model: \t\t NVIDIA H200\nIRQ:   \t\t 37\nGPU UUID: \t GPU-1234\nBus Location: \t "
        "0000:18:00.0\n"
    )
    assert parse_driver_information(text) == "NVIDIA H200"
    assert parse_driver_information("IRQ: 3\n") is None
    assert driver_gpus(str(tmp_path / "none")) is None
    gpu = tmp_path / "gpus" / "0000:18:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text(text)
    assert driver_gpus(str(tmp_path / "gpus")) == ("NVIDIA H200",)


SAVER = """
import sys
from cudampi.probe import capabilities as cap
folder, me, count, entry = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import json
for i in range(count):
    cap.save(folder, cap.Capabilities.from_json({**json.loads(entry), "host": f"{me}-{i}"}))
"""


def test_doctors_saving_at_once_keep_every_entry(tmp_path):
    """Six processes saving into one cache at once: each read-modify-write holds the cache's
    lock, so no entry is lost (without it 2 of 6 concurrent doctors lost one)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, str(tmp_path), f"p{p}", "15", json.dumps(entry())]
        )
        for p in range(6)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * 6
    saved = json.loads((tmp_path / "capabilities.json").read_text())
    hosts = {v["host"] for v in saved.values()}
    assert hosts == {f"p{p}-{i}" for p in range(6) for i in range(15)}, 90 - len(hosts)
    assert [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 200000, "its JSON nests too deeply"),
        (json.dumps(named(entry()))[:150], "is not valid JSON (truncated or corrupted?)"),
        ("[1, 2]", "holds a JSON list, not the object of entries cudampi writes"),
        ("\udcff\x00", "is not valid JSON"),
    ],
    ids=["nested", "truncated", "list", "binary"],
)
def test_a_corrupt_cache_file_is_named_with_the_fix_and_never_raises(tmp_path, text, words):
    (tmp_path / "capabilities.json").write_bytes(text.encode(errors="surrogateescape"))
    found = cap.lookup(tmp_path, LIB, ENV, host=HOST, gpus=lambda: H200)
    assert found.entry is None and found.ignored, found
    assert f"{tmp_path / 'capabilities.json'} " in found.note and words in found.note, found.note
    assert "`cudampi doctor` on this host replaces the file (or remove it)" in found.note
    # ... and the doctor's save replaces it with a good one
    caps = cap.Capabilities.from_json(entry())
    cap.save(tmp_path, caps)
    assert cap.lookup(tmp_path, LIB, ENV, host=HOST, gpus=lambda: H200).entry == caps


root_only = pytest.mark.skipif(
    os.geteuid() != 0, reason="files of another user are made with chown, which needs root"
)
OTHER_UID = 65534  # nobody


def _saved(folder: Path) -> cap.Capabilities:
    caps = cap.Capabilities.from_json(entry())
    folder.mkdir(exist_ok=True)
    (folder / "capabilities.json").write_text(json.dumps({**named(caps.to_json())}))
    return caps


@pytest.mark.parametrize(
    ("mode", "file_owner", "words"),
    [
        (0o777, None, "the cache folder {f} can be written by other users (mode 0777, no sticky"),
        (0o770, None, "the cache folder {f} can be written by other users (mode 0770, no sticky"),
        (0o700, OTHER_UID, "the cache file {f}/capabilities.json belongs to uid 65534"),
        (0o1777, OTHER_UID, "the cache file {f}/capabilities.json belongs to uid 65534"),
    ],
    ids=["world-writable", "group-writable", "file-of-another", "sticky-file-of-another"],
)
@root_only
def test_an_entry_others_could_have_written_is_not_believed(tmp_path, mode, file_owner, words):
    folder = tmp_path / "cache"
    _saved(folder)
    folder.chmod(mode)
    if file_owner is not None:
        os.chown(folder / "capabilities.json", file_owner, -1)
    found = cap.lookup(folder, LIB, ENV, host=HOST, gpus=lambda: H200)
    assert found.entry is None and found.ignored, found
    assert words.format(f=folder) in found.note, found.note
    assert "CUDAMPI_CACHE_DIR" in found.note
    with pytest.raises(cap.UnsafeCacheError, match="CUDAMPI_CACHE_DIR"):
        cap.save(folder, cap.Capabilities.from_json(entry()))


def test_a_sticky_shared_folder_with_a_file_of_ones_own_is_believed(tmp_path):
    folder = tmp_path / "cache"
    caps = _saved(folder)
    folder.chmod(0o1777)
    assert cap.lookup(folder, LIB, ENV, host=HOST, gpus=lambda: H200).entry == caps
    folder.chmod(0o700)
    (folder / "capabilities.json").chmod(0o666)  # but a file anyone may rewrite is not
    found = cap.lookup(folder, LIB, ENV, host=HOST, gpus=lambda: H200)
    assert found.entry is None and "can be written by other users (mode 0666)" in found.note


def test_a_cache_file_that_is_a_symlink_is_not_read(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _saved(elsewhere)
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "capabilities.json").symlink_to(elsewhere / "capabilities.json")
    found = cap.lookup(folder, LIB, ENV, host=HOST, gpus=lambda: H200)
    assert found.entry is None and "is a symlink, which cudampi never writes" in found.note


def test_a_cache_folder_linked_into_a_system_folder_is_refused(tmp_path):
    link = tmp_path / "cache"
    link.symlink_to("/etc")
    before = os.path.exists("/etc/capabilities.json")
    try:
        with pytest.raises(cap.UnsafeCacheError) as err:
            cap.save(link, cap.Capabilities.from_json(entry()))
        assert os.path.exists("/etc/capabilities.json") == before
    finally:
        if not before and os.path.exists("/etc/capabilities.json"):
            os.unlink("/etc/capabilities.json")  # what the doctor, as root, wrote there
    words = f"the cache folder {link} leads to the system folder /etc through a symlink"
    assert words in str(err.value)
    found = cap.lookup(link, LIB, ENV, host=HOST, gpus=lambda: H200)
    assert found.entry is None and "leads to the system folder /etc" in found.note
