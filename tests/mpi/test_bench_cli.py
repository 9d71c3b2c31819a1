"""Real `cudampi bench` runs under mpiexec (2 and 4 ranks on the CPU): every collective on the
host-capable paths with data checked, JSON/CSV/PNG written, a planted wrong result and a missed
--min-busbw exit 1, the --np self-relaunch, p2p and ddp."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, mpi_env, mpiexec_argv, run_launched

pytestmark = pytest.mark.mpi

OPS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "reduce", "sendrecv")
PATHS = ("host", "gpu-ring", "staged", "native", "torch-gloo", "torch-cudampi", "mpi", "copy")


def bench(n, *args, timeout=240, launcher=True):
    argv = [*mpiexec_argv(n)] if launcher else []
    argv += [sys.executable, "-m", "cudampi", "bench", *args, "--device", "cpu", "--quiet"]
    return run_launched(argv, mpi_env(), timeout, f"cudampi bench {args}")


def bench_ddp(steps, *args):
    """`bench ddp` of the small CPU transformer on 2 ranks: one warmup step, ``steps`` timed
    steps, batch 2."""
    return bench(
        2, "ddp", "--model", "transformer", "-w", "1", "-n", str(steps), "--batch", "2", *args
    )


def ok(proc):
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.mark.parametrize(("n", "factor"), [(2, "4"), (4, "16")])
def test_every_collective_on_every_host_path_is_correct(n, factor, tmp_path):
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    proc = ok(
        bench(
            n,
            "all",
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            factor,
            "-w",
            "1",
            "-n",
            "3",
            "--paths",
            ",".join(PATHS),
            "--json",
            str(js),
            "--csv",
            str(cs),
            "--plot",
            str(png),
        )
    )
    data = json.loads(js.read_text())
    assert data["meta"]["ranks"] == n
    verdict = {k: data["verdict"][k] for k in ("ok", "wrong", "min_busbw", "below_min_busbw")}
    assert verdict == {"ok": True, "wrong": 0, "min_busbw": None, "below_min_busbw": []}
    assert data["verdict"]["one_rank"] is False and data["verdict"]["noisy_rows"] >= 0
    ran = {(r["op"], r["path"]) for r in data["results"]}
    for op in OPS:
        for path in PATHS:
            if path != "copy":
                assert (op, path) in ran, f"{op} on {path} did not run: {data['skipped']}"
    assert ("copy", "copy") in ran
    assert all(r["wrong"] == 0 for r in data["results"])
    assert all(
        r["busbw"] > 0 and r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
        for r in data["results"]
    )
    # the table went to stdout, from rank 0 only
    assert proc.stdout.count("# Verdict: OK") == 1
    assert "allreduce float sum on gpu-ring" in proc.stdout
    # each cudampi path says what the Communicator runs for it, and why
    assert "#   runs: mpi engine; host memory: MPI's own collective" in proc.stdout
    assert {c["path"] for c in data["choices"]} == {"host", "gpu-ring", "staged", "native"}
    assert cs.read_text().startswith("op,path,dtype")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("n", [2, 3])
def test_in_place_reduces_in_the_output_buffer_on_every_cudampi_path(n, tmp_path):
    """``--in-place``: cudampi's paths reduce in the output buffer, as the torch paths do (the
    header and the JSON say so), every result checked."""
    js = tmp_path / "r.json"
    paths = "host,gpu-ring,staged,native,torch-cudampi"
    args = ("allreduce", "reduce", "-b", "8", "-e", "1M", "-f", "64", "-w", "1", "-n", "3")
    ok(bench(n, *args, "-o", "sum,max", "--paths", paths, "--in-place", "--json", str(js)))
    data = json.loads(js.read_text())
    assert data["meta"]["in_place"] is True and data["verdict"]["ok"], data["verdict"]
    ran = {(r["op"], r["path"], r["redop"]) for r in data["results"]}
    for op in ("allreduce", "reduce"):
        for path in paths.split(","):
            for redop in ("sum", "max"):
                assert (op, path, redop) in ran, f"{op} {redop} on {path}: {data['skipped']}"
    assert all(r["wrong"] == 0 for r in data["results"])
    if n == 2:  # the table's header says so too: a 2-rank run of its own, the same for any n
        text = ok(bench(2, "allreduce", "-b", "64", "-e", "64", "-n", "2", "--paths", "host",
                        "--in-place")).stdout  # fmt: skip
        assert "  in place" in text.splitlines()[0], text[:400]


def test_the_kernel_engines_say_why_they_skip_a_host_run(tmp_path):
    """ipc and nccl (cudampi's stream-ordered engines) and torch's NCCL move device arrays:
    on the CPU each row says why it did not run, and the host row runs beside them."""
    js = tmp_path / "r.json"
    quick = ("allreduce", "-b", "64", "-e", "64", "-n", "2")
    ok(bench(2, *quick, "--paths", "nccl,ipc,torch-nccl,host", "--json", str(js)))
    data = json.loads(js.read_text())
    why = {s["path"]: s["reason"] for s in data["skipped"]}
    assert why["nccl"] == "NCCL moves device arrays; this run is on the host", why
    assert why["ipc"] == "ipc moves device arrays; here it would run host", why
    assert "torch-nccl" in why
    assert [r["path"] for r in data["results"]] == ["host"]


def test_a_planted_wrong_result_exits_1():
    proc = bench(
        2,
        "allreduce",
        "broadcast",
        "-b",
        "1K",
        "-e",
        "1K",
        "-w",
        "1",
        "-n",
        "2",
        "--paths",
        "host,torch-gloo",
        "--corrupt-rank",
        "1",
        "--json",
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    assert data["verdict"]["ok"] is False
    wrong = {(r["op"], r["path"]): r["wrong"] for r in data["results"]}
    assert wrong == {
        ("allreduce", "host"): 1,
        ("allreduce", "torch-gloo"): 1,
        ("broadcast", "host"): 1,
        ("broadcast", "torch-gloo"): 1,
    }


def test_missed_min_busbw_exits_1_and_says_so():
    proc = bench(
        2,
        "allreduce",
        "-b",
        "1K",
        "-e",
        "4K",
        "-w",
        "1",
        "-n",
        "2",
        "--paths",
        "host",
        "--min-busbw",
        "1e9",
    )
    assert proc.returncode == 1
    assert "< --min-busbw 1e+09" in proc.stdout and "Verdict: FAILED" in proc.stdout


def test_np_relaunches_itself_on_n_ranks():
    proc = ok(
        bench(
            0,
            "allreduce",
            "--np",
            "2",
            "-b",
            "8",
            "-e",
            "64",
            "-w",
            "1",
            "-n",
            "2",
            "--paths",
            "host,mpi",
            "--json",
            launcher=False,
        )
    )
    data = json.loads(proc.stdout)
    assert data["meta"]["ranks"] == 2 and data["verdict"]["ok"] is True


def test_unknown_path_is_a_usage_error():
    proc = bench(2, "allreduce", "--paths", "nvlink")
    assert proc.returncode == 2 and "not a collectives path" in proc.stderr


def test_p2p_host_buffers_osu_style():
    proc = ok(
        bench(
            2,
            "p2p",
            "-b",
            "1",
            "-e",
            "64K",
            "-f",
            "64",
            "-w",
            "2",
            "-n",
            "5",
            "--window",
            "8",
            "--paths",
            "cudampi,mpi,torch-gloo",
            "--buffers",
            "host",
            "--json",
        )
    )
    data = json.loads(proc.stdout)
    rows = data["results"]
    assert {r["path"] for r in rows} == {"cudampi", "mpi", "torch-gloo"}
    assert {r["size"] for r in rows} == {1, 64, 4096}
    assert all(r["wrong"] == 0 and r["latency_us"] > 0 and r["bw_mbps"] > 0 for r in rows)
    bad = bench(
        2,
        "p2p",
        "-b",
        "64",
        "-e",
        "64",
        "-n",
        "2",
        "--paths",
        "mpi",
        "--buffers",
        "host",
        "--corrupt-rank",
        "0",
    )
    assert bad.returncode == 1 and "Verdict: FAILED" in bad.stdout


def test_ddp_trains_and_ranks_agree(tmp_path):
    proc = ok(
        bench_ddp(
            2,
            "--paths",
            "local,torch-gloo,torch-cudampi,torch-cudampi-async",
            "--json",
            "--plot",
            str(tmp_path / "ddp.png"),
        ),
    )
    data = json.loads(proc.stdout)
    rows = {r["path"]: r for r in data["results"]}
    assert set(rows) == {"local", "torch-gloo", "torch-cudampi", "torch-cudampi-async"}
    assert all(
        rows[p]["wrong"] == 0 for p in ("torch-gloo", "torch-cudampi", "torch-cudampi-async")
    )
    assert rows["torch-gloo"]["vs_local"] > 0 and rows["local"]["samples_per_s"] > 0
    assert (tmp_path / "ddp.png").read_bytes()[:4] == b"\x89PNG"
    bad = bench_ddp(
        1,
        "--paths",
        "torch-gloo",
        "--corrupt-rank",
        "1",
    )
    assert bad.returncode == 1 and "parameters diverged across ranks on 1 tensors" in bad.stdout


def test_ddp_rounds_give_one_median_row_per_path_and_nocomm_is_unchecked(tmp_path):
    js = tmp_path / "ddp.json"
    proc = ok(
        bench_ddp(
            1,
            "--rounds",
            "2",
            "--paths",
            "ddp-nocomm,torch-gloo,local",
            "--json",
            str(js),
        ),
    )
    data = json.loads(js.read_text())
    assert data["meta"]["rounds"] == 2 and data["verdict"]["ok"] is True
    rows = [r["path"] for r in data["results"]]
    assert rows == ["local", "ddp-nocomm", "torch-gloo"]  # one row per path, local first
    by = {r["path"]: r for r in data["results"]}
    assert by["ddp-nocomm"]["wrong"] is None and by["ddp-nocomm"]["vs_local"] > 0
    assert by["torch-gloo"]["wrong"] == 0
    assert all(r["step_min_ms"] <= r["step_ms"] <= r["step_max_ms"] for r in by.values())
    assert "1 step x 2 rounds, the median round" in proc.stdout.splitlines()[0]
    # DDP's own defaults, as the DDP objects of the run reported them
    ddp = data["meta"]["models"]["transformer"]["ddp"]
    assert ddp["gradient_as_bucket_view"] is False and ddp["bucket_cap_mb"] == 25.0
    nocomm = next(line for line in proc.stdout.splitlines() if "ddp-nocomm" in line)
    assert nocomm.split()[-2].endswith("x") and nocomm.split()[-1] == "N/A"


def test_ddp_options_reach_every_ddp_path(tmp_path):
    js = tmp_path / "ddp.json"
    proc = ok(
        bench_ddp(
            2,
            "--paths",
            "local,torch-cudampi,torch-gloo",
            "--ddp-option",
            "gradient_as_bucket_view=true",
            "--ddp-option",
            "bucket_cap_mb=0.5",
            "--ddp-option",
            "static_graph=true",
            "--json",
            str(js),
        ),
    )
    data = json.loads(js.read_text())
    assert data["verdict"]["ok"] is True and {r["wrong"] for r in data["results"][1:]} == {0}
    assert data["meta"]["ddp_options"] == {
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 0.5,
        "static_graph": True,
    }
    ddp = data["meta"]["models"]["transformer"]["ddp"]  # what DDP itself runs with
    assert ddp["gradient_as_bucket_view"] is True and ddp["static_graph"] is True
    assert ddp["bucket_cap_mb"] == 0.5 and ddp["broadcast_buffers"] is True
    assert (
        "# DistributedDataParallel(gradient_as_bucket_view=True, bucket_cap_mb=0.5, "
        "static_graph=True) on every DDP path" in proc.stdout
    )


def test_started_plainly_it_runs_on_two_ranks_and_says_so(tmp_path):
    # As a user first types it: no launcher, no --np. It must move data between ranks (a
    # one-rank run reports busbw 0 and plots no line) and say how it ran.
    js, png = tmp_path / "plain.json", tmp_path / "plain.png"
    argv = [sys.executable, "-m", "cudampi", "bench", "allreduce", "--paths", "host,mpi"]
    argv += ["-b", "8", "-e", "64K", "-f", "8", "-w", "1", "-n", "3", "--device", "cpu"]
    argv += ["--json", str(js), "--plot", str(png)]
    proc = ok(
        subprocess.run(argv, capture_output=True, text=True, timeout=240, env=mpi_env(), cwd=ROOT)
    )
    assert (
        "# cudampi bench: started without a launcher: running on 2 ranks (the fewest between "
        "which data moves) through cudampi launch" in proc.stderr
    ), proc.stderr
    data = json.loads(js.read_text())
    assert data["meta"]["ranks"] == 2 and data["verdict"]["ok"] is True
    rows = [r for r in data["results"] if r["op"] == "allreduce"]
    assert {r["path"] for r in rows} == {"host", "mpi"}
    assert all(r["busbw"] > 0 for r in rows)  # what --plot draws a line through
    assert png.stat().st_size > 10_000


def test_np_1_runs_alone_and_says_what_that_measures(tmp_path):
    js = tmp_path / "one.json"
    argv = [sys.executable, "-m", "cudampi", "bench", "allreduce", "--paths", "mpi", "--np", "1"]
    argv += ["-b", "8", "-e", "64", "--device", "cpu", "--json", str(js)]
    proc = ok(
        subprocess.run(argv, capture_output=True, text=True, timeout=240, env=mpi_env(), cwd=ROOT)
    )
    assert "started without a launcher: 1 rank: nothing crosses ranks" in proc.stderr
    assert "# 1 rank: nothing crosses ranks, so busbw is 0" in proc.stdout
    assert "1 rank only: nothing crossed ranks (--np 2 for more)" in proc.stdout
    data = json.loads(js.read_text())
    assert data["verdict"]["one_rank"] is True
    assert all(r["spread"] >= 1.0 and "noisy" in r for r in data["results"])


def test_an_output_file_that_cannot_be_written_is_a_message_not_a_traceback():
    """A folder that does not exist is refused before anything runs; a file
    that fails at the end (here in /proc, writable to nobody) ends the job with its message."""
    proc = bench(2, "allreduce", "-b", "8", "-e", "8", "--json", "/proc/nope/x.json")
    assert proc.returncode == 2, proc.stderr
    assert "--json '/proc/nope/x.json': the folder '/proc/nope' does not exist" in proc.stderr
    proc = bench(
        2, "allreduce", "-b", "8", "-e", "8", "-n", "1", "--paths", "host", "--json", "/proc/x.json"
    )
    assert proc.returncode != 0 and "--json '/proc/x.json' cannot be written" in proc.stderr
    assert "Traceback" not in proc.stderr
