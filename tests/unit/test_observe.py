"""Logs, profiler ranges and the timeline of communication calls (cudampi.observe), pure: no
MPI. The real runs are in tests/mpi/test_observe_real.py."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest

from cudampi.config import Config
from cudampi.observe import (
    LOGGER,
    Observer,
    TraceRecorder,
    human_bytes,
    merge_traces,
    rank_logger,
)


@pytest.fixture(autouse=True)
def fresh_logger():
    logger = logging.getLogger(LOGGER)
    saved = (list(logger.handlers), logger.level, logger.propagate)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    yield
    for h in list(logger.handlers):
        logger.removeHandler(h)
    for h in saved[0]:
        logger.addHandler(h)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def cfg(**kw):
    return Config.load(kw, env={})


def test_nothing_on_is_a_null_context():
    obs = Observer(cfg(), 0, 1)
    assert isinstance(obs.call("allreduce", 8, "float32", "host", "why"), contextlib.nullcontext)


class FakeNvtx:
    """Stands for torch.cuda.nvtx, which needs an initialized CUDA (no GPU here)."""

    def __init__(self):
        self.ranges = []
        self.depth = 0

    def range_push(self, name):
        self.ranges.append(name)
        self.depth += 1

    def range_pop(self):
        self.depth -= 1


@pytest.mark.parametrize("tool", ["", "/opt/nsys/libToolsInjection64.so"])
def test_nvtx_ranges_only_under_a_tool_that_records_them(monkeypatch, tool):
    import cudampi.observe as observe

    fake = FakeNvtx()
    monkeypatch.setattr(observe, "_torch_nvtx", lambda: fake)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", tool)
    obs = Observer(cfg(), 0, 1)
    ctx = obs.call("allreduce", 4096, "float32", "ipc", "why")
    with ctx:
        assert fake.depth == (1 if tool else 0)
    if tool:
        assert fake.ranges == ["cudampi.allreduce 4 KiB float32 ipc"] and fake.depth == 0
    else:  # no tool: the call costs a null context, not a range nobody records
        assert isinstance(ctx, contextlib.nullcontext) and fake.ranges == []


def test_info_logs_each_new_op_size_dtype_once_with_the_path_and_why(capsys):
    obs = Observer(cfg(log="info"), 0, 2)
    for _ in range(3):
        with obs.call("allreduce", 4 << 20, "float32", "gpu-ring", "device memory; p2p proven"):
            pass
    with obs.call("allreduce", 8, "float32", "host", "host memory"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("[cudampi ") and " rank 0/1] INFO " in lines[0]
    assert lines[0].endswith("allreduce 4 MiB float32: path gpu-ring (device memory; p2p proven)")
    assert lines[1].endswith("allreduce 8 B float32: path host (host memory)")


def test_debug_logs_every_call_with_its_time(capsys):
    obs = Observer(cfg(log="debug"), 0, 2)
    for _ in range(3):
        with obs.call("broadcast", 1024, "int64", "mpi", "host memory"):
            pass
    err = capsys.readouterr().err
    assert err.count("DEBUG broadcast 1 KiB int64 mpi ") == 3 and err.count(" us\n") == 3


def test_only_rank_0_logs_unless_every_rank_is_asked():
    quiet = rank_logger(cfg(log="info"), 1, 2)
    assert not quiet.isEnabledFor(logging.INFO)
    loud = rank_logger(cfg(log="info", log_ranks="all"), 1, 2)
    assert loud.isEnabledFor(logging.INFO)
    assert "rank 1/2" in loud.handlers[0].formatter._fmt


def test_a_program_that_set_up_the_logger_keeps_its_handlers():
    mine = logging.StreamHandler()
    logging.getLogger(LOGGER).addHandler(mine)
    logger = rank_logger(cfg(log="debug"), 0, 1)
    assert logger.handlers == [mine]


def test_timeline_events_and_the_merge(tmp_path):
    for rank in (1, 0):
        obs = Observer(cfg(trace=str(tmp_path)), rank, 2)
        obs.trace = TraceRecorder(str(tmp_path), rank, "h")  # two ranks of one job, here
        with obs.call("allreduce", 64, "float32", "host", "host memory"):
            pass
        with obs.call("barrier", 0, "none", "mpi", ""):
            pass
        obs.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["cudampi-trace-rank0.json", "cudampi-trace-rank1.json"]
    doc = merge_traces(tmp_path)
    calls = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(calls) == 4 and {e["pid"] for e in calls} == {0, 1}
    assert calls == sorted(calls, key=lambda e: e["ts"])
    first = next(e for e in calls if e["name"].startswith("cudampi.allreduce"))
    assert first["name"] == "cudampi.allreduce 64 B float32 host" and first["dur"] >= 0
    assert first["args"] == {
        "op": "allreduce",
        "bytes": 64,
        "dtype": "float32",
        "path": "host",
        "why": "host memory",
    }
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert names[0].startswith("rank ") and len(names) == 2
    json.dumps(doc)  # one JSON document chrome://tracing reads


def test_recorder_survives_an_unwritable_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rec = TraceRecorder(str(blocker / "sub"), 0, "h")
    assert rec.write() is None


def test_inside_a_torch_profiler_each_call_is_a_range():
    torch = pytest.importorskip("torch")
    obs = Observer(cfg(), 0, 1)
    # (the profiler is entered before obs.call() looks for it)
    with torch.profiler.profile() as prof, obs.call("allgather", 256, "float32", "staged", "why"):
        pass
    assert "cudampi.allgather 256 B float32 staged" in [e.name for e in prof.events()]


def test_human_bytes():
    assert (human_bytes(4 << 20), human_bytes(1000), human_bytes(3 << 30)) == (
        "4 MiB",
        "1000 B",
        "3 GiB",
    )


def test_every_communicator_of_a_rank_shares_one_file(tmp_path):
    a = Observer(cfg(trace=str(tmp_path)), 0, 2)
    b = Observer(cfg(trace=str(tmp_path / ".")), 0, 4)
    assert a.trace is b.trace
