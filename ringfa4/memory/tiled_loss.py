"""Tiled causal-LM loss: the logits of the whole sequence never exist at once.

Tokens go through ``lm_head`` + cross entropy in chunks (fp32 math), and backward recomputes each
chunk's logits instead of keeping them: peak extra memory is one chunk of logits (chunk x vocab
fp32) instead of s x vocab. At 1M tokens and a 128k vocabulary the untiled logits are 512 GiB in
fp32; with 8k-token chunks, 4 GiB.

    loss = tiled_causal_lm_loss(hidden, lm_head.weight, targets, num_targets)   # sum / num_targets
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["tiled_causal_lm_loss"]

IGNORE = -100


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32 math (fp64 for fp64 inputs)


def _chunk_logits(h, weight, bias, softcap):
    a = _acc(h)
    logits = F.linear(h.to(a), weight.to(a), None if bias is None else bias.to(a))
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk, softcap):
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_t = targets.reshape(-1)
        total = torch.zeros((), dtype=_acc(hidden), device=hidden.device)
        for start in range(0, flat_h.shape[0], chunk):
            logits = _chunk_logits(flat_h[start:start + chunk], weight, bias, softcap)
            total += F.cross_entropy(logits, flat_t[start:start + chunk], ignore_index=IGNORE, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.scale, ctx.chunk, ctx.softcap = scale, chunk, softcap
        return total * scale

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_t = targets.reshape(-1)
        dh = torch.empty_like(flat_h)
        a = _acc(hidden)
        dw = torch.zeros_like(weight, dtype=a)
        db = None if bias is None else torch.zeros_like(bias, dtype=a)
        g = grad.to(a) * ctx.scale
        for start in range(0, flat_h.shape[0], ctx.chunk):
            h = flat_h[start:start + ctx.chunk]
            t = flat_t[start:start + ctx.chunk]
            logits = _chunk_logits(h, weight, bias, ctx.softcap)
            dlogits = torch.softmax(logits, dim=-1)
            valid = t != IGNORE
            dlogits[valid, t[valid]] -= 1.0
            dlogits[~valid] = 0.0
            dlogits *= g
            if ctx.softcap:  # d softcap*tanh(x/softcap) / dx = 1 - tanh^2
                dlogits *= 1.0 - (logits / ctx.softcap) ** 2
            dh[start:start + ctx.chunk] = (dlogits @ weight.to(a)).to(dh.dtype)
            dw += dlogits.t() @ h.to(a)
            if db is not None:
                db += dlogits.sum(0)
        return (dh.view_as(hidden), dw.to(weight.dtype), None if db is None else db.to(bias.dtype), None, None, None,
                None)


def tiled_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, num_targets: int,
                         bias: torch.Tensor | None = None, chunk: int = 8192, logit_softcap: float = 0.0
                         ) -> torch.Tensor:
    """Sum over tokens of cross entropy(lm_head(hidden), targets) / ``num_targets``.

    hidden ``(..., H)`` (any float dtype); weight ``(V, H)`` and optional bias ``(V,)`` of the
    lm_head; targets ``(...)`` int64, already shifted, -100 = ignored; ``num_targets`` the *global*
    count of valid targets (over all CP ranks, e.g. ``CPBatch.num_targets``), so gradients summed
    over ranks equal the single-process gradients. ``logit_softcap`` for Gemma-style final
    soft-capping. Math in fp32; backward recomputes each chunk's logits.
    """
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _TiledLoss.apply(hidden, weight, bias, targets, 1.0 / max(int(num_targets), 1), int(chunk),
                            float(logit_softcap or 0.0))
