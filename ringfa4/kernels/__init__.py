"""Block-attention backends returning (out, lse), the LSE merge, and backend selection.

    backend = ringfa4.kernels.get_backend("auto", device)   # "fa4" | "sdpa" | "reference" | "auto"
    out, lse = backend.forward(q, k, v, AttnSpec(causal=True))
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, AttnSpec(causal=True))

``import ringfa4.kernels`` never imports flash_attn or cutlass: the fa4 backend imports them on
first use.
"""

from __future__ import annotations

from .merge import merge_lse, merge_lse_
from .registry import FallbackBackend, available_backends, get_backend, resolve
from .spec import AttnSpec, BackendUnsupported, BlockBackend, PlainBackend, allowed_band, band_mask
from .validate import validate_block

__all__ = [
    "AttnSpec", "BackendUnsupported", "BlockBackend", "FallbackBackend", "PlainBackend", "allowed_band",
    "available_backends",
    "band_mask", "get_backend", "merge_lse", "merge_lse_", "resolve", "validate_block",
]
