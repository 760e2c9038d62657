"""Same-GPU copies on the copy engines, beside the kernels, for the simulated ring's hops.

An NVLink hop runs on copy engines (or a few SMs of NCCL) beside the attention kernels. A plain
``dst.copy_(src)`` between two buffers of one GPU (``cudaMemcpyAsync`` device to device) leaves the
driver free to do the copy with SM work, which next to FA4's kernels (they hold every SM) would
have to wait for free SMs. The driver's batched copy (``cuMemcpyBatchAsync``, CUDA 12.8+) takes
the hint ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``: copy so as to overlap compute, i.e. on the
copy engines. Measured on the H200 (64k, P = 8, ring_sim and ring_profile): no difference against
``copy_`` beyond run-to-run noise, in speed or in the compute stream's idle time; the hint stays
the default so the simulated hop is the kind of copy an NVLink hop is.

:func:`engine_copy_` posts a list of ``(dst, src)`` pairs (contiguous CUDA tensors of one device,
same byte sizes) in one batch on a stream; the copies run in stream order against that stream's
earlier and later work. ``RINGFA4_LOOPBACK_COPY`` picks the loopback transport's copies:
``engine`` (default) or ``torch`` (``copy_``). Pairs the batch cannot take (non-contiguous, or
without the driver entry point) are copied with ``copy_`` on the same stream.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["engine_copy_", "loopback_copy"]


def loopback_copy() -> str:
    """``RINGFA4_LOOPBACK_COPY``: ``engine`` (default) or ``torch``."""
    raw = os.environ.get("RINGFA4_LOOPBACK_COPY", "engine")
    if raw not in ("engine", "torch"):
        raise ValueError(f"RINGFA4_LOOPBACK_COPY must be 'engine' or 'torch', got {raw!r}")
    return raw


@functools.cache
def _driver():
    """The ``cuda.bindings.driver`` module, or None where it or its batched copy is missing."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    if not hasattr(driver, "cuMemcpyBatchAsync"):
        return None
    return driver


@functools.cache
def _attributes(device_index: int):
    drv = _driver()
    attrs = drv.CUmemcpyAttributes()
    attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attrs.flags = drv.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    for hint in (attrs.srcLocHint, attrs.dstLocHint):
        hint.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        hint.id = device_index
    return attrs


def _batchable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.is_cuda and src.device == dst.device and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.is_contiguous() and src.is_contiguous() and dst.numel() > 0)


def engine_copy_(pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream) -> None:
    """``dst.copy_(src)`` for every pair, on ``stream`` (the current stream must be ``stream``
    for the fallback copies), as one batch on the copy engines where the driver offers it."""
    drv = _driver()
    batch = [(d, s) for d, s in pairs if drv is not None and _batchable(d, s)]
    for d, s in pairs:
        if drv is None or not _batchable(d, s):
            d.copy_(s, non_blocking=True)
    if not batch:
        return
    device = batch[0][0].device.index
    if any(d.device.index != device for d, _ in batch):
        raise ValueError("engine_copy_: every pair must live on one device")
    res = drv.cuMemcpyBatchAsync([drv.CUdeviceptr(d.data_ptr()) for d, _ in batch],
                                 [drv.CUdeviceptr(s.data_ptr()) for _, s in batch],
                                 [d.numel() * d.element_size() for d, _ in batch], len(batch),
                                 [_attributes(device)], [0], 1, drv.CUstream(stream.cuda_stream))
    err = res[0] if isinstance(res, tuple) else res
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyBatchAsync failed: {err!r} ({len(batch)} copies on cuda:{device})")
