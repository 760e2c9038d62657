"""Turn on ringfa4's memory tools for a transformers model (more switches come with the memory
issue: host-offloaded checkpoints, cached attention outputs, a tiled loss inside the model)."""

from __future__ import annotations

from ..memory import tile_mlp_in_place

__all__ = ["enable_long_context"]


def enable_long_context(model, mlp_tile: int | None = 8192):
    """Tile every decoder layer's MLP along the sequence (``mlp_tile`` tokens a tile; None: off).
    Parameter names and values are untouched; returns the model."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (a *DecoderLayer module)")
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            raise ValueError(f"{type(layer).__name__} has no .mlp to tile")
        if mlp_tile is not None:
            tile_mlp_in_place(mlp, mlp_tile)
    return model
