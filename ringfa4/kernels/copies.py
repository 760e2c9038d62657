"""Many tensor copies in as few launches as the data allows.

``torch._foreach_copy_`` copies a list in one multi-tensor launch on CUDA where every pair shares
one dtype (and device); lists of mixed dtypes fall back to one copy a pair. :func:`one_dtype` turns
pieces of several dtypes into byte views of the same memory where it can (a ring hop's bf16 K / V
beside fp32 dK / dV), and :func:`copy_all` copies any list in one launch a dtype at most: the
CUDA-graph replays' static inputs and their outputs' copies, the loopback hops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_all", "one_dtype"]


def one_dtype(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> tuple[tuple, tuple]:
    """``dsts, srcs`` (pairs of one shape) of several dtypes as byte views of the same memory, so one
    multi-tensor copy moves them all, as one NCCL batch does; unchanged (as given) where they share a
    dtype, where a pair differs in dtype, or where a piece's last dim is strided (no byte view)."""
    first, mixed = srcs[0].dtype, False
    for d, s in zip(dsts, srcs):
        if d.dtype != s.dtype:
            return dsts, srcs
        mixed = mixed or s.dtype != first
    if not mixed:
        return dsts, srcs
    try:
        return tuple([d.view(torch.uint8) for d in dsts]), tuple([s.view(torch.uint8) for s in srcs])
    except RuntimeError:
        return dsts, srcs


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i`` (pairs of one shape and dtype), ordered on the current
    stream: one multi-tensor copy where the pieces share a dtype or go as bytes (:func:`one_dtype`),
    else one a dtype."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_all: {len(dsts)} destinations for {len(srcs)} sources")
    if not dsts:
        return
    dsts, srcs = one_dtype(dsts, srcs)
    dtypes = {d.dtype for d in dsts} | {s.dtype for s in srcs}
    if len(dtypes) == 1:
        torch._foreach_copy_(list(dsts), list(srcs))
        return
    groups: dict[tuple, tuple[list, list]] = {}
    for d, s in zip(dsts, srcs):
        ds, ss = groups.setdefault((d.dtype, s.dtype), ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)
