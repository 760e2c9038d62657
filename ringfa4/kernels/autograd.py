"""One block-attention call as a differentiable op (the no-CP path and a lone CP rank)."""

from __future__ import annotations

import torch

from .output_cache import record_output, replay_output
from .sinks import sink_grad
from .spec import AttnSpec, BlockBackend

__all__ = ["block_attention"]


class _BlockAttention(torch.autograd.Function):
    """``spec.sinks`` (when given) is also the ``sinks`` input, so its gradient flows: the backend
    applies the sink in its forward; the backward runs from the sink's (out', lse'), which makes the
    backend's gradients exact, and adds ``d sinks`` (:mod:`.sinks`)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, spec, sinks):
        kept = replay_output()  # a checkpoint recompute with the forward's outputs kept
        out, lse = kept if kept is not None else backend.forward(q, k, v, spec)
        record_output(out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.spec, ctx.sinks = backend, spec, sinks
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros made for lse's gradient (a fill launch a call)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out took no part in the loss
            return None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, ctx.spec)
        dsinks = sink_grad(dout, out, lse, ctx.sinks) if ctx.sinks is not None and ctx.needs_input_grad[5] else None
        return dq, dk, dv, None, None, dsinks


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: BlockBackend, spec: AttnSpec
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one ``backend`` call, differentiable in q, k, v and ``spec.sinks`` (lse
    carries no gradient)."""
    return _BlockAttention.apply(q, k, v, backend, spec, spec.sinks)
