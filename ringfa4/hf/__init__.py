"""transformers integration: the "ringfa4" attention implementation, CP batch sharding, CP-correct
loss. Imports transformers only when :func:`register` is called."""

from .attention import NAME, CPMeta, auto_cp, register
from .batch import CPBatch, causal_lm_loss, global_mean_loss, shard_batch
from .long_context import LongContext, TiledLossLM, decoder_layers, enable_long_context

__all__ = ["NAME", "CPBatch", "CPMeta", "LongContext", "TiledLossLM", "auto_cp", "causal_lm_loss", "decoder_layers",
           "enable_long_context", "global_mean_loss", "register", "shard_batch"]
