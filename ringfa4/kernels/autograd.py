"""One block-attention call as a differentiable op (the no-CP path and a lone CP rank)."""

from __future__ import annotations

import torch

from .output_cache import record_output, replay_output
from .spec import AttnSpec, BlockBackend

__all__ = ["block_attention"]


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend, spec):
        kept = replay_output()  # a checkpoint recompute with the forward's outputs kept
        out, lse = kept if kept is not None else backend.forward(q, k, v, spec)
        record_output(out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.spec = backend, spec
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(dout.contiguous(), q, k, v, out, lse, ctx.spec)
        return dq, dk, dv, None, None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: BlockBackend, spec: AttnSpec
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one ``backend`` call, differentiable in q, k, v (lse carries no gradient)."""
    return _BlockAttention.apply(q, k, v, backend, spec)
