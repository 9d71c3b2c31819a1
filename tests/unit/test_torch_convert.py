"""Pure pieces of the torch backend: ReduceOp mapping, split sizes, launcher detection, futures."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from cudampi.errors import CommError  # noqa: E402  (after the skip: cudampi.torch needs torch)
from cudampi.torch.convert import TORCH_REDUCE_OPS, check_dtype, element_counts, reduce_spec  # noqa: E402
from cudampi.torch.rendezvous import (  # noqa: E402
    mpi_launcher,
    needs_mpi_rendezvous,
    singleton_message,
)

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("SUM", "sum"),
        ("PRODUCT", "prod"),
        ("MIN", "min"),
        ("MAX", "max"),
        ("BAND", "band"),
        ("BOR", "bor"),
        ("BXOR", "bxor"),
        ("AVG", "avg"),
    ],
)
def test_every_reduce_op_maps_from_the_enum_and_from_options(name, op):
    red = getattr(dist.ReduceOp, name)
    assert reduce_spec(red).op == op
    opts = dist.AllreduceOptions()
    opts.reduceOp = red  # what torch hands a process group: a ReduceOp wrapping the enum
    spec = reduce_spec(opts.reduceOp)
    assert (spec.torch_name, spec.op, spec.premul) == (name, op, None)


def test_every_torch_reduce_op_is_known():
    assert set(dist.ReduceOp.RedOpType.__members__) == set(TORCH_REDUCE_OPS)


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_premul_sum_keeps_its_factor(factor):
    spec = reduce_spec(dist._make_nccl_premul_sum(factor))
    assert (spec.op, spec.premul) == ("sum", factor)
    t = torch.tensor([0.25])
    spec = reduce_spec(dist._make_nccl_premul_sum(t))
    assert spec.op == "sum" and torch.equal(spec.premul, t)


def test_unknown_op_and_bitwise_float_are_clear_errors():
    with pytest.raises(CommError, match="not one cudampi knows"):
        reduce_spec(object())
    with pytest.raises(CommError, match="bitwise reductions need integer"):
        check_dtype(reduce_spec(dist.ReduceOp.BXOR), torch.float32)
    check_dtype(reduce_spec(dist.ReduceOp.BXOR), torch.int64)
    check_dtype(reduce_spec(dist.ReduceOp.BAND), torch.bool)


def test_split_sizes_become_element_counts():
    assert element_counts([], [6, 3], 3, "input") == [6, 6, 6]
    assert element_counts([1, 2, 3], [6, 3], 3, "input") == [3, 6, 9]
    with pytest.raises(CommError, match="does not split evenly"):
        element_counts([], [5, 2], 2, "input")
    with pytest.raises(CommError, match="summing to the first dimension 6"):
        element_counts([1, 1, 1], [6], 3, "output")


@pytest.mark.parametrize(
    ("env", "want"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
            ("Open MPI mpirun/prterun", 1, 4),
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, ("MPICH/Hydra mpiexec", 0, 2)),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}, ("Slurm srun", 3, 8)),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, None),  # an sbatch shell, not a task
        ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}, None),  # torchrun
        ({}, None),
    ],
)
def test_mpi_launcher_detection(env, want):
    assert mpi_launcher(env) == want


def test_env_fallback_only_where_env_would_fail_under_mpi():
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    assert needs_mpi_rendezvous("env://", mpi)
    full = {**mpi, "MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}
    assert not needs_mpi_rendezvous("env://", full)  # torchrun-style variables: stock env://
    assert not needs_mpi_rendezvous("env://", {"RANK": "0"})  # no MPI launcher: stock error
    partial = {**mpi, "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert needs_mpi_rendezvous("env://", partial)
    assert not needs_mpi_rendezvous("env://?rank=0&world_size=2", partial)


def test_singleton_message_names_the_fix():
    msg = singleton_message(4)
    assert "MPI singleton" in msg and "cudampi launch -n 4" in msg and "mpirun -n 4" in msg


def test_completed_work_futures_hold_typed_tensor_lists():
    from cudampi.torch.work import completed_future, completed_work

    t = [torch.ones(2)]
    fut = completed_future(t)
    assert fut.done() and fut.value()[0] is t[0]
    work = completed_work(t)
    assert work.wait() and work.is_completed()
    assert work.get_future().value()[0] is t[0]
    chained = work.get_future().then(lambda f: f.value()[0] + 1)
    assert torch.equal(chained.wait(), torch.full((2,), 2.0))
    assert completed_future([]).value() == []
    assert completed_future(None).value() is None


def test_register_is_idempotent_and_declares_both_devices():
    import cudampi.torch

    cudampi.torch.register()
    cudampi.torch.register()
    assert "cudampi" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["cudampi"] == ["cpu", "cuda"]
    import importlib

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    assert "cudampi" in handlers and getattr(handlers["env"], "_cudampi_wrapped", False)
