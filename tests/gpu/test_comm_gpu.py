"""cudampi.comm on CUDA arrays (torch and CuPy), 2 ranks sharing one GPU, every path the stack
allows: staged always; gpu-ring where device p2p is proven (probe cache or CUDAMPI_CUDA_AWARE=yes);
native where MPI's device collectives are. Every check of a stack runs in one 2-rank job
(tests/gpu/jobs.py): the stack of this interpreter, and the system Open MPI (not CUDA-aware:
staged only) where CUDAMPI_TEST_SYSTEM_PYTHON names its interpreter. Run on the GPU machine:

    python -m pytest -m gpu tests/gpu/test_comm_gpu.py            # system MPI: staged only
    LD_PRELOAD=... OMPI_MCA_pml=ucx CUDAMPI_CUDA_AWARE=yes python -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.gpu.jobs import Check, params, system_stack_skip
from tests.mpi.test_comm_collectives import (
    Failures,
    check_ring_p2p,
    empty_lib,
    gen,
    run_async,
    run_matrix,
    to_lib,
)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

GPU_DTYPES = (
    "bool",
    "int8",
    "int32",
    "int64",
    "uint8",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
)
GPU_SIZES = (0, 1, 7, 1000, 100003)


def _libs() -> list[str]:
    libs = []
    if importlib.util.find_spec("torch"):
        libs.append("torch-cuda")
    if importlib.util.find_spec("cupy"):
        libs.append("cupy")
    return libs


def _setup(comm, lib):
    """Bind every rank to GPU 0 (one GPU shared) or to rank % device_count."""
    if lib == "torch-cuda":
        import torch

        torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    else:
        import cupy

        cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()


def _paths(c) -> list[str]:
    paths = ["staged"]
    if c.device_support.p2p:
        paths.append("gpu-ring")
    if c.device_support.collectives:
        paths.append("native")
    return paths


def rank_gpu_matrix(comm, lib):
    from cudampi.comm import Communicator
    from cudampi.config import Config

    _setup(comm, lib)
    f = Failures(comm.rank)
    cfg = Config.load({"chunk_bytes": "4K", "small_bytes": "1K"}, env=None, strict_env=False)
    with Communicator(comm, config=cfg) as c:
        paths = _paths(c)
        auto = c.path_for("allreduce", to_lib(gen(0, 4, "float32"), lib, "float32"))
        run_matrix(
            c,
            [lib],
            [*paths, "auto"],
            f,
            sizes=GPU_SIZES,
            dtypes=GPU_DTYPES,
            some=("float32", "float16", "int64", "bool"),
        )
        run_async(c, lib, paths, f)
        _p2p(c, lib, paths, f)
    # auto picks direct (all-pairs) exchanges on one node; the ring must work on devices too
    with Communicator(comm, config=cfg.replace(algorithm="ring")) as c:
        run_matrix(
            c,
            [lib],
            _paths(c),
            f,
            sizes=(7, 100003),
            dtypes=("float32", "bfloat16", "int64"),
            some=("float16",),
        )
    with Communicator(comm) as c:  # default chunking: large pipelined transfers
        run_matrix(
            c,
            [lib],
            _paths(c),
            f,
            sizes=(3 << 20,),
            dtypes=("float32", "float16"),
            some=("float32",),
        )
    f.finish()
    return f"paths {paths}, auto: {auto} ({auto.reason}); checked {f.checked} results"


def rank_gpu_semantics(comm, lib):
    """NaN in max/min and avg's overflow on device arrays, on every engine that runs here (the
    CPU test's :func:`~tests.mpi.test_comm_semantics.check_semantics`): NCCL's own max/min
    drop NaN (fmaxf), and a sum that overflows makes avg infinite."""
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.errors import CudampiError
    from tests.mpi.test_comm_collectives import lib_dtypes
    from tests.mpi.test_comm_semantics import check_semantics

    _setup(comm, lib)
    wrong: list[str] = []
    with Communicator(comm) as c:
        probe = to_lib(np.zeros(8), lib, "float32")
        runs, skipped = [], []
        for path in ("staged", "gpu-ring", "native", "ipc", "nccl"):
            try:
                why = c.refusal("allreduce", probe, "max", path=path) or ""
                if not why:  # an engine that cannot start here (nccl on a shared GPU) raises
                    c.allreduce(probe, "max", path=path)  # on every rank, and is passed over
                    c.synchronize()
            except CudampiError as exc:
                why = str(exc)
            every = [w for w in comm.allgather(why) if w]  # it runs where every rank runs it
            if every:
                skipped.append(f"{path}: {every[0]}")
            else:
                runs.append(path)
        dtypes = lib_dtypes(lib, ("float16", "bfloat16", "float32", "float64"))
        check_semantics(c, lib, runs, dtypes, wrong)
    assert not wrong, f"rank {comm.rank}: {len(wrong)} wrong:\n" + "\n".join(wrong[:30])
    return f"semantics ok on {runs}; not run here: {skipped}"


def _p2p(c, lib, paths, f: Failures) -> None:
    pairs = [(a, b) for a in paths for b in paths if a != "native" and b != "native"]
    for n in (0, 1, 1000, 1 << 20):
        for spath, rpath in pairs:
            check_ring_p2p(
                c, lib, f, n, "float32", spath, rpath, 1, f"p2p {lib} n={n} {spath}->{rpath}"
            )


def rank_gpu_streams(comm, lib):
    """Data produced on a busy side stream must be complete before MPI reads it."""
    import numpy as np

    from cudampi.comm import Communicator

    _setup(comm, lib)
    n = 1 << 22
    with Communicator(comm) as c:
        for path in _paths(c):
            if lib == "torch-cuda":
                import torch

                x = torch.zeros(n, device="cuda")
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
                    x.fill_(comm.rank + 1)
                    y = c.allreduce(x, path=path)
                    h = c.allreduce(x, path=path, async_op=True)
                got, got_async = y.cpu().numpy(), h.wait(timeout=120).cpu().numpy()
            else:
                import cupy

                x = cupy.zeros(n, dtype=cupy.float32)
                with cupy.cuda.Stream(non_blocking=True):
                    z = cupy.ones(n * 4, dtype=cupy.float32)
                    for _ in range(200):
                        z = cupy.sin(z)
                    x[...] = comm.rank + 1
                    y = c.allreduce(x, path=path)
                    h = c.allreduce(x, path=path, async_op=True)
                got, got_async = cupy.asnumpy(y), cupy.asnumpy(h.wait(timeout=120))
            want = float(sum(r + 1 for r in range(comm.size)))
            assert np.all(got == want), (path, got[:4], want)
            assert np.all(got_async == want), (path, got_async[:4], want)
        return f"streams ok on {_paths(c)}"


def rank_gpu_errors(comm, lib):
    """Wrong device / host path for a device array: an error on every rank, no hang. Where
    auto takes a stream-ordered engine (ipc) the others learn of rank 0's rejected call on the
    GPU, as of any failed call there: at their next call or synchronize(), and the
    communicator is unusable after it (a new one checks the sum)."""
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.paths import kinds
    from cudampi.errors import CommError, DeviceError

    _setup(comm, lib)
    c = Communicator(comm)
    x = to_lib(gen(comm.rank, 8, "float32"), lib, "float32")
    ordered = kinds()[c.path_for("allreduce", x).engine].stream_ordered
    try:
        c.allreduce(x, out=np.zeros(8, dtype=np.float32))  # refused on every rank alike
    except DeviceError as exc:
        assert "device" in str(exc).lower() or "host" in str(exc), exc
    else:
        raise AssertionError("no DeviceError")
    try:
        c.allreduce(x, path="host" if comm.rank == 0 else None)
        c.synchronize()
    except DeviceError as exc:  # rank 0's own; the others' through the host check
        assert comm.rank == 0 or not ordered, exc
        assert "device" in str(exc).lower() or "host" in str(exc), exc
    except CommError as exc:  # the others', from the GPU
        assert ordered and comm.rank != 0 and "rank 0 rejected its arguments" in str(exc), exc
    else:
        raise AssertionError("no error")
    if ordered:
        c.close()
        c = Communicator(comm)
    with c:
        if lib == "torch-cuda":
            import torch

            if torch.cuda.device_count() > 1:
                other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
                try:
                    c.allreduce(torch.ones(4, device=f"cuda:{other}"))
                except DeviceError as exc:
                    assert "cuda:" in str(exc), exc
                else:
                    raise AssertionError("no DeviceError for an array on another GPU")
        assert float(to_np_sum(c.allreduce(x))) == float(
            sum(gen(r, 8, "float32").sum() for r in range(comm.size))
        )
    return "errors ok"


def to_np_sum(x):
    from tests.mpi.test_comm_collectives import to_np

    return to_np(x).sum()


def rank_gpu_perf(comm, lib):
    """256 MB float32 allreduce and 256 MB p2p: gpu-ring vs staged (reported; gpu-ring must win)."""
    import time

    from cudampi.comm import Communicator

    _setup(comm, lib)
    n = 64 << 20  # 256 MB of float32
    with Communicator(comm) as c:
        x = to_lib(gen(comm.rank, 16, "float32"), lib, "float32")
        times = {}
        big = empty_lib((n,), lib, "float32")

        def timed(comm_, path):
            for i in range(7):
                if i == 2:
                    comm_.barrier()
                    t0 = time.perf_counter()
                comm_.allreduce(big, out=big, path=path)
            return (time.perf_counter() - t0) / 5

        for path in _paths(c):
            times[path] = timed(c, path)
        if "gpu-ring" in times:
            with Communicator(comm, config=c.config.replace(algorithm="ring")) as ring:
                times["gpu-ring (ring)"] = timed(ring, "gpu-ring")
        # p2p: one 256 MB message each way vs a device-to-device copy on this GPU
        y = empty_lib((n,), lib, "float32")
        p2p = {}
        for path in [p for p in _paths(c) if p != "native"]:
            for i in range(7):
                if i == 2:
                    c.barrier()
                    t0 = time.perf_counter()
                c.sendrecv(
                    big, (comm.rank + 1) % comm.size, y, (comm.rank - 1) % comm.size, path=path
                )
            p2p[path] = (time.perf_counter() - t0) / 5
        t0 = time.perf_counter()
        for _ in range(5):
            if lib == "torch-cuda":
                y.copy_(big)
                import torch

                torch.cuda.synchronize()
            else:
                y[...] = big
                import cupy

                cupy.cuda.runtime.deviceSynchronize()
        copy_t = (time.perf_counter() - t0) / 5
        lines = [f"allreduce 256MB {p}: {t * 1e3:.2f} ms, algbw {n * 4 / t / 1e9:.1f} GB/s"
                 for p, t in times.items()]  # fmt: skip
        lines += [f"sendrecv 256MB {p}: {t * 1e3:.2f} ms, {n * 4 / t / 1e9:.1f} GB/s"
                  for p, t in p2p.items()]  # fmt: skip
        lines.append(f"device copy 256MB: {copy_t * 1e3:.2f} ms, {n * 4 / copy_t / 1e9:.1f} GB/s")
        if "gpu-ring" in times:
            assert times["gpu-ring"] * 2 < times["staged"], times
        del x
    return "; ".join(lines)


def checks() -> list[Check]:
    """Every check of this file, in the order its jobs run them: each of the old tests per
    array library, on this interpreter's stack and (suffix ``-system``) on the system Open MPI."""
    libs = _libs()
    if not libs:
        return [
            Check("gpu_comm[none]", rank_gpu_matrix, skip="neither torch nor CuPy is installed")
        ]
    out = []
    for stack, tag, skip in (("this", "", None), ("system", "-system", system_stack_skip())):
        for name, func, timeout in (
            ("gpu_collectives_every_path_match_numpy", rank_gpu_matrix, 900),
            ("gpu_streams_are_synchronized_before_mpi", rank_gpu_streams, 300),
            ("gpu_bad_device_input_raises_on_every_rank", rank_gpu_errors, 300),
            ("gpu_ring_beats_staged", rank_gpu_perf, 600),
            ("gpu_nan_and_avg_mean_what_they_mean_on_the_cpu", rank_gpu_semantics, 600),
        ):
            out += [
                Check(f"{name}[{lib}{tag}]", func, (lib,), stack=stack, skip=skip, timeout=timeout)
                for lib in libs
            ]
    return out


@pytest.mark.parametrize("check", params(checks()))
def test_check(check, gpu_jobs):
    gpu_jobs.verify(check)
