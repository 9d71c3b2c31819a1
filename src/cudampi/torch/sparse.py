"""Sparse COO tensors in ``all_reduce``, summed as gloo sums them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from cudampi.errors import MismatchError

if TYPE_CHECKING:
    from cudampi.comm import Communicator


def allreduce_sparse(comm: Communicator, t: torch.Tensor) -> None:
    """Sum sparse COO tensors (ReduceOp.SUM) as gloo does: gather every rank's indices and
    values, add them up (``coalesce``) and put the result, coalesced, in ``t`` on every rank."""
    x = t.coalesce()
    nnz, sparse_dim = x._nnz(), x.sparse_dim()
    mine = [sparse_dim, *x.shape]
    metas = comm.allgather(torch.tensor([nnz, *mine], dtype=torch.int64))
    if any(m[1:].tolist() != mine for m in metas):
        odd = next(i for i, m in enumerate(metas) if m[1:].tolist() != mine)
        raise MismatchError(
            f"all_reduce of sparse tensors: rank {comm.rank} has shape {list(x.shape)} "
            f"with {sparse_dim} sparse dims, rank {odd} shape {metas[odd][2:].tolist()} "
            f"with {int(metas[odd][1])}. Every rank must pass a sparse tensor of the same "
            "shape and sparse dims."
        )
    nnzs = [int(m[0]) for m in metas]
    row = math.prod(x.shape[sparse_dim:])  # elements per entry (dense dims of a hybrid)
    # Every rank's entries, one after another (nnz-major, so allgatherv concatenates them).
    idx = comm.allgatherv(x.indices().t().contiguous().view(-1), [n * sparse_dim for n in nnzs])
    vals = comm.allgatherv(x.values().contiguous().view(-1), [n * row for n in nnzs])
    total = sum(nnzs)
    summed = torch.sparse_coo_tensor(
        idx.view(total, sparse_dim).t(),
        vals.view(total, *x.shape[sparse_dim:]),
        x.shape,
        dtype=x.dtype,
        device=x.device,
    ).coalesce()
    t.copy_(summed)
