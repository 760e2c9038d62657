"""Keep attention outputs across activation checkpointing, so recomputing a layer skips attention.

A checkpointed layer runs its forward twice: once in the forward pass (its saved tensors are
dropped) and again in backward to rebuild them. The second attention forward (a whole ring at long
context) is pure waste when its ``(out, lse)`` were kept: the backward only needs q, k, v (which the
recompute rebuilds cheaply) and the *global* out and lse. The checkpointing code opens a phase
around each layer call; the attention ops of this package consult it:

    cache = OutputCache()
    with cache_phase(cache, key=layer_index, phase="record"):   # first forward: keep (out, lse)
        ...
    with cache_phase(cache, key=layer_index, phase="take"):     # recompute: reuse, then drop
        ...

``"peek"`` reuses without dropping (a no-grad rebuild of a layer input that a later recompute will
need again). Outside any phase (or with no cache) the ops compute as usual. Costs one out
``(b, s, h, d)`` and one lse ``(b, h, s)`` fp32 per cached attention call until its backward.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

__all__ = ["OutputCache", "cache_phase", "record_output", "replay_output"]

PHASES = ("record", "peek", "take")


@dataclass
class OutputCache:
    """Per-key lists of ``(out, lse)`` in call order (several attention calls a layer allowed)."""

    slots: dict = field(default_factory=dict)
    hits: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for v in self.slots.values() for pair in v for t in pair)

    def clear(self) -> None:
        self.slots.clear()


@dataclass
class _Phase:
    cache: OutputCache
    key: object
    phase: str
    calls: int = 0


_current: contextvars.ContextVar[_Phase | None] = contextvars.ContextVar("ringfa4_output_cache", default=None)


@contextlib.contextmanager
def cache_phase(cache: OutputCache | None, key, phase: str):
    """Within this block, attention calls record / peek / take the cached outputs of ``key``."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if cache is None:
        yield
        return
    if phase == "record":
        cache.slots[key] = []
    token = _current.set(_Phase(cache, key, phase))
    try:
        yield
    finally:
        _current.reset(token)
        if phase == "take":
            cache.slots.pop(key, None)


def replay_output() -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept ``(out, lse)`` of this attention call (fresh tensor objects sharing the storage),
    or None when not replaying (then compute, and call :func:`record_output`)."""
    p = _current.get()
    if p is None or p.phase == "record":
        return None
    slot = p.cache.slots.get(p.key)
    if slot is None or p.calls >= len(slot):
        raise RuntimeError(f"attention output cache: no kept output for call {p.calls} of layer {p.key!r} "
                           "(the recompute must make the same attention calls as the forward)")
    out, lse = slot[p.calls]
    p.calls += 1
    p.cache.hits += 1
    return out.detach(), lse.detach()


def record_output(out: torch.Tensor, lse: torch.Tensor) -> None:
    """Keep this call's result when recording (a no-op otherwise)."""
    p = _current.get()
    if p is not None and p.phase == "record":
        p.cache.slots[p.key].append((out.detach(), lse.detach()))
