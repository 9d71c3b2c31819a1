"""Tensor plumbing of the cudampi process group: contiguous views, flattening a group of tensors
into one buffer and back, PREMUL_SUM's factor, the size checks of the ``*_tensor`` calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cudampi.errors import CommError


def contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src is not dst:
        dst.copy_(src.view(dst.shape) if src.numel() == dst.numel() else src)


def premul(x: torch.Tensor, factor: Any, *, in_place: bool) -> torch.Tensor:
    if factor is None:
        return x
    if isinstance(factor, torch.Tensor) and factor.device != x.device:
        # A host factor is read on the host (no copy to the GPU: that would block the host,
        # which CUDA graph capture forbids); a device factor for host data is read back.
        factor = factor.item()
    return x.mul_(factor) if in_place else x * factor


def first_cuda(args: Any) -> torch.Tensor | None:
    """The first CUDA tensor among ``args`` (nested lists allowed), or None."""
    if not torch.cuda.is_initialized():  # no CUDA tensor can exist yet
        return None
    stack = [args]
    while stack:
        item = stack.pop(0)
        if isinstance(item, (list, tuple)):
            stack[:0] = list(item)
        elif isinstance(item, torch.Tensor) and item.is_cuda:
            return item
    return None


def kinds(tensors: Sequence[torch.Tensor], *, index: bool = False) -> list[list[Any]]:
    """``tensors`` in groups of one device and dtype (the order of first appearance, the same on
    every rank), as tensors or, with ``index``, as their positions."""
    groups: dict[tuple[torch.device, torch.dtype], list[Any]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i if index else t)
    return list(groups.values())


def flatten(group: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat buffer of ``group`` (same device and dtype); a lone contiguous tensor is used as
    it is, so a single-tensor call moves the caller's memory in place."""
    if len(group) == 1 and group[0].is_contiguous():
        return group[0].view(-1)
    return torch.cat([t.reshape(-1) for t in group])


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair: torch's foreach copy (few kernel launches) where the
    pairs allow it."""
    pairs = [(d, s) for d, s in zip(dsts, srcs) if d.numel()]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def unflatten(flat: torch.Tensor, group: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` back into the tensors of ``group``."""
    if len(group) == 1 and group[0].is_contiguous() and flat.data_ptr() == group[0].data_ptr():
        return  # _flatten used the tensor itself
    dsts, srcs, offset = [], [], 0
    for t in group:
        n = t.numel()
        dsts.append(t)
        srcs.append(flat[offset : offset + n].view(t.shape))
        offset += n
    copy_all(dsts, srcs)


def unflatten_columns(
    block: torch.Tensor, outs: Sequence[torch.Tensor], counts: Sequence[int]
) -> None:
    """``block`` is (size, sum(counts)); output i gets columns of width ``counts[i]``, row by row
    (rank after rank): all_gather_into_tensor's layout."""
    size = block.shape[0]
    dsts, srcs, offset = [], [], 0
    for out, n in zip(outs, counts):
        cols = block[:, offset : offset + n]
        if out.is_contiguous():
            dsts.append(out.view(size, n))
            srcs.append(cols)
        else:
            dsts.append(out)
            srcs.append(cols.reshape(out.shape))
        offset += n
    copy_all(dsts, srcs)


def check_gather_sizes(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    if output.numel() != size * input.numel():
        raise CommError(
            f"all_gather_into_tensor: output has {output.numel()} elements, expected "
            f"{size} x {input.numel()} (group size x input). Fix the output size."
        )


def check_scatter_sizes(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    if input.numel() != size * output.numel():
        raise CommError(
            f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
            f"{size} x {output.numel()} (group size x output). Fix the input size."
        )
