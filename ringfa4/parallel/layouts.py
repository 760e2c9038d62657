"""How a sequence maps to CP ranks. One class a layout: indices, shard, unshard, positions.

A layout cuts a sequence of ``seq_len`` tokens into ``multiple`` chunks and gives each rank some of
them, kept in increasing global order inside the rank (so a local causal mask equals the global one
between a rank's own tokens). ``segments(seq_len, rank)`` lists ``(global_start, length)`` in local
order; everything else derives from it.

Any length: when ``multiple`` divides ``seq_len`` the chunks are equal; otherwise every chunk but
the last non-empty one holds ``c`` tokens, ``c`` the chunk size rounded up to the block backend's
tile (``tile``: 128 for FA4) where that leaves the last chunk non-empty, else ``ceil(seq_len /
multiple)`` (:func:`chunk_bounds`). So ranks may hold different counts (the ring moves buffers of
the largest); every rank computes the same bounds from ``seq_len``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

__all__ = ["ContiguousLayout", "HybridLayout", "Layout", "ZigzagLayout", "chunk_bounds", "make_layout"]


def chunk_bounds(seq_len: int, n: int, tile: int = 1) -> list[tuple[int, int]]:
    """``(start, length)`` of ``n`` consecutive chunks covering ``seq_len`` tokens (see the module
    doc): equal when ``n`` divides ``seq_len``; else full chunks of ``c`` (tile-aligned where the
    last chunk stays non-empty) followed by one shorter chunk and then empty ones."""
    if seq_len % n == 0:
        c = seq_len // n
        return [(i * c, c) for i in range(n)]
    c = -(-seq_len // n)
    aligned = -(-c // tile) * tile
    if seq_len - (n - 1) * aligned > 0:
        c = aligned
    return [(min(i * c, seq_len), max(0, min(c, seq_len - i * c))) for i in range(n)]


@dataclass(frozen=True)
class Layout:
    """Base: ``world_size`` ranks, ``chunks_per_rank`` equal chunks each."""

    world_size: int
    tile: int = field(default=1, kw_only=True)  # uneven lengths: full chunks are multiples of it (the backend's tile)
    name = "base"
    chunks_per_rank = 1
    ulysses = 1  # the Ulysses degree inside (HybridLayout: its field)

    @property
    def ring_layout(self) -> Layout:
        """The layout of the ring level (itself; HybridLayout: its ring)."""
        return self

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if isinstance(self.tile, bool) or not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"tile must be a positive int, got {self.tile!r}")

    @property
    def multiple(self) -> int:
        """Sequence lengths that are multiples of this cut into equal chunks (others too, unevenly)."""
        return self.world_size * self.chunks_per_rank

    def chunks(self, rank: int) -> list[int]:
        raise NotImplementedError

    def segments(self, seq_len: int, rank: int) -> list[tuple[int, int]]:
        """``(global_start, length)`` of this rank's chunks, in local order (empty ones left out)."""
        bounds = chunk_bounds(seq_len, self.multiple, self.tile)
        return [bounds[i] for i in self.chunks(rank) if bounds[i][1]]

    def rows(self, seq_len: int, rank: int) -> int:
        """Tokens ``rank`` holds of a ``seq_len``-token sequence."""
        return sum(n for _, n in self.segments(seq_len, rank))

    def max_rows(self, seq_len: int) -> int:
        return max(self.all_rows(seq_len))

    def all_rows(self, seq_len: int) -> tuple[int, ...]:
        """Every rank's :meth:`rows` of a ``seq_len``-token sequence, in rank order (the last 64
        (layout, length) pairs kept: a distributed call's metadata check asks on every call)."""
        return _all_rows(self, seq_len)

    def seq_len_of(self, rows: list[int]) -> int:
        """The sequence length whose shards have these per-rank token counts (exact parts)."""
        return sum(rows)

    def indices(self, seq_len: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global token indices (int64) held by ``rank``, in local order."""
        segs = self.segments(seq_len, rank)
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in segs])

    def positions(self, seq_len: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions (for RoPE) of the local tokens: the same as :meth:`indices`."""
        return self.indices(seq_len, rank, device)

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """``rank``'s part of the full tensor ``x`` along ``dim`` (a copy when not one slice)."""
        segs = self.segments(x.shape[dim], rank)
        if len(segs) == 1:
            return x.narrow(dim, segs[0][0], segs[0][1])
        if not segs:
            return x.narrow(dim, 0, 0)
        return torch.cat([x.narrow(dim, s, n) for s, n in segs], dim=dim)

    def split_all(self, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """Every rank's :meth:`shard` of the full ``x`` along ``dim``, contiguous, in rank order: one
        gather (``index_select``; none for a contiguous layout) whose slices they are, where the dims
        before ``dim`` are all 1; else one copy a rank."""
        if x.shape[:dim].numel() != 1:
            return [self.shard(x, dim, r).contiguous() for r in range(self.world_size)]
        order, rows = _rank_order(self, x.shape[dim], x.device)
        return list((x if order is None else x.index_select(dim, order)).contiguous().split_with_sizes(rows, dim))

    def unshard(self, parts: list[torch.Tensor], dim: int, seq_len: int | None = None) -> torch.Tensor:
        """Inverse of :meth:`shard` given every rank's part (rank order); ``seq_len``: the parts
        may be padded past their rows (all-gathered buffers), else they are exact."""
        if len(parts) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} parts, got {len(parts)}")
        if seq_len is None:
            seq_len = self.seq_len_of([p.shape[dim] for p in parts])
        cuts, order = _global_pieces(self, seq_len, tuple(p.shape[dim] for p in parts))
        if not order:
            return parts[0].narrow(dim, 0, 0)
        pieces = [piece for part, sizes in zip(parts, cuts, strict=True) if sizes
                  for piece in part.split_with_sizes(sizes, dim)]  # (one split a rank: its chunks and any padding)
        return torch.cat([pieces[i] for i in order], dim=dim)


@functools.lru_cache(maxsize=64)
def _all_rows(layout: Layout, seq_len: int) -> tuple[int, ...]:
    return tuple(layout.rows(seq_len, r) for r in range(layout.world_size))


@functools.lru_cache(maxsize=16)
def _global_pieces(layout: Layout, seq_len: int, rows: tuple[int, ...]
                   ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """How :meth:`Layout.unshard` cuts parts of ``rows`` rows each: every rank's piece sizes in local
    order (its chunks, then the padding past them, if any), and the index of every chunk among all
    ranks' pieces (rank order), in global order."""
    cuts, chunks, at = [], [], 0
    for rank in range(layout.world_size):
        segs = [(start, n) for start, n in layout.segments(seq_len, rank) if n]
        chunks += [(start, at + j) for j, (start, _) in enumerate(segs)]
        sizes = [n for _, n in segs]
        if rows[rank] > sum(sizes):
            sizes.append(rows[rank] - sum(sizes))
        at += len(sizes)
        cuts.append(tuple(sizes))
    return tuple(cuts), tuple(i for _, i in sorted(chunks))


@functools.lru_cache(maxsize=16)
def _rank_order(layout: Layout, seq_len: int, device: torch.device) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """Every rank's global token indices, concatenated in rank order (int64 on ``device``; None where
    that is the identity, a contiguous layout), and each rank's row count (:meth:`Layout.split_all`; the
    last 16 (layout, length, device) kept, so lengths that change every batch do not pile up)."""
    segs = [layout.segments(seq_len, r) for r in range(layout.world_size)]
    rows = tuple(sum(n for _, n in s) for s in segs)
    flat = [seg for s in segs for seg in s]
    if all(start == sum(n for _, n in flat[:i]) for i, (start, _) in enumerate(flat)):
        return None, rows
    return torch.cat([torch.arange(s, s + n) for s, n in flat]).to(device), rows


@dataclass(frozen=True)
class ContiguousLayout(Layout):
    """Rank r holds tokens ``[r*S/P, (r+1)*S/P)``. Causal picture, P=4 (row = q rank, col = kv
    rank, ``\\`` = diagonal block, ``#`` = full, ``.`` = skipped); rank 3 does 4 blocks, rank 0 one::

        \\ . . .
        # \\ . .
        # # \\ .
        # # # \\
    """

    name = "contiguous"
    chunks_per_rank = 1

    def chunks(self, rank: int) -> list[int]:
        return [rank]


@dataclass(frozen=True)
class ZigzagLayout(Layout):
    """2P chunks; rank r holds chunks r and 2P-1-r, so every rank does the same causal work.
    Causal picture, P=2 (chunks 0..3; rank 0 holds 0,3, rank 1 holds 1,2)::

        chunk:  0 1 2 3        rank 0 rows (0, 3), rank 1 rows (1, 2)
          0     \\ . . .        each rank: 2 diagonal half-blocks + 4 full quarter-blocks
          1     # \\ . .        at step t>0: if src < r, both q chunks x kv chunk src (full);
          2     # # \\ .                    if src > r, q chunk 2P-1-r x both kv chunks (full)
          3     # # # \\
    """

    name = "zigzag"
    chunks_per_rank = 2

    def chunks(self, rank: int) -> list[int]:
        return [rank, 2 * self.world_size - 1 - rank]


@dataclass(frozen=True)
class HybridLayout(Layout):
    """Ulysses x ring: ``world_size = U x R`` ranks, rank ``p = g*U + u``. Ring rank ``g`` (a group
    of U ranks, the NVLink domain) holds its ``ring`` layout tokens; inside the group they are cut
    into U consecutive pieces in local order (equal, or differing by one token), and rank u holds
    piece u. After the Ulysses all-to-all (pieces concatenated in u order) every rank of group g
    holds exactly ring rank g's tokens for 1/U of the heads. Causal picture: the ring layout's, with
    each row split in U."""

    ring: Layout = None  # type: ignore[assignment]
    ulysses: int = 1
    name = "hybrid"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ring is None or self.ring.world_size * self.ulysses != self.world_size:
            raise ValueError(f"hybrid layout needs ring.world_size x ulysses == world_size {self.world_size}")

    @property
    def ring_layout(self) -> Layout:
        return self.ring

    @property
    def multiple(self) -> int:
        return self.ring.multiple * self.ulysses

    def pieces(self, seq_len: int, g: int) -> list[tuple[int, int]]:
        """``(start, length)`` of the U pieces of ring rank g's local rows (sizes differ by at most
        one; equal when U divides them)."""
        return chunk_bounds(self.ring.rows(seq_len, g), self.ulysses)

    def segments(self, seq_len: int, rank: int) -> list[tuple[int, int]]:
        g, u = divmod(rank, self.ulysses)
        lo, n = self.pieces(seq_len, g)[u]
        hi = lo + n  # in the ring rank's local order
        out, at = [], 0
        for start, n in self.ring.segments(seq_len, g):
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                out.append((start + a - at, b - a))
            at += n
        return out


_LAYOUTS = {"contiguous": ContiguousLayout, "zigzag": ZigzagLayout}


def make_layout(name: str | Layout, world_size: int, tile: int = 1) -> Layout:
    """The layout ``name`` ("zigzag" | "contiguous", or a Layout, returned as it is) over
    ``world_size`` ranks; ``tile``: full chunks of uneven lengths are multiples of it."""
    if isinstance(name, Layout):
        if name.world_size != world_size:
            raise ValueError(f"layout world_size must be {world_size}, got {name.world_size}")
        return name
    if name not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {name!r}")
    return _LAYOUTS[name](world_size, tile=tile)
