"""Fused LSE merge for CUDA tensors (Triton): one pass that reads the fp32 accumulator and the
block result once and writes the accumulator once, instead of torch's ~8 elementwise passes.

Same guarded math as :func:`ringfa4.kernels.merge.merge_lse_` in the max-subtracted form:
``m = max(lse_acc, lse_blk)``, ``w_x = exp(lse_x - m)`` (0 for a side at -inf; m = -inf rows
leave out 0 and lse -inf). Works on strided views (last dim contiguous), e.g. zigzag halves.
Runs under ``TRITON_INTERPRET=1`` on the CPU, which is how CI tests it.
"""

from __future__ import annotations

import functools

import torch

from .tape import launch

__all__ = ["merge_lse_triton_", "triton_merge_available"]


@functools.cache
def triton_merge_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(O, L, OB, LB, n_rows, S, H, D,
                     so_b, so_s, so_h, sl_b, sl_h, sl_s, sob_b, sob_s, sob_h, slb_b, slb_h, slb_s,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # rows ordered (b, h, s) with s fastest: lse loads are contiguous, each out row is one
        # contiguous run of D elements
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        s = rows % S
        h = (rows // S) % H
        b = rows // (H * S)
        l_ptr = L + b * sl_b + h * sl_h + s * sl_s
        la = tl.load(l_ptr, mask=rmask, other=-float("inf")).to(tl.float32)
        lb = tl.load(LB + b * slb_b + h * slb_h + s * slb_s, mask=rmask, other=-float("inf")).to(tl.float32)
        m = tl.maximum(la, lb)
        empty = m == -float("inf")
        m_safe = tl.where(empty, 0.0, m)
        wa = tl.exp(la - m_safe)
        wb = tl.exp(lb - m_safe)
        total = wa + wb
        denom = tl.where(empty, 1.0, total)
        ca = wa / denom
        cb = wb / denom
        new = tl.where(empty, -float("inf"), m_safe + tl.log(denom))
        d = tl.arange(0, BLOCK_D)
        mask2 = rmask[:, None] & (d < D)[None, :]
        o_ptr = O + (b * so_b + s * so_s + h * so_h)[:, None] + d[None, :]
        ob_ptr = OB + (b * sob_b + s * sob_s + h * sob_h)[:, None] + d[None, :]
        o = tl.load(o_ptr, mask=mask2, other=0.0)
        ob = tl.load(ob_ptr, mask=mask2, other=0.0).to(tl.float32)
        tl.store(o_ptr, o * ca[:, None] + ob * cb[:, None], mask=mask2)
        tl.store(l_ptr, new, mask=rmask)

    return merge_kernel


def _as4(out: torch.Tensor, lse: torch.Tensor):
    if out.dim() == 3:  # varlen (t, h, d) / (h, t)
        return out.unsqueeze(0), lse.unsqueeze(0)
    return out, lse


def merge_lse_triton_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor,
                      lse_blk: torch.Tensor) -> bool:
    """Fused in-place merge; returns False (doing nothing) when the inputs don't fit the kernel:
    fp32 accumulator, last dims contiguous, head_dim <= 256."""
    if out_acc.dtype != torch.float32 or lse_acc.dtype != torch.float32:
        return False
    if out_acc.stride(-1) != 1 or out_blk.stride(-1) != 1 or out_acc.shape[-1] > 256:
        return False
    import triton

    o, l = _as4(out_acc, lse_acc)
    ob, lb = _as4(out_blk, lse_blk)
    B, S, H, D = o.shape
    n_rows = B * S * H
    if n_rows == 0:
        return True
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(64, 4096 // block_d))
    grid = (triton.cdiv(n_rows, block_r),)
    launch(_kernel()[grid], o, l, ob, lb, n_rows, S, H, D,
                    o.stride(0), o.stride(1), o.stride(2), l.stride(0), l.stride(1), l.stride(2),
                    ob.stride(0), ob.stride(1), ob.stride(2), lb.stride(0), lb.stride(1), lb.stride(2),
                    BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return True
