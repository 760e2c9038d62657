"""Turn on ringfa4's memory tools for a transformers causal LM.

    lc = LongContext(mlp_tile=8192, gpu_budget_gib=24, host_budget_gib=96, cache_attention=True)
    model = ringfa4.hf.enable_long_context(model, lc)       # in place; names and weights unchanged
    train = ringfa4.hf.TiledLossLM(model, chunk=8192)        # forward(batch) -> loss, no full logits
    loss = train(shard)                                      # shard = ringfa4.hf.shard_batch(...)

- ``mlp_tile``: every decoder MLP runs on sequence tiles, recomputed in backward;
- checkpointing of every decoder layer with its saved input on the GPU, the pinned host, or rebuilt
  from its group (:mod:`ringfa4.memory.offload`), planned from the budgets at the first forward;
- ``cache_attention``: the recompute reuses the forward's attention (out, lse) instead of running
  the ring forward again (one extra (s, h, d) output a layer until its backward);
- ``lean_norms``: Llama-style RMSNorms save their 16-bit input instead of an fp32 copy
  (:mod:`ringfa4.memory.lean_norm`; same values); ``fold_mlp_norm``: the norm before a tiled MLP
  is computed inside its tiles, so backward keeps the norm's input only;
- :class:`TiledLossLM`: the loss through lm_head in token chunks (:mod:`ringfa4.memory.tiled_loss`),
  inside a module forward so that FSDP2 gathers the head's weight (make it the FSDP root).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from ..memory import (
    LayerCheckpointing,
    lean_rmsnorm_in_place,
    tile_mlp_in_place,
    tile_norm_and_mlp_in_place,
    tiled_causal_lm_loss,
)
from ..memory.lean_norm import LLAMA_STYLE
from .batch import CPBatch

__all__ = ["LongContext", "TiledLossLM", "decoder_layers", "enable_long_context"]

GIB = 2**30


@dataclass(frozen=True)
class LongContext:
    """Memory options for :func:`enable_long_context` (None = off / unlimited)."""

    mlp_tile: int | None = 8192          # tokens per MLP tile
    checkpoint: bool = True              # checkpoint every decoder layer (ours, with placement)
    gpu_budget_gib: float | None = None  # GPU memory for checkpointed layer inputs
    host_budget_gib: float | None = None  # pinned host memory for them
    group: int | None = None             # keep every group-th input, rebuild the rest (None: as needed)
    cache_attention: bool = False        # reuse attention outputs in the recompute
    lean_norms: bool = True              # RMSNorms keep their 16-bit input, not an fp32 copy
    fold_mlp_norm: bool = True           # the norm before a tiled MLP runs inside its tiles


def decoder_layers(model) -> list[nn.Module]:
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (a *DecoderLayer module)")
    return layers


def enable_long_context(model, options: LongContext | None = None, **overrides):
    """Apply ``options`` (fields may also be given as keywords) to ``model`` in place; returns it.
    The layer checkpointing object is ``model.ringfa4_checkpointing`` (its ``describe()`` says
    where the inputs went after the first forward)."""
    names = {f.name for f in fields(LongContext)}
    unknown = set(overrides) - names
    if unknown:
        raise ValueError(f"unknown long-context options {sorted(unknown)}; known: {sorted(names)}")
    opts = replace(options or LongContext(), **overrides)
    layers = decoder_layers(model)
    if opts.lean_norms:
        lean_rmsnorm_in_place(model)
    if opts.mlp_tile is not None:
        for layer in layers:
            mlp = getattr(layer, "mlp", None)
            if mlp is None:
                raise ValueError(f"{type(layer).__name__} has no .mlp to tile")
            norm = getattr(layer, "post_attention_layernorm", None)
            foldable = (opts.fold_mlp_norm and type(norm).__name__ in LLAMA_STYLE
                        and not hasattr(layer, "pre_feedforward_layernorm"))  # (Gemma: norms around the mlp)
            if foldable:
                tile_norm_and_mlp_in_place(norm, mlp, opts.mlp_tile)
            else:
                tile_mlp_in_place(mlp, opts.mlp_tile)
    if opts.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        gib = (None if x is None else x * GIB for x in (opts.gpu_budget_gib, opts.host_budget_gib))
        ckpt = LayerCheckpointing(layers, *gib, group=opts.group, cache=opts.cache_attention).install()
        model.ringfa4_checkpointing = ckpt
    elif opts.cache_attention or opts.group or opts.gpu_budget_gib is not None or opts.host_budget_gib is not None:
        raise ValueError("cache_attention, group and the checkpoint budgets need checkpoint=True")
    return model


class TiledLossLM(nn.Module):
    """Wraps a causal LM (or a peft model of one): ``forward(batch: CPBatch) -> loss``, the sum of
    the local token losses over the global target count (as :func:`ringfa4.hf.causal_lm_loss`),
    computed through the output embedding in ``chunk``-token pieces: the (s, vocab) logits never
    exist. Gemma-style final logit soft-capping is applied."""

    def __init__(self, model: nn.Module, chunk: int = 8192) -> None:
        super().__init__()
        self.lm, self.chunk = model, int(chunk)

    def forward(self, batch: CPBatch) -> torch.Tensor:
        hidden = self.lm.get_decoder()(**batch.model_inputs()).last_hidden_state
        head = self.lm.get_output_embeddings()
        softcap = getattr(self.lm.config, "final_logit_softcapping", None) or 0.0
        return tiled_causal_lm_loss(hidden, head.weight, batch.labels, batch.num_targets, bias=head.bias,
                                    chunk=self.chunk, logit_softcap=softcap)
