"""ringfa4: exact long-context attention from FlashAttention-4 blocks with ring context parallelism.

    import ringfa4
    cp = ringfa4.ContextParallel(layout="zigzag")          # torch.distributed group (default WORLD)
    cp = ringfa4.ContextParallel(options=ringfa4.RingOptions(bwd_ring="q"))   # the algorithm's choices
    q, k, v = (cp.shard(t, dim=1) for t in (q, k, v))
    out = ringfa4.attention(q, k, v, cp=cp, causal=True)    # local output, differentiable

Never imports flash_attn or cutlass at import time.
"""

from . import kernels, parallel
from .api import attention
from .kernels import AttnSpec, get_backend, merge_lse, merge_lse_
from .options import RingOptions
from .parallel import ContextParallel

__version__ = "0.1.0"
__all__ = ["AttnSpec", "ContextParallel", "RingOptions", "attention", "get_backend", "kernels", "merge_lse",
           "merge_lse_", "parallel"]
