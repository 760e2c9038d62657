"""transformers integration: the "ringfa4" attention implementation, CP batch sharding, CP-correct
loss, and CP trainers. Imports transformers only when :func:`register` is called; ``Trainer`` and
``ContextParallelMixin`` (transformers, accelerate) and ``SFTTrainer`` (trl) load on first use."""

from .attention import NAME, CPMeta, auto_cp, register
from .batch import CPBatch, causal_lm_loss, global_mean_loss, shard_batch
from .long_context import LongContext, TiledLossLM, decoder_layers, enable_long_context

_LAZY = {"Trainer": ".trainer", "ContextParallelMixin": ".trainer", "SFTTrainer": ".sft"}

__all__ = ["NAME", "CPBatch", "CPMeta", "ContextParallelMixin", "LongContext", "SFTTrainer", "TiledLossLM", "Trainer",
           "auto_cp", "causal_lm_loss", "decoder_layers", "enable_long_context", "global_mean_loss", "register",
           "shard_batch"]


def __getattr__(name: str):
    """``ringfa4.hf.Trainer`` / ``ContextParallelMixin`` / ``SFTTrainer``, imported on first use."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
