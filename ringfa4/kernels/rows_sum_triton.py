"""Sums of gathered rows in one pass: ``out[dst[i]] = sum_j src[idx[j]]`` over ``ptr[i] <= j < ptr[i + 1]``.

The all-gather mode's backward ends with every travelling key row's dK / dV as the sum of the
pieces that came back for it (the rank's own slot, each receiver's return). Added one contributor
at a time, every add reads and writes the whole destination again (3 passes a contributor) and a
final cast reads it once more; here each output row is read from its contributors once and written
once, in the output's dtype (the rounding to bf16 happens once, after an fp32 sum in a fixed
order). The index is a CSR list built once per pack (:meth:`~ringfa4.parallel.allgather.AllGatherSchedule.return_sums`).

Triton on CUDA (and under ``TRITON_INTERPRET=1`` on the CPU, which is how CI tests the kernel);
elsewhere an ``index_add_`` into a zeroed accumulator of the source dtype and a copy.
"""

from __future__ import annotations

import functools

import torch

from .host_copy import to_device
from .tape import launch

__all__ = ["RowSums", "sum_rows_", "sum_rows_triton_"]


class RowSums:
    """A CSR list of row sums: ``dst (n,)`` int64 output rows, ``ptr (n + 1,)`` int64 and ``idx
    (nnz,)`` int64 source rows (contributors of output ``i``: ``idx[ptr[i]:ptr[i + 1]]``, summed
    in that order), all on one device."""

    def __init__(self, dst: torch.Tensor, ptr: torch.Tensor, idx: torch.Tensor) -> None:
        self.dst, self.ptr, self.idx = dst, ptr, idx

    @classmethod
    def from_spans(cls, spans: list[tuple[int, int, int]], device: torch.device | str = "cpu") -> RowSums:
        """From ``(dst_row, n, src_row)`` spans (rows ``[dst_row, dst_row + n)`` get rows ``[src_row,
        src_row + n)``; a span with ``src_row < 0`` only lists its output rows, contributing
        nothing: they are written zero unless another span adds to them). Contributors of a row
        are summed in the order of the spans. Built on the host; moved to a CUDA ``device`` from
        pinned memory without a stream sync."""
        if not spans:
            empty = torch.zeros(0, dtype=torch.int64)
            return cls(*(to_device(t, device) for t in (empty, torch.zeros(1, dtype=torch.int64), empty)))
        n = torch.tensor([s[1] for s in spans], dtype=torch.int64)
        start = torch.repeat_interleave(torch.tensor([s[0] for s in spans], dtype=torch.int64), n)
        src0 = torch.tensor([s[2] for s in spans], dtype=torch.int64)
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        dst_all = start + within
        src_all = torch.repeat_interleave(src0, n) + within
        real = torch.repeat_interleave(src0 >= 0, n)
        order = torch.sort(dst_all, stable=True).indices  # by output row; spans' order kept within one
        dst_all, src_all, real = dst_all[order], src_all[order], real[order]
        rows, counts = torch.unique_consecutive(dst_all, return_counts=True)
        per_row = torch.zeros(rows.numel(), dtype=torch.int64)
        per_row.index_add_(0, torch.repeat_interleave(torch.arange(rows.numel()), counts), real.long())
        ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(per_row, 0)])
        return cls(*(to_device(t, device) for t in (rows, ptr, src_all[real])))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sum_rows_kernel(OUT, SRC, DST, PTR, IDX, W, s_out, s_src, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < W
        a = tl.load(PTR + i)
        b = tl.load(PTR + i + 1)
        acc = tl.zeros([BLOCK], dtype=SRC.dtype.element_ty)
        for j in range(a, b):
            row = tl.load(IDX + j)
            acc += tl.load(SRC + row * s_src + cols, mask=mask, other=0.0)
        dst = tl.load(DST + i)
        tl.store(OUT + dst * s_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)

    return sum_rows_kernel


def sum_rows_triton_(out: torch.Tensor, src: torch.Tensor, sums: RowSums) -> bool:
    """The Triton kernel of :func:`sum_rows_` (on the tensors' device: CUDA, or the CPU under
    ``TRITON_INTERPRET=1``). Returns False, doing nothing, where the inputs don't fit it: ``src``
    float32 / float64, each row of ``out`` and ``src`` dense, the same row shape."""
    def rows_dense(x):
        return x.dim() >= 1 and x.shape[0] > 0 and (x.dim() == 1 or x[0].is_contiguous())
    if src.dtype not in (torch.float32, torch.float64) or out.shape[1:] != src.shape[1:] or not rows_dense(out) \
            or not rows_dense(src):
        return False
    import triton

    width = src[0].numel()
    block = min(1024, triton.next_power_of_2(max(width, 16)))
    launch(_kernel()[(sums.dst.numel(), triton.cdiv(width, block))], out, src, sums.dst, sums.ptr, sums.idx, width,
                                                             out.stride(0), src.stride(0), BLOCK=block, num_warps=4)
    return True


def sum_rows_(out: torch.Tensor, src: torch.Tensor, sums: RowSums) -> torch.Tensor:
    """``out[sums.dst[i]] = sum of src[sums.idx[j]]`` over ``sums.ptr[i] <= j < sums.ptr[i + 1]``
    (``out (rows, ...)`` any float dtype, ``src (rows_s, ...)`` float32 / float64 (the
    accumulation dtype), same row shape); summed in ``src``'s dtype in the listed order, written
    once in ``out``'s; rows of ``out`` not in ``sums.dst`` are untouched. One Triton pass on CUDA
    (:func:`sum_rows_triton_`), else an ``index_add_`` and an ``index_copy_``."""
    n = sums.dst.numel()
    if n == 0 or (out.is_cuda and sum_rows_triton_(out, src, sums)):
        return out
    acc = torch.zeros((n,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    owner = torch.repeat_interleave(torch.arange(n, device=src.device), sums.ptr.diff())
    acc.index_add_(0, owner, src.index_select(0, sums.idx))
    out.index_copy_(0, sums.dst, acc.to(out.dtype))
    return out
