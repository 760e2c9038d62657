"""Million-token memory tools, model-agnostic: tiled causal-LM loss and tiled MLP (more to come:
host-offloaded activation checkpoints, cached attention outputs)."""

from .tiled_loss import tiled_causal_lm_loss
from .tiled_mlp import TiledMLP, tile_mlp_in_place, tiled_apply

__all__ = ["TiledMLP", "tile_mlp_in_place", "tiled_apply", "tiled_causal_lm_loss"]
