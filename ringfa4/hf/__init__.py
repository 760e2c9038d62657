"""transformers integration: the "ringfa4" attention implementation, CP batch sharding, CP-correct
loss. Imports transformers only when :func:`register` is called."""

from .attention import NAME, CPMeta, auto_cp, register
from .batch import CPBatch, causal_lm_loss, shard_batch
from .long_context import enable_long_context

__all__ = ["NAME", "CPBatch", "CPMeta", "auto_cp", "causal_lm_loss", "enable_long_context", "register",
           "shard_batch"]
