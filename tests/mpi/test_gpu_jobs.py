"""The GPU suite's jobs (tests/gpu/jobs.py) on real ranks of the CPU: many checks in one
mpiexec job, each reported by name (passed, failed on one rank, skipped), the job going on after
a failure; a rank left waiting by a failed peer ends the job after CHECK_WAIT, and the checks
not reached fail saying where the job stopped. The GPU files run this way on the GPU machine,
where these tests cannot run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.gpu.jobs import Check, Jobs, Skip, deadline_left, deadline_skip, parse_checks

pytestmark = pytest.mark.mpi


def rank_pass(comm):
    return f"sum {comm.allreduce(comm.rank + 1)}"


def rank_fail_on_1(comm):
    total = comm.allreduce(1)  # both ranks take part, then rank 1 fails
    assert comm.rank != 1, f"rank 1 saw {total} ranks"


def rank_skip(comm):
    raise Skip("not here: a reason")


def rank_pytest_skip(comm):
    pytest.skip("skipped the pytest way")


def rank_env(comm):
    assert os.environ["CUDAMPI_TEST_JOBS_VALUE"] == "set", os.environ.get("CUDAMPI_TEST_JOBS_VALUE")
    return "env set"


def rank_env_gone(comm):
    assert "CUDAMPI_TEST_JOBS_VALUE" not in os.environ, "the check's environment stayed"


def rank_stuck(comm):
    if comm.rank == 0:
        raise AssertionError("rank 0 fails before the message rank 1 waits for")
    comm.recv(source=0, tag=7)


def rank_sleeps(comm):
    print(f"PID {os.getpid()}", flush=True)
    time.sleep(60)


def rank_slow(comm):
    time.sleep(0.5 * comm.rank)
    return "slow"


def rank_torch_group_then_fail(comm):
    """A check that fails with its torch process group still made (as a DDP check that fails
    halfway)."""
    import torch.distributed as dist

    import cudampi.torch  # noqa: F401  (the backend)

    dist.init_process_group("cudampi")
    assert dist.is_initialized()
    raise AssertionError("failed with the group still made")


def rank_torch_group(comm):
    import torch
    import torch.distributed as dist

    import cudampi.torch  # noqa: F401  (the backend)

    dist.init_process_group("cudampi")  # "initialize the default process group twice" if left
    x = torch.ones(2)
    dist.all_reduce(x)
    dist.destroy_process_group()
    return f"sum {x.tolist()}"


def checks():
    return [
        Check("passes", rank_pass),
        Check("fails[on-1]", rank_fail_on_1),
        Check("skips", rank_skip),
        Check("pytest_skips", rank_pytest_skip),
        Check("env", rank_env, env=(("CUDAMPI_TEST_JOBS_VALUE", "set"),)),
        Check("env_gone", rank_env_gone),
        Check("slow", rank_slow),
        Check("torch_group_then_fails", rank_torch_group_then_fail),
        Check("torch_group_after_a_failed_one", rank_torch_group),
        Check("stuck", rank_stuck),
        Check("after_stuck", rank_pass),
        Check("sleeps", rank_sleeps),
        Check("sleeps_past_its_timeout", rank_sleeps, timeout=3),
    ]


CHECKS = {c.name: c for c in checks()}


def _outcome(jobs: Jobs, name: str) -> tuple[str, str]:
    try:
        jobs.verify(CHECKS[name])
    except pytest.fail.Exception as exc:
        return "failed", str(exc)
    except pytest.skip.Exception as exc:
        return "skipped", str(exc)
    return "passed", ""


def test_a_job_reports_each_check_and_goes_on_after_a_failure(capsys):
    names = ["passes", "fails[on-1]", "skips", "pytest_skips", "env", "env_gone", "slow"]
    unknown = Check("no_such_check", rank_pass)  # the two sides disagree on the file's checks
    jobs = Jobs(__name__, [*(CHECKS[n] for n in names), unknown])
    got = {n: _outcome(jobs, n) for n in names}
    assert got["passes"] == ("passed", "")
    out = capsys.readouterr().out
    assert "sum 3" in out
    assert "the 2-rank job (this stack): " in out and "\n  passes PASS " in out, out
    assert "\n  fails[on-1] FAIL " in out and "\n  slow PASS " in out, out
    status, text = got["fails[on-1]"]
    assert status == "failed" and "rank 1: AssertionError: rank 1 saw 2 ranks" in text, text
    assert "rank_fail_on_1" in text  # the rank's traceback
    assert got["skips"] == ("skipped", "not here: a reason")
    assert got["pytest_skips"] == ("skipped", "skipped the pytest way")
    assert got["env"][0] == got["env_gone"][0] == got["slow"][0] == "passed", got
    with pytest.raises(pytest.fail.Exception, match="no check named 'no_such_check'"):
        jobs.verify(unknown)
    ran, _, started = jobs.reports[(2, "this")]
    assert started == [*names, "no_such_check"] and ran.returncode == 0, ran.tail()


def test_a_failed_check_does_not_leave_its_torch_group_to_the_next():
    """A check that fails with its torch process group made (the job's ranks go on) does not
    make the next check's init_process_group fail ("initialize the default process group
    twice"): the job destroys what a check left."""
    pytest.importorskip("torch")
    names = ["torch_group_then_fails", "torch_group_after_a_failed_one"]
    jobs = Jobs(__name__, [CHECKS[n] for n in names])
    got = {n: _outcome(jobs, n) for n in names}
    assert got["torch_group_then_fails"][0] == "failed", got
    assert "failed with the group still made" in got["torch_group_then_fails"][1], got
    assert got["torch_group_after_a_failed_one"] == ("passed", ""), got


def test_a_rank_left_waiting_by_a_failed_peer_ends_the_job(monkeypatch):
    monkeypatch.setenv("CUDAMPI_TEST_CHECK_WAIT", "3")
    jobs = Jobs(__name__, [CHECKS["passes"], CHECKS["stuck"], CHECKS["after_stuck"]])
    t0 = time.monotonic()
    assert _outcome(jobs, "passes")[0] == "passed"
    status, text = _outcome(jobs, "stuck")
    assert status == "failed" and "rank 0: AssertionError: rank 0 fails before" in text, text
    assert "did not end this check within 3 s" in text, text
    status, text = _outcome(jobs, "after_stuck")
    assert status == "failed" and "before it ran (during stuck)" in text, text
    assert time.monotonic() - t0 < 60


def test_the_sessions_deadline_stops_a_job_and_its_ranks(monkeypatch):
    """Past CUDAMPI_TEST_DEADLINE the job's process group is stopped (no rank left behind), its
    checks skip as "time ran out" (tools/gpu-summary.py counts them as not run), and the timeline
    shows each rank's stack in the check it was stopped in."""
    monkeypatch.setenv("CUDAMPI_TEST_DEADLINE", str(time.time() + 8))
    jobs = Jobs(__name__, [CHECKS["sleeps"], CHECKS["passes"]])
    t0 = time.monotonic()
    status, text = _outcome(jobs, "sleeps")
    assert status == "skipped" and text.startswith("time ran out") and "while it ran" in text
    timeline = jobs.timeline((2, "this"))
    assert "stopped at the session's deadline" in timeline, timeline
    assert "\n  sleeps RUNNING when the job ended" in timeline, timeline
    # where the ranks were just before they were stopped (faulthandler), under the check
    assert timeline.count(" in rank_sleeps\n") == 2, timeline
    status, text = _outcome(jobs, "passes")
    assert status == "skipped" and "before it ran (during sleeps)" in text, text
    assert time.monotonic() - t0 < 40
    ran = jobs.reports[(2, "this")][0]
    pids = [int(line.split()[1]) for line in ran.stdout.splitlines() if line.startswith("PID ")]
    assert len(pids) == 2, ran.tail()
    time.sleep(1)
    assert not [pid for pid in pids if _running(pid)], ran.tail()


def test_checks_a_job_ended_before_the_deadline_stopped_it_report_their_outcome(monkeypatch):
    """The deadline stops a job in its third check: the two it ended report passed and failed,
    past the deadline too (the GPU files' setup hook skipped them as "time ran out" before, as
    if they had not run), and only the checks it never ended ran out of time."""
    monkeypatch.setenv("CUDAMPI_TEST_DEADLINE", str(time.time() + 20))
    names = ["passes", "fails[on-1]", "sleeps"]
    jobs = Jobs(__name__, [CHECKS[n] for n in names])
    assert deadline_skip(__name__, CHECKS["passes"]) is None  # 20 s left: the job may start
    assert _outcome(jobs, "passes")[0] == "passed"
    assert (deadline_left() or 0) < 10  # the job ran to the deadline
    outcomes = {}
    for name in names[1:]:
        why = deadline_skip(__name__, CHECKS[name])
        outcomes[name] = ("skipped", why) if why is not None else _outcome(jobs, name)
    assert outcomes["fails[on-1]"][0] == "failed", outcomes
    assert "rank 1 saw 2 ranks" in outcomes["fails[on-1]"][1], outcomes
    status, text = outcomes["sleeps"]
    assert status == "skipped" and text.startswith("time ran out") and "while it ran" in text
    other = Check("another_job", rank_pass, ranks=3)  # a job that never started: too late
    assert (deadline_skip(__name__, other) or "").startswith("time ran out")
    assert (deadline_skip(__name__, None) or "").startswith("time ran out")


def test_a_check_past_its_timeout_ends_the_job_with_each_ranks_stack():
    jobs = Jobs(__name__, [CHECKS["passes"], CHECKS["sleeps_past_its_timeout"], CHECKS["slow"]])
    t0 = time.monotonic()
    assert _outcome(jobs, "passes")[0] == "passed"
    status, text = _outcome(jobs, "sleeps_past_its_timeout")
    assert status == "failed" and "ended (exit" in text and "while it ran" in text, text
    assert "Timeout (0:00:03" in text and " in rank_sleeps\n" in text, text
    timeline = jobs.timeline((2, "this"))
    assert "\n  sleeps_past_its_timeout RUNNING when the job ended" in timeline, timeline
    assert " in rank_sleeps\n" in timeline, timeline
    status, text = _outcome(jobs, "slow")
    assert status == "failed" and "before it ran (during sleeps_past_its_timeout)" in text, text
    assert time.monotonic() - t0 < 30


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # a zombie has ended


def test_parse_checks_keeps_every_ranks_failure_once():
    out = (
        "CHECK a START\n"
        "CHECK a PASS 1.5s 12 results\n"
        "CHECK b START\n"
        "CHECK b FAIL 0.2s rank 1: AssertionError: x\n"
        "noise from a rank\n"
        "CHECK b FAIL 0.3s rank 1: AssertionError: x; rank 0: ValueError: y\n"
        "CHECK c START\n"
        "CHECK c SKIP 0.0s no GPU\n"
        "CHECK d START\n"
    )
    ended, started = parse_checks(out)
    assert started == ["a", "b", "c", "d"]
    assert ended["a"] == ("PASS", 1.5, "12 results")
    assert ended["b"] == ("FAIL", 0.3, "rank 1: AssertionError: x; rank 0: ValueError: y")
    assert ended["c"] == ("SKIP", 0.0, "no GPU")
    assert "d" not in ended
