"""Tiled MLP: a position-wise module applied to sequence tiles, recomputed tile by tile in backward,
so the (s x intermediate) activations never exist at once (at 1M tokens and 14336 intermediate,
28 GiB in bf16 per layer).

    y = tiled_apply(mlp, x, tile=8192)        # x (b, s, H): same values and gradients as mlp(x)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TiledMLP", "tile_mlp_in_place", "tiled_apply"]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile, x, *params):
        ctx.fn, ctx.tile = fn, tile
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return torch.cat([fn(x[:, s:s + tile]) for s in range(0, x.shape[1], tile)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        dx = torch.empty_like(x)
        dparams = [None if not p.requires_grad else torch.zeros_like(p) for p in params]
        wanted = [p for p in params if p.requires_grad]
        for s in range(0, x.shape[1], ctx.tile):
            with torch.enable_grad():
                xt = x[:, s:s + ctx.tile].detach().requires_grad_(x.requires_grad)
                yt = ctx.fn(xt)
                inputs = ([xt] if x.requires_grad else []) + wanted
                got = torch.autograd.grad(yt, inputs, grad[:, s:s + ctx.tile].contiguous(), allow_unused=True)
            if x.requires_grad:
                dx[:, s:s + ctx.tile] = got[0]
                got = got[1:]
            it = iter(got)
            for i, p in enumerate(params):
                if p.requires_grad:
                    g = next(it)
                    if g is not None:
                        dparams[i] += g
        return (None, None, dx if x.requires_grad else None, *dparams)


def tiled_apply(module: nn.Module, x: torch.Tensor, tile: int = 8192, fn=None) -> torch.Tensor:
    """``module(x)`` (or ``fn(x)``, a function of ``module``'s parameters) for a position-wise
    module on ``x (b, s, H)``, tiled along s."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    fn = module if fn is None else fn
    if x.shape[1] <= tile or not torch.is_grad_enabled():
        return fn(x) if x.shape[1] <= tile else torch.cat([fn(x[:, s:s + tile]) for s in range(0, x.shape[1], tile)],
                                                          dim=1)
    return _Tiled.apply(fn, tile, x, *module.parameters())


def tile_mlp_in_place(mlp: nn.Module, tile: int = 8192) -> nn.Module:
    """Make ``mlp`` run tile by tile without renaming it or its parameters (state dicts, FSDP
    units and ``save_pretrained`` stay as they were): its forward is wrapped, nothing else."""
    if getattr(mlp, "_ringfa4_tile", None) is not None:
        mlp._ringfa4_tile = tile
        return mlp
    plain = mlp.forward
    mlp._ringfa4_tile = tile
    mlp.forward = lambda x: tiled_apply(mlp, x, mlp._ringfa4_tile, fn=plain)
    return mlp


def tile_norm_and_mlp_in_place(norm: nn.Module, mlp: nn.Module, tile: int = 8192) -> nn.Module:
    """Run a Llama-style ``norm`` (weight, variance_epsilon) and the ``mlp`` after it as one tiled,
    recomputed function: backward keeps the norm's input only, not the norm's output too (one
    hidden-size tensor per token less). The norm's forward becomes the identity and the mlp's
    forward applies both; names, parameters and values are unchanged. Returns the mlp."""
    from .lean_norm import lean_rmsnorm

    if getattr(mlp, "_ringfa4_tile", None) is not None:
        raise ValueError("this mlp is already tiled")
    plain = mlp.forward
    eps = norm.variance_epsilon

    def both(t):
        return plain(lean_rmsnorm(t, norm.weight, eps))

    def forward(h):
        if h.shape[1] <= mlp._ringfa4_tile or not torch.is_grad_enabled():
            return tiled_apply(mlp, h, mlp._ringfa4_tile, fn=both)
        return _Tiled.apply(both, mlp._ringfa4_tile, h, *norm.parameters(), *mlp.parameters())

    mlp._ringfa4_tile = tile
    norm.forward = lambda h: h
    mlp.forward = forward
    return mlp


class TiledMLP(nn.Module):
    """Wraps a position-wise module (an HF MLP) so it runs tile by tile; parameters are shared."""

    def __init__(self, mlp: nn.Module, tile: int = 8192) -> None:
        super().__init__()
        self.mlp, self.tile = mlp, tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_apply(self.mlp, x, self.tile)
