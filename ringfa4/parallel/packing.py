"""Packed documents under CP: the layout applied inside every document.

A packed batch is ``(total, h, d)`` with global int32 ``cu_seqlens`` (documents of any length,
zero allowed). Each document is cut into the layout's chunks (zigzag: 2P, rank r holds chunks r
and 2P-1-r; contiguous: P) whose lengths differ by at most one token - no padding. A rank's local
tokens are *part-major*: first its first chunk of every document (in document order), then its
second chunk of every document. Every (q part, kv part) pair of a ring step then tiles contiguous
local ranges, so one varlen call covers all documents.

    pack = cp.pack(cu_seqlens)                  # or cp.pack_from_position_ids(position_ids)
    x_local = pack.shard(x, dim=0); pos = pack.positions(); x = pack.unshard(x_local, dim=0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import Layout
from .memo import cached_method

__all__ = ["Packing", "cu_seqlens_from_position_ids"]


def _chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """n chunks of ``length`` tokens, sizes differing by at most one: [(start, size)]."""
    base, extra = divmod(length, n)
    out, at = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((at, size))
        at += size
    return out


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 cu_seqlens of a packed row whose positions restart at 0 at every document."""
    pos = position_ids.reshape(-1).cpu()
    if pos.numel() == 0:
        return torch.zeros(1, dtype=torch.int32)
    starts = torch.nonzero(pos == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("position_ids must start at 0 and restart at 0 at every document")
    d = pos[1:] - pos[:-1]
    if bool(((d != 1) & (pos[1:] != 0)).any()):
        raise ValueError("position_ids must count up by one inside a document and restart at 0")
    return torch.tensor(starts + [pos.numel()], dtype=torch.int32)


def _parse_cu_seqlens(cu_seqlens) -> tuple[int, ...]:
    """cu_seqlens (a 1-D integer tensor or sequence) as a tuple of ints; a ValueError naming what
    is wrong (and the first offending index) otherwise."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dim()}-D {cu_seqlens.dtype}")
        cu = cu_seqlens.tolist()
    else:
        cu = list(cu_seqlens)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in cu):
            raise ValueError(f"cu_seqlens must hold ints, got {cu[:16]}")
    if len(cu) < 1 or cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:16]} (entry 0 must be 0)")
    bad = next((i for i in range(1, len(cu)) if cu[i] < cu[i - 1]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:16]}: index {bad} ({cu[bad]}) "
                         f"is below index {bad - 1} ({cu[bad - 1]})")
    return tuple(int(x) for x in cu)


def _unshard(placement, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    shape = list(parts[0].shape)
    shape[dim] = placement.total
    out = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        out.index_copy_(dim, placement.indices(rank, part.device), part.narrow(dim, 0, placement.rows(rank)))
    return out


@dataclass(frozen=True)
class Segment:
    """A run of a rank's local tokens: ``local`` start, ``doc`` index, ``pos`` (first token's
    position in the document), ``length``, ``part`` (which of the rank's chunks), ``start``
    (global token index)."""

    local: int
    doc: int
    pos: int
    length: int
    part: int
    start: int


class Packing:
    """The layout inside each document of a packed batch (see module docstring)."""

    def __init__(self, cu_seqlens, layout: Layout) -> None:
        self.cu = _parse_cu_seqlens(cu_seqlens)
        self.layout = layout
        self.world_size = layout.world_size
        self.total = self.cu[-1]
        self.doc_lengths = tuple(b - a for a, b in zip(self.cu, self.cu[1:]))
        self._schedules: dict = {}

    def __repr__(self) -> str:
        return f"Packing({len(self.doc_lengths)} docs, {self.total} tokens, {self.layout.name} over {self.world_size})"

    def schedule(self, kind: type, causal: bool, window: tuple):
        """One schedule object per (kind, mask) for the life of this packing, so its calls and their
        device-side cu_seqlens are built once per batch, not once per layer."""
        key = (kind, causal, tuple(window))
        if key not in self._schedules:
            self._schedules[key] = kind(self, causal, tuple(window))
        return self._schedules[key]

    @cached_method
    def segments(self, rank: int) -> tuple[Segment, ...]:
        """Local token runs of ``rank`` in local (part-major) order; empty chunks omitted."""
        chunks = self.layout.chunks(rank)
        n = self.layout.multiple
        out, local = [], 0
        for part, c in enumerate(chunks):
            for doc, (start, length) in enumerate(zip(self.cu, self.doc_lengths)):
                pos, size = _chunk_bounds(length, n)[c]
                if size:
                    out.append(Segment(local, doc, pos, size, part, start + pos))
                    local += size
        return tuple(out)

    @cached_method
    def rows(self, rank: int) -> int:
        return sum(s.length for s in self.segments(rank))

    @property
    def max_rows(self) -> int:
        return max(self.rows(r) for r in range(self.world_size))

    @cached_method
    def _indices(self, rank: int, device) -> torch.Tensor:
        segs = self.segments(rank)
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(s.start, s.start + s.length) for s in segs]).to(device)

    def indices(self, rank: int, device=None) -> torch.Tensor:
        """Global token indices (int64) of ``rank``'s local tokens, in local order."""
        return self._indices(rank, torch.device(device) if device is not None else torch.device("cpu"))

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Positions inside each document (restarting at 0) of the local tokens (for RoPE)."""
        segs = self.segments(rank)
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(s.pos, s.pos + s.length, device=device) for s in segs])

    @cached_method
    def cu_seqlens(self, device) -> torch.Tensor:
        """The batch's int32 cu_seqlens on ``device``, built once and trusted (no check reads it back)."""
        from ..kernels.validate import mark_valid

        cu = torch.tensor(self.cu, dtype=torch.int32).to(device)
        mark_valid(cu, max(self.doc_lengths, default=0))
        return cu

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        if x.shape[dim] != self.total:
            raise ValueError(f"tensor to shard has {x.shape[dim]} tokens along dim {dim}, expected the pack's "
                             f"total {self.total}")
        return x.index_select(dim, self.indices(rank, x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of :meth:`shard` given every rank's part (parts may be padded past their rows)."""
        return _unshard(self, parts, dim)

    def work(self, rank: int, causal: bool = True) -> int:
        """(query, key) pairs of attention ``rank`` computes (load balance)."""
        total = 0
        for s in self.segments(rank):
            if causal:  # rows pos..pos+len-1 see pos+1 .. pos+len keys
                total += s.length * s.pos + s.length * (s.length + 1) // 2
            else:
                total += s.length * self.doc_lengths[s.doc]
        return total


class HybridPacking:
    """Packed documents under Ulysses U x ring R: ring rank g's local tokens (part-major, from the
    ring-level :class:`Packing`) are cut into U consecutive pieces of near-equal size, and CP rank
    ``p = g*U + u`` holds piece u. The Ulysses all-to-all (pieces concatenated in u order) gives
    every rank of group g exactly ring rank g's tokens."""

    def __init__(self, ring: Packing, ulysses: int) -> None:
        self.ring, self.ulysses = ring, ulysses
        self.world_size = ring.world_size * ulysses
        self.total, self.cu, self.doc_lengths = ring.total, ring.cu, ring.doc_lengths

    def pieces(self, g: int) -> list[tuple[int, int]]:
        """(start, size) of the U pieces of ring rank g's local rows."""
        return _chunk_bounds(self.ring.rows(g), self.ulysses)

    def rows(self, rank: int) -> int:
        g, u = divmod(rank, self.ulysses)
        return self.pieces(g)[u][1]

    @property
    def max_rows(self) -> int:
        return max(self.rows(p) for p in range(self.world_size))

    def _narrow(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        g, u = divmod(rank, self.ulysses)
        start, size = self.pieces(g)[u]
        return full[start:start + size]

    def indices(self, rank: int, device=None) -> torch.Tensor:
        return self._narrow(self.ring.indices(rank // self.ulysses, device), rank)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        return self._narrow(self.ring.positions(rank // self.ulysses, device), rank)

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        return x.index_select(dim, self.indices(rank, x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of :meth:`shard` given every rank's part (parts may be padded past their rows)."""
        return _unshard(self, parts, dim)
