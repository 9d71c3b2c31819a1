"""tools/gpu-summary.py on captured pytest output (tests/fixtures/gpu-summary): one summary of
a GPU suite run per MPS setting, every failed and not-run test named, exit 1 when anything
failed or did not run (a "time ran out" skip, a test its stopped pytest never reported)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gpu-summary"
TOOL = ROOT / "tools" / "gpu-summary.py"


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("gpu_summary", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_summary"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _by_id(run):
    return {r.nodeid.split("::", 1)[1]: r for r in run.results}


def test_a_run_with_failures_a_deadline_skip_and_a_stopped_pytest(summary):
    run = summary.load(FIXTURES / "verify-mps-on")
    got = _by_id(run)
    assert run.mps == "on" and run.stopped == ["b"]
    assert [got[n].outcome for n in ("test_passes", "test_check[matrix[cupy-2]]")] == ["passed"] * 2
    assert got["test_fails"].outcome == "failed" and "one is not two" in got["test_fails"].message
    assert got["test_check[faults[size]]"].outcome == "failed"
    assert "rank 1: AssertionError: no error" in got["test_check[faults[size]]"].message
    assert got["test_errors"].outcome == "failed" and "fixture broke" in got["test_errors"].message
    assert got["test_skips"].outcome == "skipped"
    assert got["test_ran_out"].outcome == "not run"  # the session's deadline: not a skip
    # b's pytest was killed: its log says test_quick passed and test_hangs was running
    assert got["test_quick"].outcome == "passed"
    assert got["test_hangs"].outcome == "not run" and "while it ran" in got["test_hangs"].message
    assert got["test_never_reached"].outcome == "not run"
    assert [run.count(o) for o in summary.OUTCOMES] == [3, 3, 1, 3]
    assert run.count("failed", "tests/gpu/test_alpha_gpu.py") == 3
    assert not summary.ok([run])


def test_the_text_names_every_failure_per_file_and_mps_setting(summary):
    on, off = summary.load(FIXTURES / "verify-mps-on"), summary.load(FIXTURES / "verify-mps-off")
    text = summary.render([on, off])
    lines = text.splitlines()
    assert lines[0] == "== GPU suite, MPS on, NVIDIA H100 80GB HBM3: 12 s of 480 s"
    row = next(ln for ln in lines if ln.startswith("test_alpha_gpu.py"))
    assert row.split()[1:5] == ["2", "3", "1", "1"]
    assert "FAILED (MPS on) test_alpha_gpu.py::test_fails: AssertionError: one is not two" in lines
    assert (
        "NOT RUN (MPS on) test_beta_gpu.py::test_hangs: time ran out: stopped while it ran" in lines
    )
    assert "STOPPED at the hard time limit (MPS on): b" in lines
    assert any(ln.startswith("== GPU suite, MPS off") for ln in lines)
    assert lines[-1] == (
        "== verdict: FAILED (MPS on: 3 passed, 3 failed, 1 skipped, 3 not run; "
        "MPS off: 2 passed, 0 failed, 1 skipped, 0 not run)"
    )


def test_the_exit_status_is_the_verdict():
    def tool(*runs):
        argv = [sys.executable, str(TOOL), *(str(FIXTURES / r) for r in runs)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    passed = tool("verify-mps-off")
    assert passed.returncode == 0 and "== verdict: PASSED (MPS off:" in passed.stdout
    failed = tool("verify-mps-on", "verify-mps-off")
    assert failed.returncode == 1 and "== verdict: FAILED" in failed.stdout
    assert tool("no-such-run").returncode == 2


def test_a_run_that_reported_nothing_fails(summary, tmp_path):
    (tmp_path / "collected.txt").write_text(
        (FIXTURES / "verify-mps-off" / "collected.txt").read_text()
    )
    run = summary.load(tmp_path)
    assert [r.outcome for r in run.results] == ["not run"] * 3
    assert not summary.ok([run]) and not summary.ok([summary.load(tmp_path / "empty")])


def test_a_run_that_skipped_everything_fails(summary):
    """No GPU seen (every test skipped "needs a CUDA GPU"): nothing was checked."""
    run = summary.load(FIXTURES / "verify-mps-off")
    skipped = [summary.Result(r.nodeid, "skipped", 0.0, "needs a CUDA GPU") for r in run.results]
    assert summary.ok([run])
    nothing = summary.Run(run.facts, skipped)
    assert not summary.ok([nothing])
    assert "NOTHING PASSED (MPS off): no test ran to a pass (no GPU seen?)" in summary.render(
        [nothing]
    )


def test_junit_classnames_become_the_collected_node_ids(summary):
    xml = (FIXTURES / "verify-mps-on" / "a.xml").read_text()
    ids = [r.nodeid for r in summary.parse_junit(xml)]
    assert ids[0] == "tests/gpu/test_alpha_gpu.py::test_passes"
    assert "tests/gpu/test_alpha_gpu.py::test_check[faults[size]]" in ids
    # a class step: the collected ids say where the module ends
    xml = '<testsuite><testcase classname="tests.gpu.test_x.TestA" name="test_b" time="1.5"/></testsuite>'
    known = {"tests/gpu/test_x.py::TestA::test_b"}
    assert summary.parse_junit(xml, known)[0].nodeid == "tests/gpu/test_x.py::TestA::test_b"
    assert summary.parse_junit(xml, known)[0].seconds == 1.5
