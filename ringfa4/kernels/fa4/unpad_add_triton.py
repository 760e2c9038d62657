"""Fused unpad-and-add (Triton) for FA4's padded, tile-permuted fp32 gradient accumulators.

FA4's varlen backward leaves dQ / dK / dV in ``accum (heads, pad * d_r)`` float32: packed row
``i`` sits at padded row ``p = prow[i]`` (each document starts on a tile boundary), and inside its
tile of ``tile`` rows the element (row ``p % tile``, column ``c < d``) is at flat offset
``order[(p % tile) * d + c]`` (FA4's in-tile order, read from its own postprocess). This kernel
does ``acc[i, h, c] += scale * accum[h, (p // tile) * tile * d_r + order[...]]`` in one pass: it
reads the accumulator and the destination once and writes the destination once, where torch needs
an int64 index of every element, a gathered copy and a strided add (about 2.3x the bytes). Its
``store`` form writes ``scale * accum[...]`` in the destination's dtype without reading it (rows
that one block alone contributes to: :class:`~ringfa4.kernels.spec.Written`).
Runs under ``TRITON_INTERPRET=1`` on the CPU, which is how CI tests it.
"""

from __future__ import annotations

import functools

import torch

from ..tape import launch

__all__ = ["unpad_add_triton_"]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def unpad_add_kernel(ACC, ACCUM, PROW, ORDER, n_rows, D, scale,
                         s_row, s_head, s_ahead, TILE: tl.constexpr, TILE_ELEMS: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        head = tl.program_id(1)
        rmask = rows < n_rows
        p = tl.load(PROW + rows, mask=rmask, other=0).to(tl.int64)
        tile_base = (p // TILE) * TILE_ELEMS
        within = p % TILE
        c = tl.arange(0, BLOCK_D)
        mask2 = rmask[:, None] & (c < D)[None, :]
        offs = tl.load(ORDER + within[:, None] * D + c[None, :], mask=mask2, other=0)
        val = tl.load(ACCUM + head.to(tl.int64) * s_ahead + tile_base[:, None] + offs, mask=mask2, other=0.0)
        dst = ACC + rows.to(tl.int64)[:, None] * s_row + head * s_head + c[None, :]
        if STORE:  # the rows written (in the destination's dtype), not read
            tl.store(dst, (scale * val).to(ACC.dtype.element_ty), mask=mask2)
        else:
            tl.store(dst, tl.load(dst, mask=mask2, other=0.0) + scale * val, mask=mask2)

    return unpad_add_kernel


def unpad_add_triton_(acc: torch.Tensor, accum: torch.Tensor, prow: torch.Tensor, order: torch.Tensor,
                      tile: int, d_r: int, scale: float, store: bool = False) -> bool:
    """``acc (total, heads, d) float32 += scale *`` the packed rows of ``accum (heads, pad * d_r)``
    float32 (contiguous), ``prow (total,)`` int32 / int64 padded rows, ``order (tile * d,)`` int32
    / int64 in-tile offsets (a tile holds ``tile * d_r`` elements; int32 indices read faster: 64
    against 73 us for 22k rows of 8 heads on the H200). With ``store``, ``acc`` (float32, bfloat16
    or float16) gets them written instead, never read. Returns False, doing nothing, where the inputs
    don't fit the kernel (``acc`` of those dtypes with last-dim stride 1, ``accum`` contiguous
    fp32, d <= 256)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if store else (torch.float32,)
    if acc.dim() != 3 or acc.dtype not in dtypes or accum.dtype != torch.float32 or acc.stride(-1) != 1 or \
            not accum.is_contiguous() or acc.shape[-1] > 256 or accum.shape[0] != acc.shape[1]:
        return False
    import triton

    _, heads, d = acc.shape
    total = prow.numel()
    if total == 0 or heads == 0:
        return True
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(16, 2048 // block_d))  # measured best on the H200 (d = 128: 16 rows, 57 against 73 us)
    grid = (triton.cdiv(total, block_r), heads)
    launch(_kernel()[grid], acc, accum, prow, order, total, d, float(scale), acc.stride(0), acc.stride(1),
           accum.stride(0), TILE=tile, TILE_ELEMS=tile * d_r, BLOCK_R=block_r, BLOCK_D=block_d, STORE=store,
           num_warps=4)
    return True
