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


def _mm_dtype(h: torch.Tensor) -> torch.dtype:
    """16-bit inputs multiply on tensor cores (fp32 accumulation inside, as transformers does);
    fp32/fp64 inputs keep their precision."""
    return h.dtype if h.dtype in (torch.bfloat16, torch.float16) else _acc(h)


def _chunk_logits(h, weight, bias, softcap):
    m = _mm_dtype(h)
    logits = F.linear(h.to(m), weight.to(m), None if bias is None else bias.to(m)).to(_acc(h))
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
        a, m = _acc(hidden), _mm_dtype(hidden)
        w_m = weight.to(m)
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        dw = torch.zeros_like(weight, dtype=a) if need_w else None  # frozen head (LoRA): skipped
        db = torch.zeros_like(bias, dtype=a) if need_b else None
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
            dl = dlogits.to(m)
            dh[start:start + ctx.chunk] = (dl @ w_m).to(dh.dtype)
            if dw is not None:
                dw += (dl.t() @ h.to(m)).to(a)
            if db is not None:
                db += dlogits.sum(0)
        return (dh.view_as(hidden), None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None)


def tiled_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, num_targets: int,
                         bias: torch.Tensor | None = None, chunk: int = 8192, logit_softcap: float = 0.0
                         ) -> torch.Tensor:
    """Sum over tokens of cross entropy(lm_head(hidden), targets) / ``num_targets``.

    hidden ``(..., H)`` (any float dtype); weight ``(V, H)`` and optional bias ``(V,)`` of the
    lm_head; targets ``(...)`` int64, already shifted, -100 = ignored; ``num_targets`` the *global*
    count of valid targets (over all CP ranks, e.g. ``CPBatch.num_targets``), so gradients summed
    over ranks equal the single-process gradients. ``logit_softcap`` for Gemma-style final
    soft-capping. Softmax and cross entropy in fp32; 16-bit inputs multiply on tensor cores with fp32
accumulation (logits rounded once to 16 bits, as transformers' own loss does); backward
recomputes each chunk's logits and skips the head's gradient when it is frozen.
    """
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _TiledLoss.apply(hidden, weight, bias, targets, 1.0 / max(int(num_targets), 1), int(chunk),
                            float(logit_softcap or 0.0))
