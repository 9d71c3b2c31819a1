"""Where an ipc call's time goes, 2+ ranks on the GPU: whole calls (pipelined and synced), the
launch path alone, the raw kernel launch alone, GPU time per launch (events), and a cProfile of
the pipelined calls on rank 0. Run under `cudampi launch -n 2 tools/ipc-profile.py`."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import timing
import torch
from mpi4py import MPI

from cudampi.comm import Communicator
from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
from cudampi.comm.ipc.workspace import function, kernel

w = MPI.COMM_WORLD
torch.cuda.set_device(0)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
iters = 300
x = torch.ones(n, device="cuda")
y = torch.empty_like(x)


def per_call(fn, k=iters, sync_each=False):
    """Microseconds per call (tools/timing.py), after a torch.cuda.synchronize()."""
    return 1e6 * timing.per_call(w, fn, k, torch.cuda.synchronize, 20, each=sync_each)


with Communicator(w, path="ipc") as c:
    call = lambda: c.allreduce(x, out=y)  # noqa: E731
    pipelined = per_call(call)
    synced = per_call(call, sync_each=True)
    eng = next(e for e in c._engines.stream_ordered())
    ws = eng.ws
    launches = plan.reduction(eng.geo, "allreduce", n, 4, x.data_ptr(), y.data_ptr(), (12, 1))
    name = {"reduce": L.reduce_name("float32", "sum", ws.size)}
    name["twoshot"] = L.twoshot_name("float32", "sum", ws.size)
    kind = launches[0].kernel  # one-shot: reduce; two-shot: twoshot
    stream = torch.cuda.current_stream().cuda_stream
    launch_only = per_call(lambda: ws.launch(launches, name, stream))
    fn = kernel(0, name[kind])
    cs = ws.stream(stream)
    arg = (launches[0].params.view(plan.PARAM_DTYPE),)
    raw = per_call(lambda: fn((ws.blocks,), (L.NTHREADS,), arg, stream=cs))
    ws.launches += 20 + iters  # the raw launches above advanced the kernels' counters
    import cupy

    f, argv = function(0, name[kind]), launches[0].argv_ptr
    go = cupy.cuda.driver.launchKernel
    driver = per_call(lambda: go(f, ws.blocks, 1, 1, L.NTHREADS, 1, 1, 0, stream, argv, 0))
    ws.launches += 20 + iters
    engine_only = per_call(lambda: eng.allreduce(x, y, "sum", "float32"))
    registered = per_call(lambda: eng._registered(x.data_ptr(), y.data_ptr()))
    real = eng.allreduce
    eng.allreduce = lambda *a, **k: None  # every rank: the Communicator's front end alone
    front = per_call(call)  # repeated on the same tensors: cudampi.comm.repeat's short path
    c._repeat = lambda *a: False  # the full path on every call (a call whose tensors changed)
    front_full = per_call(call)
    del c._repeat
    eng.allreduce = real
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    w.Barrier()
    e0.record()
    for _ in range(100):
        ws.launch(launches, name, stream)
    e1.record()
    torch.cuda.synchronize()
    gpu = e0.elapsed_time(e1) * 1000 / 100
    from cudampi.comm.arrays import adapt
    from cudampi.comm.engines.base import caller_stream

    def observed():
        with c._observer.call("allreduce", 4 * n, "float32", "ipc", "why"):
            pass

    pieces = {
        "adapt(x)": per_call(lambda: adapt(x)),
        "caller_stream": per_call(lambda: caller_stream(eng.ops)),
        "observer": per_call(observed),
        "ws.check": per_call(ws.check),
    }
    prof = cProfile.Profile()
    w.Barrier()
    prof.enable()
    for _ in range(200):
        call()
    prof.disable()
    torch.cuda.synchronize()
    c.synchronize()
    if w.rank == 0:
        print(
            f"n={n} blocks={ws.blocks} us/call: pipelined {pipelined:.1f}, synced {synced:.1f}, "
            f"launch path {launch_only:.1f}, CuPy kernel call {raw:.1f}, driver launch {driver:.1f}, "
            f"GPU per launch {gpu:.1f}, engine.allreduce {engine_only:.1f}, registration "
            f"lookup {registered:.1f} (registered calls {eng.registered_calls}), front end alone "
            f"{front:.1f} (full path {front_full:.1f})"
        )
        print("pieces us/call: " + ", ".join(f"{k} {v:.1f}" for k, v in pieces.items()))
        for key, k in (("tottime", 22), ("cumulative", 30)):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(k)
            print("\n".join(s.getvalue().splitlines()[: k + 12]))

# The torch backend on the same tensor: what dist.all_reduce adds over the Communicator's call
# (torch's dispatch to a Python process group, the Work and its CUDA event).
import torch.distributed as dist  # noqa: E402

import cudampi.torch  # noqa: E402,F401
from cudampi.torch.work import record_done  # noqa: E402

dist.init_process_group("cudampi")
torch_call = per_call(lambda: dist.all_reduce(x))
event = per_call(lambda: record_done(x.device))
pg = dist.distributed_c10d._get_default_group()._get_backend(x.device)
from cudampi.torch.work import finished_work  # noqa: E402

torch_pieces = {
    "pg.allreduce": per_call(lambda: pg.allreduce([x])),
    "finished_work": per_call(lambda: finished_work([x])),
    "capturing?": per_call(torch.cuda.is_current_stream_capturing),
    "Work.wait": per_call(lambda: finished_work([x]).wait()),
}
tprof = cProfile.Profile()
w.Barrier()
tprof.enable()
for _ in range(200):
    dist.all_reduce(x)
tprof.disable()
torch.cuda.synchronize()
if w.rank == 0:
    print(f"torch backend us/call: dist.all_reduce {torch_call:.1f}, record_done alone {event:.1f}")
    print("torch pieces us/call: " + ", ".join(f"{k} {v:.1f}" for k, v in torch_pieces.items()))
    s = io.StringIO()
    pstats.Stats(tprof, stream=s).sort_stats("tottime").print_stats(25)
    print("\n".join(s.getvalue().splitlines()[:37]))
dist.destroy_process_group()
