"""Small host-built tensors (indices, cu_seqlens) put on the GPU without the host waiting.

``torch.tensor(values).to("cuda")`` copies from pageable memory, which makes the host wait until
the GPU's queue has drained: a pack that is new every batch would pay that once per tensor, on
the training hot path. :func:`to_device` copies from pinned memory, non-blocking; the caching host
allocator keeps the pinned block until the copy has run, so the host tensor may die at once.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """``t`` (a host tensor) on ``device`` (None: left on the host). CUDA: through pinned memory,
    non-blocking, ordered on the current stream; other devices: ``t.to(device)``."""
    if device is None:
        return t
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
