"""Path choice from probed capabilities, config overrides and message size (pure logic)."""

from __future__ import annotations

import pytest

from cudampi.comm.paths import choose, device_support
from cudampi.config import Config
from cudampi.errors import ConfigError, DeviceError
from cudampi.probe.capabilities import Capabilities, ProbeOutcome

# What the reference H200 stack showed (tests/fixtures/device-h200-1gpu/probe.log): PyPI Open MPI
# + libucx-cu13 + pml ucx moves device memory point-to-point, but its device Allreduce segfaults.
H200_UCX = Capabilities(
    key="k",
    mpi_library="Open MPI v5.0.11",
    device_p2p=ProbeOutcome("ok", "268 MB correct", gbps=891.78),
    device_allreduce=ProbeOutcome("crash", "SIGSEGV in coll"),
)
# System Open MPI 4.1.6: device Send and Allreduce both segfault.
H200_SYSTEM = Capabilities(
    key="k",
    mpi_library="Open MPI v4.1.6",
    device_p2p=ProbeOutcome("crash", "SIGSEGV in btl vader"),
    device_allreduce=ProbeOutcome("crash", "SIGSEGV in coll base"),
)
NATIVE_OK = Capabilities(
    key="k", mpi_library="x", device_p2p=ProbeOutcome("crash"), device_allreduce=ProbeOutcome("ok")
)


def cfg(**kw):
    return Config.load(kw, env={})


def pick(call, requested, on_device, caps, dtype="float32", nbytes=1 << 20, **conf):
    from cudampi.comm.engines.mpi import can_reduce

    return choose(
        call,
        requested,
        on_device,
        dtype,
        nbytes,
        device_support(cfg(**conf), caps),
        mpi_reduces=can_reduce(dtype),
    )


def test_host_arrays_take_mpi_and_fall_back_to_our_reduction_for_half_types():
    c = pick("allreduce", "auto", False, None)
    assert c == "host" and c.engine == "mpi" and "MPI's own" in c.reason
    for dt in ("float16", "bfloat16"):
        c = pick("allreduce", "auto", False, None, dtype=dt)
        assert c == "host" and c.engine == "alg" and dt in c.reason
        assert c.label == "host-alg"
    # half types move fine through MPI when nothing is reduced
    assert pick("broadcast", "auto", False, None, dtype="float16").engine == "mpi"


def test_every_explicit_path_runs_on_host_arrays():
    assert pick("allreduce", "gpu-ring", False, None).engine == "alg"
    c = pick("allreduce", "staged", False, None)
    assert (c, c.engine, c.inner) == ("staged", "staged", "mpi")
    assert pick("allreduce", "staged", False, None, dtype="bfloat16").inner == "alg"
    assert pick("allreduce", "native", False, None).engine == "mpi"


def test_device_arrays_with_no_probe_are_staged_and_never_reach_mpi():
    c = pick("allreduce", "auto", True, None)
    assert c == "staged" and "cudampi doctor" in c.reason
    with pytest.raises(DeviceError, match=r"gpu-ring.*not proven.*cudampi doctor"):
        pick("allreduce", "gpu-ring", True, None)
    with pytest.raises(DeviceError, match="segfaults"):
        pick("allreduce", "native", True, None)
    with pytest.raises(DeviceError, match="host arrays"):
        pick("allreduce", "host", True, None)


def test_h200_ucx_stack_takes_gpu_ring_but_never_native():
    c = pick("allreduce", "auto", True, H200_UCX)
    assert c == "gpu-ring" and c.engine == "alg" and "proved" in c.reason
    with pytest.raises(DeviceError, match="crash"):
        pick("allreduce", "native", True, H200_UCX)
    assert pick("send", "auto", True, H200_UCX) == "gpu-ring"


def test_system_openmpi_stack_is_staged():
    assert pick("allreduce", "auto", True, H200_SYSTEM) == "staged"
    assert pick("send", "auto", True, H200_SYSTEM) == "staged"
    with pytest.raises(DeviceError):
        pick("send", "gpu-ring", True, H200_SYSTEM)


def test_config_overrides_the_probe():
    assert pick("allreduce", "auto", True, None, cuda_aware="yes") == "gpu-ring"
    assert pick("allreduce", "auto", True, H200_UCX, cuda_aware="no") == "staged"
    c = pick("allreduce", "auto", True, None, native_collectives="yes")
    assert c == "native" and c.engine == "mpi"
    assert pick("allreduce", "auto", True, NATIVE_OK) == "native"
    assert pick("allreduce", "auto", True, NATIVE_OK, native_collectives="no") == "staged"


def test_native_device_half_types_fall_back_safely():
    c = pick("allreduce", "native", True, NATIVE_OK, dtype="float16")
    assert c == "staged" and c.inner == "alg"
    c = pick(
        "allreduce",
        "native",
        True,
        None,
        dtype="bfloat16",
        cuda_aware="yes",
        native_collectives="yes",
    )
    assert c == "native" and c.engine == "alg"
    # auto on a native-only stack: half-type reductions are staged, not given to MPI
    assert pick("allreduce", "auto", True, NATIVE_OK, dtype="bfloat16") == "staged"


def test_p2p_paths():
    assert pick("send", "auto", False, None) == "host"
    assert pick("send", "staged", False, None).engine == "staged"
    assert pick("recv", "auto", True, None).engine == "staged"


def test_bad_path_names_are_config_errors():
    from cudampi.comm.paths import check_path

    with pytest.raises(ConfigError, match="'ring'"):
        check_path("ring", "path")
    assert check_path(None, "path") is None


def test_auto_takes_ipc_only_where_the_probe_proved_it_and_it_wins():
    from dataclasses import replace

    from cudampi.comm.engines.ipc import ipc_support
    from cudampi.comm.paths import DeviceSupport, Verdict, choose
    from cudampi.probe.capabilities import ProbeOutcome

    ok = ProbeOutcome("ok", "correct", 300.0)
    assert ipc_support(ok, False, False, None, latency_us=20)[0]  # one GPU per rank
    assert ipc_support(ok, True, True, None)[0]  # shared GPU under MPS
    yes, why = ipc_support(ok, True, False, None)  # shared GPU, time-slicing
    assert not yes and "MPS" in why
    assert not ipc_support(ok, False, False, "CuPy is not installed")[0]
    assert not ipc_support(None, False, True, None)[0]
    assert not ipc_support(ProbeOutcome("crash", "segfault"), False, True, None)[0]
    # the probe's latency is of the MPS setting it ran in: say so where that differs from now
    _, why = ipc_support(ok, True, True, None, latency_us=2262, probed_mps=False)
    assert why.endswith(
        "(ranks sharing a GPU under MPS, 2262 us at 4 KiB when probed with MPS off)"
    )
    _, why = ipc_support(ok, True, True, None, latency_us=20, probed_mps=True)
    assert why.endswith("(ranks sharing a GPU under MPS, 20 us at 4 KiB)")
    base = DeviceSupport(True, "p2p proven", False, "no")
    assert choose("allreduce", "auto", True, "float32", 4096, base, mpi_reduces=True) == "gpu-ring"
    on = replace(base, verdicts={"ipc": Verdict(True, "the probe proved the ipc engine correct")})
    got = choose("allreduce", "auto", True, "float32", 4096, on, mpi_reduces=True)
    assert got == "ipc" and got.engine == "ipc" and got.inner == "alg"
    assert choose("allreduce", "auto", False, "float32", 4096, on, mpi_reduces=True) == "host"
    assert choose("send", "auto", True, "float32", 4096, on, mpi_reduces=True).engine == "mpi"


def test_point_to_point_takes_the_ipc_kernels_only_when_asked_for():
    """auto keeps MPI for messages (any source, a host buffer on the other side, tags out of
    order all need MPI's matching, which one rank cannot know its peer relies on); path='ipc'
    runs them as ipc kernels on device arrays; nccl moves collectives only."""
    from dataclasses import replace

    from cudampi.comm.paths import DeviceSupport, Verdict, choose

    on = replace(
        DeviceSupport(True, "p2p proven", False, "no"), verdicts={"ipc": Verdict(True, "proven")}
    )
    for call in ("send", "recv", "isend", "irecv", "sendrecv"):
        auto = choose(call, "auto", True, "float32", 4096, on, mpi_reduces=True)
        assert (str(auto), auto.engine) == ("gpu-ring", "mpi"), call
        asked = choose(call, "ipc", True, "float32", 4096, on, mpi_reduces=True)
        assert (str(asked), asked.engine, asked.inner) == ("ipc", "ipc", "alg"), call
        assert "the peer must use path='ipc' too" in asked.reason
        host = choose(call, "ipc", False, "float32", 4096, on, mpi_reduces=True)
        assert (str(host), host.engine) == ("host", "mpi"), call
        assert choose(call, "nccl", True, "float32", 4096, on, mpi_reduces=True).engine == "mpi"
    unproven = DeviceSupport(False, "not proven", False, "no")
    asked = choose("send", "ipc", True, "float32", 4096, unproven, mpi_reduces=True)
    assert asked.engine == "ipc" and asked.inner == "staged"  # across nodes: staged between


def test_auto_stages_small_device_calls_where_ranks_time_slice_one_gpu(monkeypatch):
    from dataclasses import replace

    import cudampi.probe.gpu
    from cudampi.comm.engines.staged import SHARED_GPU_STAGED_BELOW, staged_below
    from cudampi.comm.paths import DeviceSupport

    assert staged_below(True, False) == SHARED_GPU_STAGED_BELOW  # shared GPU, no MPS
    assert staged_below(True, True) == 0 and staged_below(False, False) == 0
    assert staged_below(None, False) == 0  # not probed: no claim
    base = DeviceSupport(True, "p2p proven", False, "no")
    monkeypatch.setattr(cudampi.probe.gpu, "mps_active", lambda env=None: False)
    sliced = device_support(cfg(), replace(H200_UCX, ipc_shared_gpu=True))
    assert sliced.p2p and sliced.verdict("staged").span == (0, SHARED_GPU_STAGED_BELOW)
    for n in (8, 4096, 2 << 20):
        got = choose("allreduce", "auto", True, "float32", n, sliced, mpi_reduces=True)
        assert got == "staged" and "time-slicing" in got.reason, n
        assert choose("allreduce", "auto", True, "float32", n, base, mpi_reduces=True) == "gpu-ring"
    big = choose("allreduce", "auto", True, "float32", 16 << 20, sliced, mpi_reduces=True)
    assert big == "gpu-ring"
    # asked for by name, gpu-ring stays gpu-ring
    forced = choose("allreduce", "gpu-ring", True, "float32", 4096, sliced, mpi_reduces=True)
    assert forced == "gpu-ring"


def test_auto_without_a_probe_result_says_so_once_for_device_arrays(monkeypatch):
    """On a fresh machine (no `cudampi doctor` yet) auto can take neither ipc nor gpu-ring:
    DDP ResNet-50 on one H200 fell from 0.93x to 0.82x of local, silently, before this note."""
    from dataclasses import replace

    import cudampi.comm.engines.ipc as ipc_engine
    from cudampi.comm.paths import unprobed_note

    monkeypatch.setattr(ipc_engine, "available", lambda: None)  # CuPy importable
    fresh = device_support(cfg(), None)
    assert fresh.unprobed and not fresh.verdict("ipc").ok and not fresh.p2p
    staged = choose("allreduce", "auto", True, "float32", 1 << 20, fresh, mpi_reduces=True)
    note = unprobed_note(staged, "auto", True, fresh)
    assert "path 'staged'" in note and "no valid probe result" in note
    assert "cudampi doctor" in note and "CUDAMPI_PATH" in note
    # nothing to say: host arrays, a path asked for by name, or the ipc engine taken anyway
    assert unprobed_note(staged, "staged", True, fresh) == ""
    assert unprobed_note(staged, "auto", False, fresh) == ""
    taken = choose("allreduce", "ipc", True, "float32", 64, fresh, mpi_reduces=True)
    assert unprobed_note(taken, "auto", True, fresh) == ""
    # a probe entry from before the ipc engine's probe (CuPy installed since): still unprobed
    old = device_support(cfg(), H200_UCX)
    assert old.p2p and "no result for the ipc engine" in old.unprobed
    ring = choose("allreduce", "auto", True, "float32", 1 << 20, old, mpi_reduces=True)
    assert "path 'gpu-ring'" in unprobed_note(ring, "auto", True, old)
    # ... but not where CuPy is missing (a probe would not change that), nor once probed
    monkeypatch.setattr(ipc_engine, "available", lambda: "CuPy is not installed")
    assert device_support(cfg(), H200_UCX).unprobed == ""
    monkeypatch.setattr(ipc_engine, "available", lambda: None)
    probed = replace(H200_UCX, device_ipc=ProbeOutcome("ok", "correct", 300.0))
    assert device_support(cfg(), probed).unprobed == ""
    assert unprobed_note(ring, "auto", True, device_support(cfg(), probed)) == ""


def test_nccl_span_is_where_nccl_takes_less_time_than_ipc():
    from cudampi.comm.engines.nccl_support import nccl_span
    from cudampi.comm.paths import NO_LIMIT

    # t(n) = latency + n / bandwidth: 20 us + n / 300 GB/s against 30 us + n / 600 GB/s cross at
    # 6 MB (both 40 us there); above it nccl's bandwidth wins
    assert nccl_span(20, 300, 30, 600) == (6_000_000, NO_LIMIT)
    assert nccl_span(20, 600, 10, 300) == (0, 6_000_000)  # nccl's latency wins below
    assert nccl_span(20, 300, 10, 600) == (0, NO_LIMIT)  # nccl better at both: every size
    assert nccl_span(20, 600, 30, 300) == (0, 0)  # ipc better at both: never
    assert nccl_span(20, 300, 10, 300) == (0, NO_LIMIT)  # same bandwidth: the latency decides
    assert nccl_span(None, None, 30, 600) == (0, NO_LIMIT)  # ipc not measured: nccl everywhere
    assert nccl_span(20, 300, None, 600) == (0, 0)  # nccl not measured: never


def test_auto_takes_nccl_for_the_sizes_the_probe_measured_it_faster():
    from dataclasses import replace

    from cudampi.comm.engines.nccl_support import nccl_support
    from cudampi.comm.paths import NO_LIMIT, Verdict

    ipc_ok = ProbeOutcome("ok", "correct", gbps=300.0)
    caps = replace(
        H200_UCX,
        device_ipc=ipc_ok,
        ipc_latency_us=20.0,
        device_nccl=ProbeOutcome("ok", "correct", gbps=600.0),
        nccl_latency_us=30.0,
    )
    taken, why, span = nccl_support(caps, True, None)
    assert taken and span == (6_000_000, NO_LIMIT) and "from 6000000 bytes up" in why
    assert nccl_support(caps, False, None)[:2] == (
        True,
        "the probe proved the nccl engine correct (auto does not take ipc here)",
    )
    assert nccl_support(caps, False, None)[2] == (0, NO_LIMIT)
    gone = nccl_support(caps, True, "CuPy finds no NCCL library")
    assert not gone[0] and "unavailable: CuPy finds no NCCL" in gone[1]
    assert (
        "not probed here (needs a GPU per rank)"
        in nccl_support(
            replace(caps, device_nccl=ProbeOutcome("skipped", "needs a GPU per rank")), True, None
        )[1]
    )
    crashed = nccl_support(replace(caps, device_nccl=ProbeOutcome("crash", "SIGSEGV")), True, None)
    assert not crashed[0] and "crash: SIGSEGV" in crashed[1]
    assert "measured no latency" in nccl_support(replace(caps, nccl_latency_us=None), True, None)[1]
    slower = replace(caps, nccl_latency_us=40.0, device_nccl=ProbeOutcome("ok", "", gbps=200.0))
    assert nccl_support(slower, True, None) == (
        False,
        "the probe found ipc faster than nccl at every size",
        (0, 0),
    )
    # the choice: nccl inside the span for even reductions and broadcasts of NCCL's float types
    s = replace(
        device_support(cfg(), caps),
        verdicts={"ipc": Verdict(True, "ipc proven"), "nccl": Verdict(True, why, span)},
        p2p=True,
    )
    big, small = 64 << 20, 1 << 20
    for call in ("allreduce", "reduce", "broadcast", "reduce_scatter"):
        got = choose(call, "auto", True, "bfloat16", big, s, mpi_reduces=True)
        assert got == "nccl" and got.engine == "nccl" and "faster than ipc" in got.reason, call
    assert choose("allreduce", "auto", True, "float32", small, s, mpi_reduces=True) == "ipc"
    assert choose("allgather", "auto", True, "float32", big, s, mpi_reduces=True) == "ipc"
    assert choose("allreduce", "auto", True, "int32", big, s, mpi_reduces=True) == "ipc"
    assert choose("allreduce", "auto", False, "float32", big, s, mpi_reduces=True) == "host"
    assert choose("allreduce", "ipc", True, "float32", big, s, mpi_reduces=True) == "ipc"
    assert choose("allreduce", "gpu-ring", True, "float32", big, s, mpi_reduces=True) == "gpu-ring"
    # a host whose probe did not prove nccl: auto never takes it
    unproven = device_support(cfg(), replace(caps, device_nccl=ProbeOutcome("skipped")))
    assert not unproven.verdict("nccl").ok
