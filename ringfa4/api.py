"""``ringfa4.attention``: exact attention over a sequence split across a CP group."""

from __future__ import annotations

import functools

import torch

from .kernels import AttnSpec, get_backend
from .kernels.autograd import block_attention
from .kernels.validate import validate_block
from .parallel import ContextParallel

__all__ = ["attention"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel | None = None,
              causal: bool = False, window: tuple[int | None, int | None] = (None, None),
              softmax_scale: float | None = None, softcap: float = 0.0, return_lse: bool = False,
              backend: str = "auto", deterministic: bool = False, packing=None,
              sinks: torch.Tensor | None = None):
    """Attention of ``q (b, s, h, d)`` over ``k, v (b, s, h_kv, d)`` (h % h_kv == 0).

    With a distributed ``cp`` the tensors are this rank's shards (``cp.shard``) and the result is
    the local output; with ``ContextParallel.simulated(P)`` they are the full sequence. ``cp=None``
    (or a one-rank group) is one backend call (``backend``; a cp uses its own). Differentiable in
    q, k, v; ``lse (b, h, s)`` float32 (natural log) is returned when ``return_lse`` and carries
    no gradient. Causal is over global positions; window (left, right) with None = unbounded.
    ``deterministic`` asks the block backward for a fixed reduction order (FA4's dq is otherwise
    accumulated with atomics, so it can differ in the last bits between runs).
    ``packing`` (``cp.pack(cu_seqlens)``): q, k, v are packed ``(t, h, d)`` documents (this rank's
    tokens, or all of them when simulated); attention stays inside each document; lse is ``(h, t)``.
    ``sinks``: ``(h,)`` learnable sink logits (gpt-oss: each row's softmax denominator gets
    ``exp(sinks[head])``, the sink has no value; fp32 recommended), differentiable; the returned
    lse includes the sink. Under CP the sink is applied once to each rank's merged result, and each
    rank's ``sinks.grad`` covers its own rows (the usual gradient reduction over ranks sums them).
    """
    window = tuple(window)
    if (sinks is None and len(window) == 2 and type(window[0]) in _SIDE and type(window[1]) in _SIDE
            and type(softmax_scale) in _NUMBER and type(softcap) in _NUMBER and type(causal) is bool
            and type(deterministic) is bool):  # plain options (what the cache may stand for): one spec each
        spec = _spec(causal, window, softmax_scale, softcap, deterministic)
    else:
        spec = AttnSpec(causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                        deterministic=deterministic, sinks=sinks)
    if packing is not None:
        if cp is None or packing.cp is not cp:
            raise ValueError("packing must come from this cp (cp.pack(cu_seqlens))")
        out, lse = cp.attention(q, k, v, spec, packing=packing)
    elif cp is None or (cp.world_size == 1 and not cp.is_simulated):
        name = backend if cp is None else cp.backend_name
        out, lse = _single(q, k, v, spec, name)
    else:
        out, lse = cp.attention(q, k, v, spec)
    return (out, lse) if return_lse else out


_SIDE = (int, type(None))  # exact types: 5.0 or True hash like 5 or 1 but are not valid window sides
_NUMBER = (float, int, type(None))


@functools.lru_cache(maxsize=256)
def _spec(causal: bool, window: tuple, softmax_scale: float | None, softcap: float, deterministic: bool) -> AttnSpec:
    """The AttnSpec of plain (tensor-free) options, made once per combination (a frozen value)."""
    return AttnSpec(causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                    deterministic=deterministic)


def _single(q, k, v, spec, backend_name):
    """One differentiable backend call. Every backend a name gives checks q, k, v first thing
    (:func:`~ringfa4.kernels.validate.validate_block`), so the call is not checked twice here;
    only a q that is no tensor is refused before its device is asked."""
    if not isinstance(q, torch.Tensor):
        validate_block(q, k, v, spec)
    return block_attention(q, k, v, get_backend(backend_name, q.device, q.dtype), spec)
