"""Million-token memory tools, model-agnostic: tiled causal-LM loss, tiled MLP, layer checkpointing
with inputs on the GPU, the host or rebuilt (the recompute may reuse kept attention outputs)."""

from ..kernels.output_cache import OutputCache
from .lean_norm import lean_rmsnorm, lean_rmsnorm_in_place
from .offload import LayerCheckpointing, OffloadPlan, plan_offload
from .tiled_loss import tiled_causal_lm_loss
from .tiled_mlp import TiledMLP, tile_mlp_in_place, tile_norm_and_mlp_in_place, tiled_apply

__all__ = ["LayerCheckpointing", "OffloadPlan", "OutputCache", "TiledMLP", "lean_rmsnorm", "lean_rmsnorm_in_place",
           "plan_offload", "tile_mlp_in_place", "tile_norm_and_mlp_in_place", "tiled_apply", "tiled_causal_lm_loss"]
