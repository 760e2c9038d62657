"""Packed documents under CP: which rank holds which tokens of every document.

A packed batch is ``(total, h, d)`` with global int32 ``cu_seqlens`` (documents of any length,
zero allowed). Two placements:

- **balanced** (``cp.pack``'s default; :mod:`ringfa4.parallel.dispatch`): documents short enough
  stay whole on one rank, longer ones are cut into tile-aligned pieces over the m ranks they need
  (m <= P; a zigzag pair of equal pieces a holder, or pieces sized to fill ranks), so that every
  rank holds about the same tokens and causal FLOPs.
  Only the split documents' tokens *travel* (ring hops or the all-gather);
- **per document** (modes "ring" / "allgather"): every document cut into the layout's chunks
  (zigzag: 2P, rank r holds chunks r and 2P-1-r; contiguous: P) whose lengths differ by at most
  one token; every token travels.

A rank's local tokens are *part-major*: with the per-document placement, chunk by chunk, each
chunk's documents in order; with the balanced placement, its first piece of every
travelling document it holds pieces of, then its second piece of every one that has one, and so on
(a document's pieces in position order, as the dense ring's zigzag layout has them), each part's
pieces heaviest first: by their end position in the document, latest first; then its whole
documents, longest first. The travelling tokens are a prefix of the local rows (``travel_rows``),
and every (q part, kv part) pair of a ring step tiles contiguous local ranges, so one varlen call
covers all documents. Heaviest first because FA4's varlen tile schedulers hand out tiles in the
order of the call's segments (a forward query tile of a segment sees its keys up to the tile's end,
a backward key tile its queries): a heavy segment last in a call starts its longest tiles when the
others are done and leaves SMs idle while they finish. A list schedule of every call's tiles on
132 SMs (``benchmarks/tile_schedule.py``: a model, not a timing; forward and backward) puts the
slowest rank of ``benchmarks/varlen_sim.py``'s mixes at P = 8 at 1.018-1.080 of its share of the one
full call's tile work in this order, against 1.025-1.080 in document order (short 128k 1.018
against 1.037, uniform 256k 1.025 against 1.032; the backward gains, the forward alone moves by
0.002 either way).

    pack = cp.pack(cu_seqlens)                  # or cp.pack_from_position_ids(position_ids)
    x_local = pack.shard(x, dim=0); pos = pack.positions(); x = pack.unshard(x_local, dim=0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.host_copy import to_device
from .dispatch import DocPlacement, balance_documents, piece_pairs, tile_pairs
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
    position in the document), ``length``, ``part`` (which of the rank's pieces: 0, 1, ...; a
    whole document ``WHOLE``), ``start`` (global token index)."""

    local: int
    doc: int
    pos: int
    length: int
    part: int
    start: int

    WHOLE = 1 << 20

    @property
    def travels(self) -> bool:
        """Whether this run's K/V leave the rank (a piece of a split document)."""
        return self.part != Segment.WHOLE


class Packing:
    """The placement of a packed batch's documents on the ring's ranks (see module docstring).

    ``balanced``: the cost-balanced placement (:func:`~ringfa4.parallel.dispatch.balance_documents`,
    pieces multiples of ``layout.tile``); else the layout's chunks inside every document."""

    def __init__(self, cu_seqlens, layout: Layout, balanced: bool = False) -> None:
        self.cu = _parse_cu_seqlens(cu_seqlens)
        self.layout = layout
        self.world_size = layout.world_size
        self.total = self.cu[-1]
        self.doc_lengths = tuple(b - a for a, b in zip(self.cu, self.cu[1:]))
        self.placement: DocPlacement | None = (
            balance_documents(self.doc_lengths, self.world_size, layout.tile) if balanced else None)
        self._schedules: dict = {}

    def __repr__(self) -> str:
        how = "balanced" if self.placement is not None else self.layout.name
        return f"Packing({len(self.doc_lengths)} docs, {self.total} tokens, {how} over {self.world_size})"

    @property
    def balanced(self) -> bool:
        return self.placement is not None

    def split_docs(self) -> tuple[int, ...]:
        """Indices of the documents whose tokens travel (every one without the balanced placement)."""
        if self.placement is None:
            return tuple(range(len(self.doc_lengths)))
        return self.placement.split

    @cached_method
    def gather_groups(self, n: int) -> tuple[tuple[int, ...], ...]:
        """The travelling documents (document order, empty ones left out) cut into at most ``n``
        consecutive groups of about equal causal pairs (a group closes once the pairs so far reach
        its share): what the all-gather mode moves, computes and returns one group at a
        time, so one group's collective overlaps the previous group's attention."""
        docs = [d for d in self.split_docs() if self.doc_lengths[d]]
        pairs = [self.doc_lengths[d] * (self.doc_lengths[d] + 1) // 2 for d in docs]
        n, total = min(n, len(docs)), sum(pairs)
        groups, cur, acc = [], [], 0
        for d, c in zip(docs, pairs):
            cur.append(d)
            acc += c
            if len(groups) < n - 1 and acc * n >= total * (len(groups) + 1):
                groups.append(tuple(cur))
                cur = []
        if cur:
            groups.append(tuple(cur))
        return tuple(groups)

    def schedule(self, kind: type, causal: bool, window: tuple):
        """One schedule object per (kind, mask) for the life of this packing, so its calls and their
        device-side cu_seqlens are built once per batch, not once per layer."""
        key = (kind, causal, tuple(window))
        if key not in self._schedules:
            self._schedules[key] = kind(self, causal, tuple(window))
        return self._schedules[key]

    @cached_method
    def segments(self, rank: int) -> tuple[Segment, ...]:
        """Local token runs of ``rank`` in local (part-major) order; empty pieces omitted."""
        out, local = [], 0
        for part, doc, pos, size in self._runs(rank):
            if size:
                out.append(Segment(local, doc, pos, size, part, self.cu[doc] + pos))
                local += size
        return tuple(out)

    def _runs(self, rank: int):
        """(part, doc, pos, size) in local order."""
        if self.placement is None:
            n = self.layout.multiple
            for part, c in enumerate(self.layout.chunks(rank)):
                for doc, length in enumerate(self.doc_lengths):
                    yield (part, doc, *_chunk_bounds(length, n)[c])
            return
        pl = self.placement
        split = pl.split
        parts = max((len(pl.pieces(doc, rank)) for doc in split), default=0)
        for part in range(parts):  # each part's heaviest first (see the module doc)
            held = [(doc, *pl.bounds(doc)[pl.pieces(doc, rank)[part]]) for doc in split
                    if part < len(pl.pieces(doc, rank))]
            for doc, pos, size in sorted(held, key=lambda run: -(run[1] + run[2])):
                yield part, doc, pos, size
        whole = [doc for doc, owner in enumerate(pl.owner) if owner == rank]
        for doc in sorted(whole, key=lambda doc: -self.doc_lengths[doc]):
            yield Segment.WHOLE, doc, 0, self.doc_lengths[doc]

    @cached_method
    def rows(self, rank: int) -> int:
        return sum(s.length for s in self.segments(rank))

    @cached_method
    def travel_rows(self, rank: int) -> int:
        """Local rows whose K/V travel: a prefix of the local order (all of them per document)."""
        return sum(s.length for s in self.segments(rank) if s.travels)

    @cached_method
    def piece_ends(self, rank: int) -> dict[int, int]:
        """Per travelling document ``rank`` holds pieces of, the end (document position) of its
        last piece: under the causal mask, how many of that document's keys its rows see."""
        ends: dict[int, int] = {}
        for s in self.segments(rank):
            if s.travels:
                ends[s.doc] = max(ends.get(s.doc, 0), s.pos + s.length)
        return ends

    @property
    def max_rows(self) -> int:
        return max(self.rows(r) for r in range(self.world_size))

    @property
    def max_travel_rows(self) -> int:
        return max(self.travel_rows(r) for r in range(self.world_size))

    def describe(self, num_kv_heads: int | None = None, head_dim: int | None = None, itemsize: int = 2) -> str:
        """The placement and the balance reached: per rank tokens, causal pairs, whole / split
        documents and the split documents' keys its pieces see (causal: what the all-gather mode's
        exchange delivers to it); max / mean tokens and FLOPs; rows (and, given the K/V heads and
        head dim, bytes) each ring hop moves."""
        P, docs = self.world_size, len(self.doc_lengths)
        split = self.split_docs()
        toks = [self.rows(r) for r in range(P)]
        pairs, tiles = [self.work(r) for r in range(P)], [self.tile_work(r) for r in range(P)]
        lines = [f"{self!r}: {len(split)} of {docs} documents split, {docs - len(split)} whole"]
        for r in range(P):
            whole = sum(1 for s in self.segments(r) if not s.travels)
            lines.append(f"  rank {r}: {toks[r]} tokens ({self.travel_rows(r)} travel), {pairs[r]} causal pairs, "
                         f"{whole} whole document{'' if whole == 1 else 's'}, "
                         f"{sum(self.piece_ends(r).values())} keys of split ones seen")
        ratio = lambda xs: max(xs) * len(xs) / sum(xs) if sum(xs) else 1.0  # noqa: E731
        lines.append(f"  balance (max / mean): tokens {ratio(toks):.3f}, FLOPs {ratio(pairs):.3f} "
                     f"({ratio(tiles):.3f} in whole {self.layout.tile}-token tiles)")
        hop = self.max_travel_rows
        per_hop = f"{hop} rows a hop" if hop and P > 1 else "no hop (nothing travels)"
        if hop and P > 1 and num_kv_heads and head_dim:
            per_hop += f", {2 * hop * num_kv_heads * head_dim * itemsize / 2**20:.2f} MiB of K/V a hop"
        lines.append(f"  {per_hop}")
        return "\n".join(lines)

    @cached_method
    def _indices(self, rank: int, device) -> torch.Tensor:
        segs = self.segments(rank)
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return to_device(torch.cat([torch.arange(s.start, s.start + s.length) for s in segs]), device)

    def indices(self, rank: int, device=None) -> torch.Tensor:
        """Global token indices (int64) of ``rank``'s local tokens, in local order."""
        return self._indices(rank, torch.device(device) if device is not None else torch.device("cpu"))

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Positions inside each document (restarting at 0) of the local tokens (for RoPE)."""
        segs = self.segments(rank)
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return to_device(torch.cat([torch.arange(s.pos, s.pos + s.length) for s in segs]), device)

    @cached_method
    def cu_seqlens(self, device) -> torch.Tensor:
        """The batch's int32 cu_seqlens on ``device``, built once and trusted (no check reads it back)."""
        from ..kernels.validate import mark_valid

        cu = to_device(torch.tensor(self.cu, dtype=torch.int32), device)
        mark_valid(cu, max(self.doc_lengths, default=0))
        return cu

    def _check_total(self, x: torch.Tensor, dim: int) -> None:
        if x.shape[dim] != self.total:
            raise ValueError(f"tensor to shard has {x.shape[dim]} tokens along dim {dim}, expected the pack's "
                             f"total {self.total}")

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        self._check_total(x, dim)
        return x.index_select(dim, self.indices(rank, x.device))

    @cached_method
    def rank_order(self, device) -> torch.Tensor:
        """Every rank's global token indices (:meth:`indices`), concatenated in rank order."""
        return torch.cat([self.indices(r, device) for r in range(self.world_size)])

    def split_all(self, x: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """Every rank's :meth:`shard` of the whole pack ``x`` along ``dim``, contiguous, in rank order:
        slices of one gather where the dims before ``dim`` are all 1 (q, k, v, out), else one gather a
        rank (an lse ``(h, total)``)."""
        self._check_total(x, dim)
        if x.shape[:dim].numel() != 1:
            return [self.shard(x, dim, r) for r in range(self.world_size)]
        gathered = x.index_select(dim, self.rank_order(x.device))
        return list(gathered.split_with_sizes([self.rows(r) for r in range(self.world_size)], dim))

    def unshard(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of :meth:`shard` given every rank's part (parts may be padded past their rows):
        one scatter of their rows, concatenated."""
        rows = torch.cat([p.narrow(dim, 0, self.rows(r)) for r, p in enumerate(parts)], dim)
        shape = list(parts[0].shape)
        shape[dim] = self.total
        return parts[0].new_empty(shape).index_copy_(dim, self.rank_order(parts[0].device), rows)

    def work(self, rank: int, causal: bool = True) -> int:
        """(query, key) pairs of attention ``rank`` computes (load balance)."""
        total = 0
        for s in self.segments(rank):
            if causal:  # rows pos..pos+len-1 see pos+1 .. pos+len keys
                total += piece_pairs(s.pos, s.length)
            else:
                total += s.length * self.doc_lengths[s.doc]
        return total

    def tile_work(self, rank: int) -> int:
        """The causal pairs ``rank``'s kernels compute: whole tiles of the layout's tile
        (:func:`~ringfa4.parallel.doc_placement.tile_pairs`; what the balanced solver's last step evens)."""
        return sum(tile_pairs(s.pos, s.length, self.layout.tile) for s in self.segments(rank))


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
