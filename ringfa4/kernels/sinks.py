"""Learnable attention sinks (gpt-oss): one extra softmax column per q head with logit ``s_h``
(natural-log units, the same as the scaled scores; not soft-capped) and no value. For a row's
attention ``(out, lse)`` over its keys:

    lse' = logaddexp(lse, s_h),    out' = exp(lse - lse') * out

(a row with no key: lse' = s_h, out' = 0; both -inf: out' = 0, lse' = -inf). Given the sink's
``(out', lse')`` the usual block backward is exact (P = exp(score - lse') are the probabilities
with the sink, D = rowsum(dout * out')), and ``d s_h = -sum_rows exp(s_h - lse') * D``.

Applied once to a merged result (a ring's accumulator after its last step, never per block), so
every CP path gets the sink exactly; each rank's ``dsinks`` covers its own rows (the usual gradient
reduction over ranks sums them).
"""

from __future__ import annotations

import math

import torch

__all__ = ["apply_sinks_", "check_sinks", "sink_grad"]


def _per_row(sinks: torch.Tensor, lse: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``sinks (h,)`` shaped to broadcast against ``lse`` whose head dim is ``head_dim``."""
    shape = [1] * lse.dim()
    shape[head_dim] = -1
    return sinks.to(lse.dtype).view(shape)


def apply_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """``(out, lse)`` -> ``(out', lse')`` in place. Dense ``out (b, s, h, d)``, ``lse (b, h, s)``;
    packed ``out (t, h, d)``, ``lse (h, t)``. ``lse`` float32/64; ``out`` any float dtype (scaled
    in ``lse``'s dtype)."""
    head_dim = 1 if lse.dim() == 3 else 0
    s = _per_row(sinks.detach(), lse, head_dim)
    new = torch.logaddexp(lse, s)
    keep = torch.where(new == -math.inf, torch.zeros_like(new), torch.exp(lse - torch.where(
        new == -math.inf, torch.zeros_like(new), new)))
    weight = keep.transpose(-1, -2).unsqueeze(-1) if head_dim == 1 else keep.t().unsqueeze(-1)
    out.copy_((out.to(weight.dtype) * weight).to(out.dtype))
    lse.copy_(new)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sinks (h,)`` in ``sinks``' dtype from this part's rows: ``dout, out`` (the sink's
    ``out'``) like ``out`` of :func:`apply_sinks_`, ``lse`` the sink's ``lse'``."""
    head_dim = 1 if lse.dim() == 3 else 0
    acc = torch.float64 if lse.dtype == torch.float64 else torch.float32
    d = (dout.to(acc) * out.to(acc)).sum(-1)  # (b, s, h) or (t, h)
    d = d.transpose(-1, -2) if head_dim == 1 else d.t()  # lse's layout
    s = _per_row(sinks.detach(), lse, head_dim).to(acc)
    p = torch.where(lse == -math.inf, torch.zeros_like(d), torch.exp(s - lse.to(acc)))
    dims = [i for i in range(lse.dim()) if i != head_dim]
    return (-(p * d).sum(dim=dims)).to(sinks.dtype)


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor, where: str = "") -> None:
    """ValueError unless ``sinks`` is None or a floating ``(h,)`` tensor on q's device (h: q's
    heads, dim -2)."""
    if sinks is None:
        return
    h = q.shape[-2]
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != h:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{where}sinks must be a ({h},) tensor of per-q-head logits, got {shape}")
    if not sinks.dtype.is_floating_point:
        raise ValueError(f"{where}sinks must be floating point (float32 recommended), got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"{where}sinks must be on q's device {q.device}, got {sinks.device}")
