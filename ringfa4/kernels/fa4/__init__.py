"""ringfa4's FlashAttention-4 extensions, one file each, imported on first use (never when
``ringfa4`` is imported):

- :mod:`.backend`: ``Fa4Backend``, the block backend over FA4's entry points and the kernels below;
- :mod:`.fp32_forward`: FA4's forward with a float32 output (sm90 subclass, sm100 single split), and
  FA4's own sm90 forward prepared for a single call (``prepare_plain``);
- :mod:`.varlen_fwd`: that sm90 forward over packed documents (cu_seqlens);
- :mod:`.epilogue_merge`: that forward merging into a ring's fp32 accumulator in its epilogue (sm90);
- :mod:`.bwd_accum`: FA4's backward into fp32 accumulators across ring steps, with
  :mod:`.bwd_plan` holding each generation's tiles, kernels and postprocess (sm90, sm100);
- :mod:`.varlen_bwd`: FA4's sm90 varlen backward added into fp32 accumulators (one block);
- :mod:`.plain_backward`: FA4's own sm90 backward prepared for a single dense call.

Imports go one way: backend -> the kernels; epilogue_merge, varlen_fwd -> fp32_forward; bwd_accum ->
bwd_plan; varlen_bwd, plain_backward -> bwd_accum, bwd_plan. :func:`compile_count` imports nothing.
"""

from __future__ import annotations

import sys

__all__ = ["compile_count"]

# our kernel caches: (module, attribute holding a dict, or a functools.cache'd compile function)
_OUR_CACHES = (("ringfa4.kernels.fa4.fp32_forward", "_CACHE"), ("ringfa4.kernels.fa4.bwd_accum", "_CACHE"),
               ("ringfa4.kernels.fa4.plain_backward", "_CACHE"), ("ringfa4.kernels.cute_merge", "_compiled"))


def _size(cache) -> int:
    if hasattr(cache, "cache_info"):  # functools.cache
        return cache.cache_info().currsize
    inner = getattr(cache, "cache", cache)  # FA4's JITCache keeps a dict in .cache
    return len(inner) if hasattr(inner, "__len__") else 0


def compile_count() -> int:
    """Kernels compiled (or loaded from FA4's persistent cache) in this process so far: ringfa4's
    CuTe DSL caches (fp32-output / merging / varlen forwards, accumulating backwards, the LSE merge)
    (a prepared single-call backward's entry counts once for its three to four kernels)
    plus every ``compile_cache`` of FA4's modules (``_flash_attn_fwd``, ``_flash_attn_bwd``, its
    pre- / postprocess, tile cumsum, combine, ...). Only modules already imported are read (nothing
    is imported: a cache of a module never loaded is empty). Triton kernels are not counted."""
    n, seen = 0, set()
    for module, attr in _OUR_CACHES:
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, attr):
            n += _size(getattr(mod, attr))
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("flash_attn.cute"):
            continue
        for obj in list(vars(mod).values()):
            try:
                cache = getattr(obj, "compile_cache", None) if callable(obj) else None
            except Exception:  # an object whose attribute lookup fails holds no FA4 cache
                continue
            if cache is not None and id(cache) not in seen:
                seen.add(id(cache))
                n += _size(cache)
    return n
