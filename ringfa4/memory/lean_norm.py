"""RMSNorm that keeps its 16-bit input for backward instead of an fp32 copy.

transformers' Llama-style RMSNorm computes ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``
and autograd keeps the fp32 copy of x: two hidden-size bf16 tensors' worth per norm and token
(16 GiB a norm at 1M tokens and H = 4096), on top of x itself, which the layer keeps anyway. This
Function computes the same forward (same ops, same order: identical values) and saves x, the weight
and the fp32 rstd (one float per token); backward recomputes the fp32 normalization:

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


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        xf = x.to(torch.float32)
        dw = None
        if ctx.needs_input_grad[1]:
            n = (xf * r).to(x.dtype)
            dw = (dy * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            g = (dy * weight).to(x.dtype).to(torch.float32)
            dx = (g * r - xf * r.pow(3) * (g * xf).mean(-1, keepdim=True)).to(x.dtype)
        return dx, dw, None


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
