"""The online-softmax merge of partial attention results (torch version; any device).

Given an fp32 accumulator ``(out_acc (b, s, h, d), lse_acc (b, h, s))`` and a block result
``(out_blk, lse_blk)`` over other keys of the same rows::

    new = logaddexp(lse_acc, lse_blk)
    out_acc = exp(lse_acc - new) * out_acc + exp(lse_blk - new) * out_blk
    lse_acc = new

guarded so that a side at -inf contributes nothing and two -inf sides leave (out 0, lse -inf),
never NaN. (The sigmoid form ``out -= sigmoid(lse_blk - lse) * (out - out_blk)`` is NaN on an
accumulator at -inf.) All arguments may be views (e.g. one zigzag half of the accumulator); varlen
tensors ``out (t, h, d)``, ``lse (h, t)`` work too. On CUDA a fused kernel does it in
one pass: ours in CuTe DSL (:mod:`.cute_merge`), else Triton (:mod:`.merge_triton`);
``impl="cute"|"triton"|"torch"`` forces one (``"auto"``: the first that takes the call; the ring
passes ``RingOptions.merge_kernel``).

The planes form (:func:`merge_planes_`) keeps the running lse as ``planes (b, h, 2, s)`` float32:
plane 0 is M (the largest block lse so far), plane 1 is S = sum_i exp(lse_i - M), so
lse = M + log S (:func:`planes_lse`) is rounded once at the end instead of once per merge. It is
what FA4's merging epilogue (:mod:`.fa4_merge`) does; this is its torch version.
"""

from __future__ import annotations

import math

import torch

from .cute_merge import cute_merge_available, merge_lse_cute_
from .merge_triton import merge_lse_triton_, triton_merge_available

__all__ = ["MERGE_IMPLS", "fresh_planes", "merge_lse", "merge_lse_", "merge_lse_torch_", "merge_planes_",
           "planes_lse"]

MERGE_IMPLS = ("auto", "cute", "triton", "torch")


def _weights(lse_acc: torch.Tensor, lse_blk: torch.Tensor):
    new = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(new == -math.inf, torch.zeros_like(new), new)
    return new, torch.exp(lse_acc - safe), torch.exp(lse_blk - safe)


def _to_rows(w: torch.Tensor) -> torch.Tensor:
    """lse layout (..., h, s) -> out layout (..., s, h, 1)."""
    return w.transpose(-1, -2).unsqueeze(-1)


def _check(out_acc, lse_acc, out_blk, lse_blk):
    if out_blk.shape != out_acc.shape:
        raise ValueError(f"out_blk must have out_acc's shape {tuple(out_acc.shape)}, got {tuple(out_blk.shape)}")
    expected = out_acc.shape[:-3] + (out_acc.shape[-2], out_acc.shape[-3])
    for name, t in (("lse_acc", lse_acc), ("lse_blk", lse_blk)):
        if tuple(t.shape) != tuple(expected):
            raise ValueError(f"{name} must have shape {tuple(expected)} (…, h, s), got {tuple(t.shape)}")
    if not out_acc.dtype.is_floating_point or out_acc.dtype in (torch.float16, torch.bfloat16):
        raise ValueError(f"out_acc must be float32 or float64 (an accumulator), got {out_acc.dtype}")


def merge_lse_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor,
               lse_blk: torch.Tensor, impl: str = "auto") -> None:
    """Merge ``(out_blk, lse_blk)`` into the fp32 accumulator ``(out_acc, lse_acc)`` in place;
    ``impl``: one of :data:`MERGE_IMPLS` (on CUDA; the CPU always runs torch)."""
    if impl not in MERGE_IMPLS:
        raise ValueError(f"merge impl must be one of {MERGE_IMPLS}, got {impl!r}")
    _check(out_acc, lse_acc, out_blk, lse_blk)
    if out_acc.is_cuda:
        which = impl
        if which in ("auto", "cute") and cute_merge_available() and merge_lse_cute_(out_acc, lse_acc, out_blk,
                                                                                     lse_blk):
            return
        if which in ("auto", "triton") and triton_merge_available() and merge_lse_triton_(out_acc, lse_acc, out_blk,
                                                                                          lse_blk):
            return
    merge_lse_torch_(out_acc, lse_acc, out_blk, lse_blk)


def merge_lse_torch_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor,
                     lse_blk: torch.Tensor) -> None:
    """The torch version of :func:`merge_lse_` (any device; the fallback of the fused kernel)."""
    new, w_acc, w_blk = _weights(lse_acc, lse_blk.to(lse_acc.dtype))
    out_acc.mul_(_to_rows(w_acc).to(out_acc.dtype))
    out_acc.add_(out_blk.to(out_acc.dtype) * _to_rows(w_blk).to(out_acc.dtype))
    lse_acc.copy_(new)


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place merge: returns a new fp32 (float64 if an input is) ``(out, lse)``."""
    dt = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), torch.float32)
    out = out_a.to(dt, copy=True)
    lse = lse_a.to(torch.promote_types(lse_a.dtype, lse_b.dtype), copy=True)
    merge_lse_(out, lse, out_b, lse_b)
    return out, lse


def fresh_planes(b: int, h: int, s: int, device: torch.device) -> torch.Tensor:
    """An empty running lse in the planes form: ``(b, h, 2, s)`` float32, M = -inf, S = 0."""
    planes = torch.empty(b, h, 2, s, dtype=torch.float32, device=device)
    planes[:, :, 0] = -math.inf
    planes[:, :, 1] = 0.0
    return planes


def merge_planes_(out_acc: torch.Tensor, planes: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Merge ``(out_blk (b, s, h, d), lse_blk (b, h, s))`` into ``out_acc (b, s, h, d)`` float32 and
    the running ``planes (b, h, 2, s)`` float32 (M, S) in place (torch; any device):
    ``M' = max(M, b)``, ``S' = S exp(M - M') + exp(b - M')``, ``out_acc <- (S exp(M - M') / S') out_acc
    + (exp(b - M') / S') out_blk``; rows where M' is -inf are left as they are."""
    _check(out_acc, planes[:, :, 0], out_blk, lse_blk)
    m, s = planes[:, :, 0], planes[:, :, 1]
    top = torch.maximum(m, lse_blk.to(m.dtype))
    live = top != -math.inf
    safe = torch.where(live, top, torch.zeros_like(top))
    s_acc = torch.where(live, s * torch.exp(m - safe), torch.zeros_like(s))
    e_blk = torch.where(live, torch.exp(lse_blk.to(m.dtype) - safe), torch.zeros_like(s))
    total = s_acc + e_blk
    inv = torch.where(live, 1.0 / torch.where(live, total, torch.ones_like(total)), torch.zeros_like(total))
    keep = torch.where(live, s_acc * inv, torch.ones_like(s))
    out_acc.mul_(_to_rows(keep).to(out_acc.dtype))
    out_acc.add_(out_blk.to(out_acc.dtype) * _to_rows(e_blk * inv).to(out_acc.dtype))
    m.copy_(top)
    s.copy_(torch.where(live, total, s))


def planes_lse(planes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``M + log S`` of running ``planes (b, h, 2, s)`` as the lse ``(b, h, s)`` float32 (-inf where
    M is -inf), into ``out`` when given."""
    m, s = planes[:, :, 0], planes[:, :, 1]
    out = torch.empty_like(m) if out is None else out
    torch.log(s, out=out)
    out.add_(m)
    return out
