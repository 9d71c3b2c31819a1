"""The job doctor's pure parts: the rounds of pairs, what stands out among the links, what
differs between the nodes, the launcher's message read from real output, and the report's
text and JSON (tests/netns/test_doctor_job.py runs the whole of it on a 4-node cluster)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from cudampi.doctor.job import JobResult
from cudampi.doctor.job_render import job_json, render_job_text
from cudampi.doctor.jobfacts import difference_findings, differences, settings_of
from cudampi.doctor.jobrun import mpi_error, summary_message, unreachable
from cudampi.doctor.links import Link, link_findings, outliers, parse_refused, rounds
from cudampi.doctor.node import NodeLines, emit

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "doctor-job"


@pytest.mark.parametrize("n", range(0, 12))
def test_rounds_meet_every_pair_once_with_each_node_once_a_round(n: int):
    nodes = [f"n{i}" for i in range(n)]
    got = rounds(nodes)
    pairs = [p for r in got for p in r]
    assert sorted(pairs) == sorted(itertools.combinations(nodes, 2))
    assert len(got) == (0 if n < 2 else n - 1 if n % 2 == 0 else n)
    for r in got:
        seen = [x for p in r for x in p]
        assert len(seen) == len(set(seen)), r  # no node in two pairs of one round
    with pytest.raises(ValueError, match="named twice"):
        rounds(["a", "b", "a"])


def ok(a: str, b: str, gbps: float = 1.0, lat: float = 8.0, **kw: Any) -> Link:
    return Link(a, b, "ok", latency_us=lat, gbps_ab=gbps, gbps_ba=gbps * 1.1, **kw)


NODES = ["a", "b", "c", "d"]


def healthy(**change: Link) -> list[Link]:
    links = {
        f"{a}{b}": ok(a, b, 1.0 + 0.05 * i)
        for i, (a, b) in enumerate(itertools.combinations(NODES, 2))
    }
    links.update(change)
    return list(links.values())


def test_one_slow_link_is_named_as_the_slowest_link():
    found = link_findings(healthy(bc=ok("b", "c", 0.02)), NODES)
    assert [f.subject for f in found] == ["b<->c"]
    assert "20 MB/s, 0.018x the median of the other links: the slowest link" in found[0].what
    assert found[0].severity == "warn" and "between b and c" in found[0].fix


def test_a_node_whose_every_link_is_slow_is_named_once():
    slow = {k: ok(k[0], k[1], 0.03) for k in ("ac", "bc", "cd")}
    found = link_findings(healthy(**slow), NODES)
    assert [f.subject for f in found] == ["c"], found
    assert "every link of c is slow (3 of 3)" in found[0].what
    assert "c's own connection to the network" in found[0].consequence


def test_a_late_link_is_named_by_its_best_latency():
    found = link_findings(healthy(ad=ok("a", "d", lat=400.0)), NODES)
    assert [f.subject for f in found] == ["a<->d"]
    assert "latency 400 us" in found[0].what and "slowest" not in found[0].what
    # noise under 20 us over the median is not a finding
    assert link_findings(healthy(ad=ok("a", "d", lat=25.0)), NODES) == []


def test_failed_links_of_one_node_name_the_node():
    fail = {k: Link(k[0], k[1], "failed", message="boom") for k in ("ad", "bd", "cd")}
    found = link_findings(healthy(**fail), NODES)
    assert [(f.subject, f.severity) for f in found] == [("d", "fail")]
    assert "every link of d failed (3 of 3)" in found[0].what and "boom" in found[0].what
    one = link_findings(healthy(ab=Link("a", "b", "failed", message="x")), NODES)
    assert [f.subject for f in one] == ["a<->b"]
    # a node already named (down) has its failed links said there, not again
    assert link_findings(healthy(**fail), NODES, said={"d"}) == []


def test_a_node_refusing_connections_is_named_once_with_the_fix():
    fail = {
        "ac": Link("a", "c", "failed", message="m", refused_by=("c",)),
        "bc": Link("b", "c", "failed", message="m", refused_by=("c",)),
        "cd": ok("c", "d", tcp={"ab": "ok", "ba": "refused"}),
    }
    found = link_findings(healthy(**fail), NODES)
    assert [f.subject for f in found] == ["c"], found
    assert "from d: refused" in found[0].what and "from a: MPI's TCP connection" in found[0].what
    assert "open c's firewall" in found[0].fix


def test_wrong_data_is_a_failure():
    found = link_findings(healthy(ab=ok("a", "b", wrong=2)), NODES)
    assert [(f.subject, f.severity) for f in found] == [("a<->b", "fail")]


def test_the_launchers_message_from_real_output():
    refused = (FIX / "openmpi-tcp-refused.txt").read_text()
    assert parse_refused(refused) == [("10.232.0.3", "Connection refused (111)")]
    assert summary_message(refused) == (
        "the job failed (launcher exit status 14); rank 0 on host node2 failed; the MPI said: "
        "connect() to 10.232.0.3:1024 failed: Connection refused (111)"
    )
    mpich = (FIX / "mpich-rank-under-open-mpi.txt").read_text()
    assert mpi_error(mpich) == "Runtime environment uses unsupported PMI version PMIx. Aborting."
    assert summary_message(mpich).startswith(
        "the job failed (launcher exit status 16); rank 1 exited with code 16; the MPI said: "
        "Runtime environment uses unsupported PMI version PMIx"
    )
    down = (FIX / "openmpi-node-down.txt").read_text()
    assert summary_message(down) == (
        "the job failed (launcher exit status 255); host node4 cannot be reached: Connection "
        "timed out"
    )


def summary(mpi: str = "Open MPI 5.0.11", settings: dict[str, str] | None = None) -> dict[str, Any]:
    rows = {"MPI library": mpi, "host p2p": "ok 1.50 GB/s", "GPUs": "none"}
    keys = {"MPI library": mpi, "host p2p": "ok", "GPUs": "none"}
    return {"rows": rows, "keys": keys, "settings": settings or {}, "checks": []}


def test_differences_name_the_odd_node_with_the_consequence_and_fix():
    nodes = {n: summary() for n in ("a", "b", "c")}
    nodes["c"] = summary("MPICH 5.0.2", {"CUDAMPI_CHUNK_BYTES": "1M"})
    nodes["b"]["rows"]["host p2p"] = "ok 0.90 GB/s"  # a figure: shown, not compared
    diffs = differences(nodes)
    assert [(d.fact, d.odd, d.common) for d in diffs] == [
        ("MPI library", ("c",), "Open MPI 5.0.11"),
        ("env CUDAMPI_CHUNK_BYTES", ("c",), "-"),
    ]
    mpi, chunk = difference_findings(diffs)
    assert mpi.subject == "c" and mpi.severity == "fail"
    assert mpi.what == "MPI library differs: c: MPICH 5.0.2 (the others: Open MPI 5.0.11)"
    assert "cannot join one MPI job" in mpi.consequence and "make c load the same MPI" in mpi.fix
    assert chunk.severity == "fail" and "stops at its creation" in chunk.consequence
    assert "set CUDAMPI_CHUNK_BYTES the same on every node" in chunk.fix
    # two nodes that differ: no side is "the others"
    two = differences({"a": summary(), "b": summary("MPICH 5.0.2")})
    assert two[0].odd == ("a", "b") and two[0].common is None


def test_the_compared_settings():
    env = {
        "CUDAMPI_CHUNK_BYTES": "1M",  # a setting
        "CUDAMPI_LAUNCHER": "openmpi",  # cudampi launch's message to its ranks
        "UCX_TLS": "tcp",
        "OMPI_COMM_WORLD_RANK": "0",  # the launcher's own
        "NCCL_SOCKET_IFNAME": "eth0",  # chosen per node
        "MPI4PY_LIBMPI": "/x/libmpi.so",
        "HOME": "/root",
    }
    assert settings_of(env) == {
        "CUDAMPI_CHUNK_BYTES": "1M",
        "MPI4PY_LIBMPI": "/x/libmpi.so",
        "UCX_TLS": "tcp",
    }


def job(n: int, **kw: Any) -> JobResult:
    nodes = [f"node{i + 1}" for i in range(n)]
    facts = {x: summary() for x in nodes}
    links = [ok(a, b) for a, b in itertools.combinations(nodes, 2)]
    launcher = {"name": "Open MPI", "version": "5.0.11", "flavour": "openmpi"}
    return JobResult(nodes, launcher, facts, links=links, rounds=rounds(nodes), **kw)


def test_the_text_fits_a_terminal_at_8_nodes_and_summarises_beyond():
    text = render_job_text(job(8), width=120)
    assert max(len(line) for line in text.splitlines()) <= 120, text
    assert "bandwidth, GB/s" in text and "node8" in text
    assert "job doctor passed: 8 of 8 nodes, 28 of 28 links in 7 rounds" in text
    big = job(12)
    big.links[0] = ok("node1", "node2", 0.01)
    text = render_job_text(big, width=120)
    assert "bandwidth, GB/s" not in text  # no 12 x 12 matrix
    assert "the slowest links: node1<->node2 10 MB/s" in text
    assert "WARN  node1<->node2: 10 MB/s" in text


def test_the_json_has_every_part_and_the_exit_code():
    result = job(3, unanswered={"node3": "did not answer in 30 s: ssh ok, MPI job failed: x"})
    del result.facts["node3"]
    data = json.loads(json.dumps(job_json(result)))
    assert data["exit_code"] == 1 and data["summary"] == {"fail": 1, "warn": 0}
    assert data["findings"][0]["subject"] == "node3"
    assert "ssh reaches node3" in data["findings"][0]["fix"]
    assert set(data) >= {"nodes", "table", "differences", "links", "rounds", "facts", "launcher"}


def test_an_outlier_measured_again_keeps_the_better_figures():
    late = ok("a", "d", 0.5, lat=400.0)
    assert outliers(healthy(ad=late)) == [late]
    best = late.best_of(ok("a", "d", 1.2, lat=9.0))
    assert (best.latency_us, best.gbps, best.measured) == (9.0, 1.2, 2)
    assert link_findings(healthy(ad=best), NODES) == []  # a busy moment, not the link
    assert late.best_of(Link("a", "d", "failed")) is late


def test_the_hosts_the_launcher_could_not_reach():
    down = summary_message((FIX / "openmpi-node-down.txt").read_text())
    assert unreachable(down) == {"node4"}
    assert unreachable(summary_message((FIX / "openmpi-tcp-refused.txt").read_text())) == set()
    said = "host 'x.invalid' cannot be reached: its name does not resolve ([Errno -2] ...)"
    assert unreachable(said) == {"x.invalid"}


def test_a_nodes_summary_travels_in_whole_lines_under_4_kib(capsys: pytest.CaptureFixture[str]):
    """Each line is one write below PIPE_BUF, so the launcher never cuts one with another
    node's output; the lines of two nodes, interleaved, put together again."""
    big = {"name": "a", "checks": [{"detail": "x" * 500, "i": i} for i in range(40)]}
    emit("a", big)
    emit("b", {"name": "b"})
    out = capsys.readouterr().out.splitlines()
    assert len(out) > 3 and all(len(line.encode()) < 4096 for line in out)
    lines, got = NodeLines(), {}
    for line in [out[-1], *out[:-1]]:  # b's line first, then a's in order
        whole = lines.add(line)
        if whole is not None:
            got[whole[0]] = whole[1]
    assert got == {"a": big, "b": {"name": "b"}}
