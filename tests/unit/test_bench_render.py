"""Rendering of results: the nccl-tests table, JSON, CSV, ratios, verdict and the plot."""

from __future__ import annotations

import csv
import dataclasses
import io
import json

import pytest

from cudampi.bench import render
from cudampi.bench.metrics import algbw, busbw
from cudampi.bench.results import BenchResult, Limit, Row, SkipNote


def row(path, size, t_us, op="allreduce", wrong=0, n=2):
    return Row(
        op=op,
        path=path,
        dtype="float32",
        redop="sum" if op == "allreduce" else None,
        root=-1,
        size=size,
        count=size // 4,
        iters=20,
        time_us=t_us,
        time_min_us=t_us * 0.9,
        time_max_us=t_us * 1.1,
        algbw=algbw(size, t_us * 1e-6),
        busbw=busbw(op, size, t_us * 1e-6, n),
        wrong=wrong,
    )


def result(**kw):
    rows = (
        row("gpu-ring", 1024, 10.0),
        row("gpu-ring", 1 << 20, 100.0),
        row("torch-gloo", 1024, 20.0),
        row("torch-gloo", 1 << 20, 400.0),
        row("copy", 1 << 20, 10.0, op="copy"),
    )
    skips = (SkipNote("allreduce", "torch-nccl", "float32", "sum", "NCCL needs one GPU per rank"),)
    base = BenchResult(
        meta={"ranks": 2, "device": "cpu", "warmup": 5, "iters": 20, "check": True},
        rows=rows,
        skips=skips,
        limit=Limit("host-copy", 12.5, "measured"),
    )
    return dataclasses.replace(base, **kw)


def test_table_has_the_nccl_tests_columns_and_rows():
    text = render.render_text(result())
    assert (
        "size" in text
        and "count" in text
        and "redop" in text
        and "busbw" in text
        and "#wrong" in text
    )
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("1048576") and "sum" in ln)
    cols = line.split()
    assert cols[:5] == ["1048576", "262144", "float", "sum", "-1"]
    assert float(cols[5]) == pytest.approx(100.0)
    assert float(cols[9]) == pytest.approx(busbw("allreduce", 1 << 20, 1e-4, 2), abs=0.01)
    assert "skipped: NCCL needs one GPU per rank" in text
    assert "# Out of bounds values : 0 OK" in text
    assert "Verdict: OK" in text


def test_ratios_against_peers_at_the_largest_common_size():
    rs = {(r["path"], r["peer"]): r for r in render.ratios(result())}
    r = rs[("gpu-ring", "torch-gloo")]
    assert r["size"] == 1 << 20 and r["ratio"] == pytest.approx(4.0)
    assert rs[("gpu-ring", "copy")]["ratio"] == pytest.approx(
        busbw("allreduce", 1 << 20, 1e-4, 2) / algbw(1 << 20, 1e-5)
    )
    assert "= 4.00x" in render.render_text(result())


def test_wrong_data_fails_the_verdict():
    bad = result(rows=(row("gpu-ring", 1024, 10.0, wrong=3),))
    assert not bad.ok and bad.wrong == 3
    text = render.render_text(bad)
    assert "# Out of bounds values : 3 FAILED" in text and "Verdict: FAILED" in text


def test_min_busbw_fails_below_and_passes_above():
    assert not result(min_busbw=1e6).ok
    assert "< --min-busbw" in render.render_text(result(min_busbw=1e6))
    assert result(min_busbw=0.0001).ok


def test_json_and_csv_parse_back():
    data = json.loads(render.render_json(result()))
    assert data["kind"] == "cudampi-bench-collectives"
    assert data["verdict"]["ok"] is True and data["verdict"]["wrong"] == 0
    assert data["results"][0]["path"] == "gpu-ring" and data["limit"]["gbps"] == 12.5
    assert data["skipped"][0]["path"] == "torch-nccl"
    assert any(r["peer"] == "torch-gloo" for r in data["ratios"])
    rows = list(csv.DictReader(io.StringIO(render.render_csv(result()))))
    assert len(rows) == 6 and rows[-1]["skipped"].startswith("NCCL")
    assert float(rows[1]["busbw"]) > 0


def test_fmt_keeps_the_width():
    assert render.fmt(1.234, 7) == "   1.23"
    assert len(render.fmt(123456789.0, 7)) <= 8


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from cudampi.bench.plot import plot_collectives

    out = plot_collectives(result(), tmp_path / "bw.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_size_whose_repeated_timings_disagree_is_marked_noise_not_quoted():
    steady = result()
    assert steady.noisy() == [] and "Noise" not in render.render_text(steady)
    noisy_row = dataclasses.replace(row("mpi", 8, 457.0), spread=320.0)
    r = dataclasses.replace(steady, rows=(*steady.rows, noisy_row))
    text = render.render_text(r)
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("8 ") and "noisy" in ln)
    assert line.endswith("noisy(320.0x)")
    assert "1 of 6 rows (marked noisy) varied more than 2x" in text
    assert "worst 320.0x: allreduce on mpi at 8 B" in text
    assert text.rstrip().endswith("(1 noisy row(s))") and "# Verdict: OK" in text
    data = json.loads(render.render_json(r))
    assert data["verdict"]["noisy_rows"] == 1 and data["results"][-1]["noisy"] is True
    rows = list(csv.DictReader(io.StringIO(render.render_csv(r))))
    assert rows[-2]["noisy"] == "True" and float(rows[-2]["spread"]) == 320.0


def test_one_rank_says_so_and_how_to_run_more():
    one = result(meta={"ranks": 1, "device": "cpu", "warmup": 5, "iters": 20, "check": True})
    text = render.render_text(one)
    assert "# 1 rank: nothing crosses ranks, so busbw is 0; run more with --np 2" in text
    assert "1 rank only: nothing crossed ranks (--np 2 for more)" in text.splitlines()[-1]
    assert json.loads(render.render_json(one))["verdict"]["one_rank"] is True
    assert "1 rank" not in render.render_text(result())


def test_timed_calls_split_into_rounds():
    from cudampi.bench.runner import split_rounds

    assert split_rounds(20, 5) == [4, 4, 4, 4, 4]
    assert split_rounds(7, 5) == [2, 2, 1, 1, 1]
    assert split_rounds(2, 5) == [1, 1]
    assert split_rounds(1, 5) == [1]
