"""`cudampi bench fsdp` on 2 real ranks (CPU): FSDP2 trains the bench's transformer on gloo and
on cudampi to the same loss and parameters, its check catches a parameter that moved wrongly,
and the whole mode runs end to end (table, JSON, the FSDP2/DDP and vs-gloo ratios)."""

from __future__ import annotations

import json

import pytest

from tests.mpi.test_bench_cli import bench, ok
from tests.mpirun import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api, "fully_shard"):
    pytest.skip(
        "FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6", allow_module_level=True
    )


def rank_fsdp_gloo_vs_cudampi(comm):
    """The bench's own wrapper (one fully_shard per encoder layer, then the root) on a gloo
    group and on the cudampi default group: the same losses and full parameters after two
    steps, both moved as the reference did, and a shard element moved by hand is caught."""
    from types import SimpleNamespace

    import torch

    from cudampi.bench import fsdp, train
    from cudampi.bench.adapters import Skip
    from cudampi.bench.session import open_session

    s = open_session(comm, "cpu")
    s.torch_default = "cudampi"
    cpu = torch.device("cpu")
    o = SimpleNamespace(
        warmup=1, iters=1, corrupt_rank=None, quiet=True, image_size=None, ddp_options=()
    )
    method = fsdp.FSDPMethod({}, check=True)
    method.prepare(s, o, "transformer", cpu, 2)
    assert (method.reference["transformer"][:, 1] > 0).all(), "the reference did not train"
    assert not method.spread["transformer"].any(), "the CPU reference ran once, its spread 0"
    losses, params, models = {}, {}, {}
    for path in ("torch-gloo", "torch-cudampi"):
        w = train.build("transformer", cpu, 2, None, s.rank)
        net = method.wrap(s, path, w, cpu)
        assert method.settings(path, net) == ("fsdp", {"units": 3})  # 2 layers + the root
        opt = train.make_optimizer(net.parameters())
        losses[path] = []
        for _ in range(train.steps_per_pass(o)):
            x, y = w.make_batch()
            opt.zero_grad(set_to_none=True)
            loss = w.loss(net(x), y)
            loss.backward()
            opt.step()
            losses[path].append(float(loss))
        assert method.wrong(s, o, path, w) == 0, f"{path}: parameters moved unlike the reference"
        params[path] = [p.full_tensor().detach().clone() for p in w.model.parameters()]
        models[path] = w
    assert losses["torch-cudampi"] == pytest.approx(losses["torch-gloo"], rel=1e-6, abs=1e-7)
    for i, (a, b) in enumerate(zip(params["torch-cudampi"], params["torch-gloo"])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"parameter {i}")
    corrupt = SimpleNamespace(**{**vars(o), "corrupt_rank": 1})
    assert method.wrong(s, corrupt, "torch-cudampi", models["torch-cudampi"]) == 1
    # a DDP replica that strays on rank 1 only: rank 0 names it, and rank 1
    w = train.build("transformer", cpu, 2, None, s.rank)
    net = method.wrap(s, "ddp-torch-cudampi", w, cpu)
    train._steps(net, train.make_optimizer(net.parameters()), w, train.steps_per_pass(o))
    assert method.wrong(s, o, "ddp-torch-cudampi", w) == 0
    assert method.wrong(s, corrupt, "ddp-torch-cudampi", w) == 1

    # a reference that cannot be made (ResNet-50 without torchvision, ...) skips every path of
    # that model with the reason, on every rank, instead of ending the job
    class NoReference(fsdp.FSDPMethod):
        def prepare(self, s, o, kind, device, batch):
            if s.rank == 1:
                raise Skip("no reference here")

    run = SimpleNamespace(**{**vars(o), "paths": ("local", "torch-gloo"), "model": "transformer"})
    run = SimpleNamespace(**{**vars(run), "rounds": 1, "check": True, "batch": 1})
    rows, skips, _ = train.run(s, run, NoReference({}, check=True))
    reason = "rank 1: no reference here"
    assert rows == [] and skips == [("transformer", p, reason) for p in run.paths], skips
    s.close()
    if comm.rank == 0:
        print(f"FSDP2 gloo and cudampi agree: losses {losses['torch-cudampi']}", flush=True)


def test_fsdp2_on_cudampi_trains_as_on_gloo_and_the_check_catches_a_wrong_shard():
    proc = run_mpi(2, __file__, "rank_fsdp_gloo_vs_cudampi", timeout=240)
    assert "FSDP2 gloo and cudampi agree" in proc.stdout
    # rank 0 names the parameter the corrupted shard belongs to
    first = "# fsdp torch-cudampi transformer: 1 parameter(s) moved unlike the reference; "
    assert first + "furthest: " in proc.stderr, proc.stderr[-3000:]
    ddp = "# fsdp ddp-torch-cudampi transformer: 1 parameter(s) moved unlike the reference; "
    name = "furthest: 0.self_attn.in_proj_weight on rank 1, "  # the parameter rank 1 changed
    assert ddp + name in proc.stderr, proc.stderr[-3000:]


def test_bench_fsdp_reports_every_path_the_ratios_and_a_verdict(tmp_path):
    js = tmp_path / "fsdp.json"
    paths = "local,torch-gloo,torch-cudampi,ddp-torch-cudampi"
    proc = ok(
        bench(2, "fsdp", "-w", "1", "-n", "1", "--batch", "1", "--paths", paths, "--json", str(js))
    )
    data = json.loads(js.read_text())
    assert data["kind"] == "cudampi-bench-fsdp" and data["verdict"] == {"ok": True, "wrong": 0}
    rows = {r["path"]: r for r in data["results"]}
    assert list(rows) == paths.split(",")
    assert rows["local"]["wrong"] is None
    assert all(rows[p]["wrong"] == 0 and rows[p]["vs_local"] > 0 for p in paths.split(",")[1:])
    about = data["meta"]["models"]["transformer"]
    assert about["fsdp"] == {"units": 3} and about["ddp"]["bucket_cap_mb"] == 25.0
    rate = {p: r["samples_per_s"] for p, r in rows.items()}
    assert about["ratios"]["fsdp_vs_ddp"] == {
        "torch-cudampi": pytest.approx(rate["torch-cudampi"] / rate["ddp-torch-cudampi"])
    }
    assert about["ratios"]["fsdp_vs_gloo"] == {
        "torch-cudampi": pytest.approx(rate["torch-cudampi"] / rate["torch-gloo"])
    }
    text = proc.stdout.splitlines()
    assert text[0] == "# cudampi bench fsdp: ranks 2; device cpu"
    assert any(
        line.startswith("# FSDP2 / DDP on the same backend: torch-cudampi ") for line in text
    )
    assert any(line.startswith("# FSDP2 / torch-gloo's FSDP2: torch-cudampi ") for line in text)
    assert text[-1] == "# Verdict: OK: 4 rows, 0 skipped"
