"""The backend's Work objects without MPI: finished (default mode), stream-ordered, async.

What a CUDA Work does with its event is checked here with stand-ins for the event and the
streams (no GPU on the CI machine): ``wait()`` orders the caller's stream after the event only
when it is another stream, never blocks the host, ``is_completed()`` queries the event (and says
False during CUDA graph capture, where a query is illegal). The real thing runs in
tests/gpu/test_torch_gpu.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")


class FakeEvent:
    def __init__(self, done=False):
        self.done = done
        self.queries = 0

    def query(self):
        self.queries += 1
        return self.done

    def synchronize(self):  # a host sync: the stream-ordered Work must never call it
        raise AssertionError("the Work blocked the host")


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited = []

    def wait_event(self, ev):
        self.waited.append(ev)

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """torch.cuda's current stream and capture state, as the Work reads them."""
    state = {"current": FakeStream("caller"), "capturing": False}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    return state


def _stream_work(result, done):
    from cudampi.torch.work import _stream_work_class, completed_future

    return _stream_work_class()(["cuda:0"], completed_future(result), result, done)


def test_host_tensors_get_a_completed_work_with_a_typed_future():
    from cudampi.torch.work import finished_work

    t = torch.ones(3)
    work = finished_work([t])
    assert work.is_completed() and work.wait()
    got = work.get_future().wait()
    assert isinstance(got, list) and got[0] is t


def test_wait_on_the_launch_stream_is_a_no_op(cuda_stand_in):
    ev = FakeEvent()
    launch = cuda_stand_in["current"]
    work = _stream_work([torch.ones(2)], (ev, launch))
    assert work.wait() is True
    assert launch.waited == [], "the same stream already runs in order"
    assert ev.queries == 0


def test_wait_on_another_stream_waits_on_the_event_without_host_sync(cuda_stand_in):
    ev = FakeEvent()
    launch = FakeStream("launch")
    work = _stream_work([torch.ones(2)], (ev, launch))
    other = cuda_stand_in["current"]
    assert work.wait() is True
    assert other.waited == [ev] and launch.waited == []
    work.synchronize()  # torch's name for the same thing
    assert other.waited == [ev, ev]


def test_is_completed_queries_the_event_and_is_false_during_capture(cuda_stand_in):
    ev = FakeEvent(done=False)
    work = _stream_work([torch.ones(2)], (ev, FakeStream("launch")))
    assert not work.is_completed()
    ev.done = True
    assert work.is_completed() and work.is_success()
    before = ev.queries
    cuda_stand_in["capturing"] = True
    assert not work.is_completed()
    assert ev.queries == before, "no query while a graph is being captured"


def test_future_of_a_stream_ordered_work_is_typed_and_done():
    """DDP's built-in C++ hooks assert isTensorList() on it; Python hooks chain .then."""
    ev = FakeEvent()
    t = torch.full((2,), 3.0)
    work = _stream_work([t], (ev, FakeStream("launch")))
    fut = work.get_future()
    assert fut.done()
    assert torch.equal(fut.then(lambda f: f.value()[0] * 2).wait(), torch.full((2,), 6.0))


def test_async_runner_completes_in_order_and_reraises_the_op_error():
    from cudampi.errors import MismatchError
    from cudampi.torch.work import AsyncRunner

    runner = AsyncRunner("test-runner")
    seen = []
    try:
        first = runner.submit(lambda: seen.append(1) or [torch.ones(1)], [torch.ones(1)])
        second = runner.submit(lambda: (_ for _ in ()).throw(MismatchError("ranks differ")), [])
        third = runner.submit(lambda: seen.append(3) or [], [])
        assert first.wait() and torch.equal(first.get_future().wait()[0], torch.ones(1))
        with pytest.raises(MismatchError, match="ranks differ"):
            second.wait()
        assert not second.is_success() and isinstance(second.exception(), MismatchError)
        assert third.wait() and seen == [1, 3]
        assert first.is_completed() and third.is_completed()
    finally:
        runner.close()


def test_async_runner_is_busy_until_every_submitted_op_has_run():
    """What auto mode's call order rests on: busy() while an op waits or runs, not after."""
    import threading
    import time

    from cudampi.torch.work import AsyncRunner

    runner = AsyncRunner("test-busy")
    go = threading.Event()
    try:
        assert not runner.busy()
        first = runner.submit(lambda: go.wait(10) and [], [])
        second = runner.submit(list, [])
        assert runner.busy() and not first.is_completed()
        go.set()
        assert first.wait() and second.wait()
        deadline = time.monotonic() + 10
        while runner.busy() and time.monotonic() < deadline:
            time.sleep(0.001)  # the thread marks an op done just after completing its Work
        assert not runner.busy()
    finally:
        go.set()
        runner.close()


def _group_stand_in(choice, runner=None, auto=False):
    from types import SimpleNamespace

    class Comm:
        asks = 0

        def path_for(self, op, x, nbytes=None):
            self.asked = op
            self.asks += 1
            return choice

    return SimpleNamespace(_runner=runner, _auto=auto, _comm=Comm(), _rank=0, _size=2)


class _Runner:
    def __init__(self, busy=False):
        self.is_busy = busy

    def busy(self):
        return self.is_busy


def test_auto_runs_host_synchronizing_cuda_calls_on_the_thread(monkeypatch):
    """Options(async_ops=None): a CUDA call whose path synchronizes the host goes to the
    group's thread, a stream-ordered one and a host call stay in the caller's thread, unless
    a call is still on the thread (call order); the Communicator's choice decides (it keeps
    one per call shape)."""
    from cudampi.comm.paths import PathChoice
    from cudampi.torch import backend, dispatch

    t = torch.ones(2)
    cuda: list = [t]
    monkeypatch.setattr(dispatch, "first_cuda", lambda args: cuda[0])
    threaded = backend.CudampiProcessGroup._threaded
    staged = _group_stand_in(PathChoice("staged", "", "staged"), _Runner(), auto=True)
    assert threaded(staged, "allreduce", ([t],))
    assert threaded(staged, "allreduce", ([t],))
    assert threaded(staged, "all_gather_single", ([t], [t])) and staged._comm.asked == "allgather"
    ipc = _group_stand_in(PathChoice("ipc", "", "ipc", stream_ordered=True), _Runner(), auto=True)
    assert not threaded(ipc, "allreduce", ([t],))
    ipc._runner.is_busy = True
    assert threaded(ipc, "allreduce", ([t],)), "an inline call must not overtake the thread"
    cuda[0] = None  # host tensors
    assert not threaded(staged, "allreduce", ([t],))
    forced = _group_stand_in(
        PathChoice("ipc", "", "ipc", stream_ordered=True), _Runner(), auto=False
    )
    assert threaded(forced, "allreduce", ([t],)), "async_ops=True: every call on the thread"


def test_auto_runs_a_call_its_caller_waits_for_in_the_callers_thread(monkeypatch):
    """dist.all_reduce(t) without async_op waits for its Work at once (c10d's asyncOp False):
    under auto such a call runs in the caller's thread even where its path synchronizes the
    host (the thread would only add its hand-over), unless a call is still on the thread;
    DDP's buckets (asyncOp True, c10d's default) and async_op=True calls still go to the thread."""
    import torch.distributed as dist

    from cudampi.comm.paths import PathChoice
    from cudampi.torch import dispatch
    from cudampi.torch.methods import decode

    t = torch.ones(2)
    monkeypatch.setattr(dispatch, "first_cuda", lambda args: t)
    staged = _group_stand_in(PathChoice("staged", "", "staged"), _Runner(), auto=True)
    waited, later = dist.AllreduceOptions(), dist.AllreduceOptions()
    waited.asyncOp = False
    assert decode(waited).waited and not decode(later).waited and not decode(None).waited
    assert not dispatch.threaded(staged, "allreduce", ([t], decode(waited)))
    assert dispatch.threaded(staged, "allreduce", ([t], decode(later)))
    staged._runner.is_busy = True
    assert dispatch.threaded(staged, "allreduce", ([t], decode(waited))), "call order"
    forced = _group_stand_in(PathChoice("staged", "", "staged"), _Runner(), auto=False)
    assert dispatch.threaded(forced, "allreduce", ([t], decode(waited))), "async_ops=True"
    barrier = dist.BarrierOptions()
    barrier.asyncOp = False
    assert decode(barrier).waited and decode(barrier).root == 0


def test_capture_refuses_paths_that_block_the_host(monkeypatch):
    """Inside CUDA graph capture a call must be a kernel launch on the capturing stream: a
    path that synchronizes the host raises a CommError naming it, before anything runs."""
    from cudampi.comm.paths import PathChoice
    from cudampi.errors import CommError
    from cudampi.torch import backend, dispatch

    t = torch.ones(2)
    monkeypatch.setattr(dispatch, "first_cuda", lambda args: t)
    check = backend.CudampiProcessGroup._check_capturable
    staged = _group_stand_in(PathChoice("staged", "device memory, not proven", "staged"))
    with pytest.raises(CommError, match=r"all_gather_single.*'staged'.*path 'ipc'"):
        check(staged, "all_gather_single", ([t], [t]))
    assert staged._comm.asked == "allgather"
    ipc = _group_stand_in(PathChoice("ipc", "requested", "ipc", stream_ordered=True))
    check(ipc, "reduce_scatter_single", ([t], [t]))  # stream-ordered: fine
    assert ipc._comm.asked == "reduce_scatter"
    with pytest.raises(CommError, match="async_ops"):
        check(
            _group_stand_in(PathChoice("ipc", "", "ipc", stream_ordered=True), runner=_Runner()),
            "allreduce",
            (),
        )
    auto = _group_stand_in(
        PathChoice("ipc", "", "ipc", stream_ordered=True), runner=_Runner(), auto=True
    )
    check(auto, "allreduce", ([t],))  # auto, stream-ordered path, nothing on the thread: fine
    auto._runner.is_busy = True
    with pytest.raises(CommError, match="still run on its thread"):
        check(auto, "allreduce", ([t],))
    monkeypatch.setattr(dispatch, "first_cuda", lambda args: None)
    with pytest.raises(CommError, match="no CUDA tensor"):
        check(ipc, "barrier", ())
