"""ringfa4 as a transformers attention implementation.

    ringfa4.hf.register(cp)                                   # once, before selecting it
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ringfa4")
    shard = ringfa4.hf.shard_batch(batch, cp)
    out = model(**shard.model_inputs())                       # carries the CP metadata as a kwarg

transformers calls ``fn(module, query (b, h, s, d), key/value (b, h_kv, s, d), attention_mask,
scaling, dropout, sliding_window, softcap, **kwargs)`` with RoPE applied and, having no mask
function for this name, ``attention_mask=None``: causality (the module's ``is_causal``: decoders, or
encoders and bidirectional blocks), sliding windows (HF's ``W`` keeps keys ``j > i - W``, i.e. window
left ``W - 1``; bidirectional: ``|i - j| < W``, both sides ``W - 1``) and document boundaries are ours.
Learnable sinks (gpt-oss: the ``s_aux`` argument or ``module.sinks``) go to the attention as
``sinks``, differentiable. The step's CP metadata
(:class:`CPMeta`: the cp and its packing) arrives in ``kwargs["ringfa4"]``, never global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import attention
from ..options import RingOptions
from ..parallel import ContextParallel

__all__ = ["CPMeta", "NAME", "auto_cp", "register"]

NAME = "ringfa4"


@dataclass(frozen=True)
class CPMeta:
    """Per-step CP metadata for the attention layers: the group and, for packed batches, the pack."""

    cp: ContextParallel
    packing: object | None = None  # ringfa4.parallel.context.Pack


def _model_name(module) -> str:
    cfg = getattr(module, "config", None)
    return getattr(cfg, "model_type", type(module).__name__)


def _attention_fn(default_cp: ContextParallel | None):
    @torch.compiler.disable  # collectives and Python schedules: eager inside compiled layers
    def ringfa4_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                          sliding_window=None, softcap=None, **kwargs):
        meta: CPMeta | None = kwargs.get(NAME)
        cp = meta.cp if meta is not None else default_cp
        name = _model_name(module)
        if cp is None:
            raise ValueError(f"{name}: ringfa4 attention needs a ContextParallel: call ringfa4.hf.register(cp) or "
                             "pass the batch's CP metadata (shard_batch(...).model_inputs())")
        sinks = kwargs.get("s_aux")
        sinks = getattr(module, "sinks", None) if sinks is None else sinks  # gpt-oss: one logit per q head
        if dropout and module.training:
            raise ValueError(f"{name}: attention dropout {dropout} is not supported by ringfa4 (set it to 0)")
        if attention_mask is not None:
            raise ValueError(f"{name}: ringfa4 takes no attention_mask (got {tuple(attention_mask.shape)}): "
                             "causality, windows and documents come from the CP metadata")
        causal = bool(getattr(module, "is_causal", True))  # encoders / bidirectional blocks: False
        # HF's sliding window W keeps keys j > i - W (causal), |i - j| < W (bidirectional)
        window = (None, None) if sliding_window is None else (int(sliding_window) - 1,
                                                              None if causal else int(sliding_window) - 1)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (b, s, h, d)
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):  # as SDPA under autocast: q / k (after RoPE, fp32) and v alike
            dt = torch.get_autocast_dtype(device_type)
            q, k, v = (t.to(dt) for t in (q, k, v))
        packing = meta.packing if meta is not None else None
        if packing is not None:
            if q.shape[0] != 1:
                raise ValueError(f"{name}: packed batches must have batch size 1, got {q.shape[0]}")
            q, k, v = (t[0] for t in (q, k, v))
        out = attention(q.contiguous(), k.contiguous(), v.contiguous(), cp=cp, causal=causal, window=window,
                        softmax_scale=scaling, softcap=float(softcap or 0.0), packing=packing, sinks=sinks)
        if packing is not None:
            out = out.unsqueeze(0)
        return out.contiguous(), None

    return ringfa4_attention


def register(cp: ContextParallel | None = None, name: str = NAME) -> str:
    """Register the attention implementation ``name`` (default "ringfa4") with transformers, using
    ``cp`` when a forward carries no CP metadata. Returns the name to select."""
    if "flash" in name:
        raise ValueError(f"name must not contain 'flash' (transformers treats it as a hub kernel), got {name!r}")
    from transformers import AttentionInterface

    AttentionInterface.register(name, _attention_fn(cp))
    return name


def auto_cp(config, group=None, nvlink_domain_size: int | None = None, backend="auto",
            layout: str = "zigzag", options: RingOptions | None = None, packed: bool = False) -> ContextParallel:
    """``ContextParallel.auto`` for a transformers model config: the planner sees the model's q and
    K/V head counts, so its Ulysses degree divides the heads (K/V replicated when fewer);
    ``options``: the :class:`~ringfa4.options.RingOptions` of every call; ``packed``: the batches are
    packed documents (the planner then runs the ring alone)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return ContextParallel.auto(group, num_heads=heads, num_kv_heads=kv, nvlink_domain_size=nvlink_domain_size,
                                backend=backend, layout=layout, options=options, packed=packed)
