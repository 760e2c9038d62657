"""RMSNorm that keeps its 16-bit input for backward instead of an fp32 copy.

transformers' Llama-style RMSNorm computes ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``
and autograd keeps the fp32 copy of x: two hidden-size bf16 tensors' worth per norm and token
(16 GiB a norm at 1M tokens and H = 4096), on top of x itself, which the layer keeps anyway. This
Function computes the same forward (same ops, same order: identical values) and saves x, the weight
and the fp32 rstd (one float per token); backward recomputes the fp32 normalization. Both run on
slices of rows, so the fp32 temporaries are a slice's, not the sequence's:

    n = x r,   r = (mean(x^2) + eps)^-1/2,   y = w * n.to(x.dtype)
    dL/dw = sum over tokens of dy * n.to(x.dtype)
    dL/dx = r g - x r^3 mean(g x),   g = (dy * w).float()       (fp32, cast to x's dtype)

    lean_rmsnorm_in_place(model)     # every Llama-style RMSNorm (Llama, Mistral, Qwen2/3, ...)
"""

from __future__ import annotations

import types

import torch
from torch import nn

__all__ = ["lean_rmsnorm", "lean_rmsnorm_in_place"]

# norms computing w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype) with attribute variance_epsilon
# (Gemma's (1 + w) in fp32 is another formula: left alone)
LLAMA_STYLE = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm", "Phi3RMSNorm")


# rows per fp32 slice: the norm runs on slices of the sequence so its fp32 temporaries stay small
# (over a whole 1M-token sequence at H = 4096 they were 80 GiB of the step's peak)
SLICE_ELEMENTS = 1 << 25


def _row_slices(rows: int, width: int):
    step = max(1, SLICE_ELEMENTS // max(width, 1))
    return [slice(s, min(s + step, rows)) for s in range(0, rows, step)]


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)  # as HF's
        r = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
        for s in _row_slices(*x2.shape):  # rows are independent: the same values as one pass
            xf = x2[s].to(torch.float32)
            r[s] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y[s] = weight * (xf * r[s]).to(x.dtype)
        ctx.save_for_backward(x, weight, r)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, x.shape[-1])
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x2) if want_dx else None
        acc = torch.promote_types(torch.float32, weight.dtype)
        dw = torch.zeros(x2.shape[-1], dtype=acc, device=x.device) if want_dw else None
        for s in _row_slices(*x2.shape):
            xf, rs = x2[s].to(torch.float32), r[s]
            if want_dw:
                dw += (dy2[s] * (xf * rs).to(x.dtype)).sum(0, dtype=acc)
            if want_dx:
                g = (dy2[s] * weight).to(x.dtype).to(torch.float32)
                dx[s] = g * rs - xf * rs.pow(3) * (g * xf).mean(-1, keepdim=True)
        return (dx.view(x.shape) if want_dx else None), (dw.to(weight.dtype) if want_dw else None), None


def lean_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm of ``x (..., H)`` with ``weight (H,)``; saves x (not an fp32 copy)."""
    return _LeanRMSNorm.apply(x, weight, float(eps))


def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return lean_rmsnorm(hidden_states, self.weight, self.variance_epsilon)


def lean_rmsnorm_in_place(model: nn.Module) -> int:
    """Give every Llama-style RMSNorm of ``model`` the lean forward (parameters untouched); returns
    how many were changed."""
    count = 0
    for m in model.modules():
        if type(m).__name__ in LLAMA_STYLE and hasattr(m, "variance_epsilon") and hasattr(m, "weight"):
            m.forward = types.MethodType(_forward, m)
            count += 1
    return count
