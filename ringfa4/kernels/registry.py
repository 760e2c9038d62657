"""Backend selection by name: ``reference``, ``sdpa``, ``fa4`` or ``auto``.

``auto`` is fa4 on sm90/sm100 CUDA devices when flash-attn-4 is installed and the dtype is
fp16/bf16, else sdpa on CUDA (not float64), else reference; ``resolve("auto", device, dtype)``
names it without importing anything. ``get_backend("auto", ...)`` returns that backend wrapped so
that a call it refuses (:class:`BackendUnsupported`, e.g. sdpa and a window) falls back to the
next one in the chain (fa4 -> sdpa -> reference).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

import torch

from .spec import AttnSpec, BackendUnsupported, BlockBackend

__all__ = ["FallbackBackend", "available_backends", "backend_tile", "fa4_installed", "get_backend", "resolve"]

NAMES = ("reference", "sdpa", "fa4")


@functools.cache
def fa4_installed() -> bool:
    """flash-attn-4, CuTe DSL and triton are installed (checked without importing them)."""
    try:
        importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("cutlass", "triton"))


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def available_backends(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[str]:
    """Backends that can run on ``device`` (and ``dtype``), best first."""
    device = _device(device)
    names = []
    if device.type == "cuda":
        if (torch.cuda.get_device_capability(device)[0] in (9, 10) and fa4_installed()
                and dtype in (None, torch.float16, torch.bfloat16)):
            names.append("fa4")
        if dtype != torch.float64:
            names.append("sdpa")
    return names + ["reference"]


def resolve(name: str = "auto", device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> str:
    """The concrete backend name ``name`` stands for on ``device`` for inputs of ``dtype``."""
    if name == "auto":
        return available_backends(device, dtype)[0]
    if name not in NAMES:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
    return name


class FallbackBackend:
    """``auto``: the first backend of ``chain`` that accepts a call runs it."""

    def __init__(self, chain: list[BlockBackend]) -> None:
        self.chain = chain
        self.name = chain[0].name
        self.tile = chain[0].tile

    def _first(self, method: str, *args, **kwargs):
        for backend in self.chain[:-1]:
            try:
                return getattr(backend, method)(*args, **kwargs)
            except BackendUnsupported:
                continue
        return getattr(self.chain[-1], method)(*args, **kwargs)

    def forward(self, q, k, v, spec: AttnSpec, out=None, lse=None):
        return self._first("forward", q, k, v, spec, out=out, lse=lse)

    def backward(self, dout, q, k, v, out, lse, spec: AttnSpec):
        return self._first("backward", dout, q, k, v, out, lse, spec)

    def backward_accumulate(self, dout, q, k, v, out, lse, spec: AttnSpec, grads) -> bool:
        """The first backend's accumulating backward; False where it refuses (the caller then runs
        ``backward`` through the whole chain)."""
        try:
            return self.chain[0].backward_accumulate(dout, q, k, v, out, lse, spec, grads)
        except BackendUnsupported:
            return False

    def begin_backward(self, dout, q, out, lse, spec: AttnSpec):
        """The first backend's AccumBackward, or None (a later backend of the chain, which runs
        only calls the first refuses, is not asked: it would take over every block)."""
        return self.chain[0].begin_backward(dout, q, out, lse, spec)

    def fp32_block_outputs(self, device: torch.device) -> bool:
        """Whether every backend of the chain hands back fp32 block outputs (any of them may run a
        block)."""
        return all(b.fp32_block_outputs(device) for b in self.chain)

    def can_forward_merge(self, q, v) -> bool:
        """Whether the first backend's merging forward runs for these inputs."""
        return self.chain[0].can_forward_merge(q, v)

    def forward_merge(self, q, k, v, spec: AttnSpec, out_acc, planes):
        """The first backend's merging forward, or None (the caller then runs ``forward`` and a merge,
        through the whole chain)."""
        try:
            return self.chain[0].forward_merge(q, k, v, spec, out_acc, planes)
        except BackendUnsupported:
            return None

    def merge_replay(self, q, k, v, spec: AttnSpec, out_acc, planes):
        """The first backend's replay of a merging block that ran (it ran there)."""
        return self.chain[0].merge_replay(q, k, v, spec, out_acc, planes)

    def launches_taped(self, device) -> bool:
        """Whether every backend of the chain's launches are recorded (any of them may run a block)."""
        return all(b.launches_taped(device) for b in self.chain)


def backend_tile(backend: str | BlockBackend) -> int:
    """The token tile uneven sequences are cut to for ``backend`` (a name: FA4's 128 for "fa4" and
    "auto", whose first choice it is; 1 for the others), known before any device or dtype is."""
    if isinstance(backend, str):
        return 128 if backend in ("auto", "fa4") else 1
    return backend.tile


@functools.cache
def _cached(name: str, options: tuple) -> BlockBackend:
    kwargs = dict(options)
    if name == "reference":
        from .reference import ReferenceBackend
        return ReferenceBackend(**kwargs)
    if name == "sdpa":
        from .sdpa import SdpaBackend
        return SdpaBackend(**kwargs)
    from .fa4.backend import Fa4Backend
    return Fa4Backend(**kwargs)


@functools.cache
def _auto(device: torch.device, dtype: torch.dtype | None) -> BlockBackend:
    chain = [_cached(n, ()) for n in available_backends(device, dtype)]
    return chain[0] if len(chain) == 1 else FallbackBackend(chain)


_BACKEND_TYPES: set[type] = set()  # classes whose instances passed the BlockBackend check


def get_backend(name: str | BlockBackend = "auto", device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, **options) -> BlockBackend:
    """The backend object for ``name`` (or ``name`` itself when it already is a backend).

    ``options`` go to a named backend's constructor, e.g. ``get_backend("reference",
    compute_dtype=torch.float64)``; ``dtype`` steers ``auto`` (fa4 needs fp16/bf16).
    """
    if not isinstance(name, str):
        if type(name) not in _BACKEND_TYPES:  # a Protocol isinstance walks every method: once a type
            if not isinstance(name, BlockBackend):
                raise ValueError(f"backend must be a name or a BlockBackend, got {type(name).__name__}")
            _BACKEND_TYPES.add(type(name))
        return name
    if name == "auto":
        if options:
            raise ValueError(f"backend options {sorted(options)} need an explicit backend name, not 'auto'")
        return _auto(_device(device), dtype)
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
    return _cached(resolve(name, device), frozen)
